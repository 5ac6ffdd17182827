"""KernelCache's record of cached negative names (libfuse/notify.py), without
a mount: what a forget expires, the limit, and a forget racing a lookup."""

from __future__ import annotations

from stepfs.overlayfs.daemon.libfuse import notify
from stepfs.overlayfs.daemon.libfuse.notify import KernelCache


def test_a_forget_expires_the_name_and_everything_below_it(monkeypatch):
    kc = KernelCache()
    for path in ("/a/b/x", "/a/y", "/c"):
        assert kc.note_negative(path, 1, path.rsplit("/", 1)[1].encode(), 60, kc.forgets)
    kc.forget("/a/b/x/deeper")  # nothing recorded there
    assert kc.negatives_noted() == 3
    kc.forget("/a")
    assert kc.negatives_noted() == 1
    kc.forget("/c")
    assert kc.negatives_noted() == 0 and kc._above == {}


def test_a_forget_while_the_view_was_asked_keeps_the_answer_uncached():
    kc = KernelCache()
    seen = kc.forgets
    kc.forget("/elsewhere")  # the watcher, between the view's answer and the reply
    assert not kc.note_negative("/x", 1, b"x", 60, seen)
    assert kc.note_negative("/x", 1, b"x", 60, kc.forgets)


def test_beyond_the_limit_expired_records_go_first_then_nothing_is_cached(monkeypatch):
    monkeypatch.setattr(notify, "NEGATIVE_LIMIT", 2)
    kc = KernelCache()
    assert kc.note_negative("/old", 1, b"old", 0.0, kc.forgets)  # expired at once
    assert kc.note_negative("/a", 1, b"a", 60, kc.forgets)
    assert kc.note_negative("/b", 1, b"b", 60, kc.forgets)  # /old pruned
    assert not kc.note_negative("/c", 1, b"c", 60, kc.forgets)
    assert kc.negatives_noted() == 2


def test_a_name_noted_again_moves_to_the_end_and_pruning_stops_at_the_first_live_record(monkeypatch):
    monkeypatch.setattr(notify, "NEGATIVE_LIMIT", 3)
    kc = KernelCache()
    assert kc.note_negative("/a/x", 1, b"x", 0.0, kc.forgets)  # expired at once
    assert kc.note_negative("/b", 1, b"b", 0.0, kc.forgets)
    assert kc.note_negative("/a/x", 1, b"x", 60, kc.forgets)  # live again, now last
    assert list(kc._negatives) == ["/b", "/a/x"] and kc._above == {"/a": 1, "/": 2}
    assert kc.note_negative("/c", 1, b"c", 60, kc.forgets)
    assert kc.note_negative("/d", 1, b"d", 60, kc.forgets)  # /b (expired, in front) pruned
    assert list(kc._negatives) == ["/a/x", "/c", "/d"]
    assert not kc.note_negative("/e", 1, b"e", 60, kc.forgets)  # the front is live: nothing to prune
    kc.forget("/a")
    assert list(kc._negatives) == ["/c", "/d"] and kc._above == {"/": 2}
