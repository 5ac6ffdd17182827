"""Reused workspace listings (overlayfs/core/listings.py) never hide a change:
the view's readdir lists a workspace directory again whenever its stamp
changed, and never keeps a listing of a directory that changed too
recently for its ctime to tell a later change apart (no kernel)."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import pytest

from stepfs.overlayfs.core import listings
from stepfs.overlayfs.core.listings import RACY_COARSE_NS, RACY_NS, Listings, settled
from viewkit import open_view

S = 1_000_000_000


def _names(view, path: str) -> dict[str, int]:
    return {name: kind for name, kind, _ino in view.readdir(path)[2:]}


def _settle(path) -> None:
    """Wait until ``path``'s last change is old enough for its listing to be
    kept (a condition polled, at most RACY_NS)."""
    while not settled(os.lstat(path), time.time_ns()):
        time.sleep(0.01)


@pytest.fixture
def counted(monkeypatch):
    """Counts the workspace directory reads (Root.listdir) per path."""
    calls: dict[str, int] = {}
    real = listings.Root.listdir

    def listdir(self, path, decoded=False):
        calls[path] = calls.get(path, 0) + 1
        return real(self, path, decoded)

    monkeypatch.setattr(listings.Root, "listdir", listdir)
    return calls


def test_settled_needs_an_old_enough_ctime():
    now = 1_700_000_000 * S + 123_456_789
    at = lambda ctime: SimpleNamespace(st_ctime_ns=ctime)  # noqa: E731
    assert not settled(at(now), now)
    assert not settled(at(now - RACY_NS // 2), now)
    assert settled(at(now - RACY_NS - 1), now)
    # Whole seconds: a filesystem that may store nothing finer.
    whole = (now // S - 1) * S
    assert now - whole > RACY_NS
    assert not settled(at(whole), now)
    assert settled(at(whole - RACY_COARSE_NS), now)


def test_a_settled_listing_is_reused_until_the_directory_changes(tmp_path, counted):
    ws, view = open_view(tmp_path)
    d = tmp_path / "ws" / "d"
    d.mkdir()
    (d / "a").write_bytes(b"a")
    _settle(d)
    assert _names(view, "/d") == {"a": 0o100000}
    assert _names(view, "/d") == {"a": 0o100000}
    assert counted == {b"d": 1}, "a settled, unchanged directory is read once"

    (d / "b").write_bytes(b"b")  # outside the mount, no watcher involved
    assert _names(view, "/d") == {"a": 0o100000, "b": 0o100000}
    os.unlink(d / "a")
    assert _names(view, "/d") == {"b": 0o100000}
    os.unlink(d / "b")
    os.mkdir(d / "b")  # same name, another kind
    assert _names(view, "/d") == {"b": 0o040000}
    assert counted[b"d"] == 4


def test_a_directory_replaced_from_outside_is_listed_anew(tmp_path, counted):
    ws, view = open_view(tmp_path)
    d, other = tmp_path / "ws" / "d", tmp_path / "ws" / "other"
    d.mkdir()
    other.mkdir()
    (other / "new").write_bytes(b"")
    _settle(d)
    _settle(other)
    assert _names(view, "/d") == {}
    os.rename(other, d)  # over the empty d: another inode at the same path
    assert _names(view, "/d") == {"new": 0o100000}


def test_a_recently_changed_directory_is_not_kept(tmp_path, counted, monkeypatch):
    ws, view = open_view(tmp_path)
    d = tmp_path / "ws" / "d"
    d.mkdir()
    (d / "a").write_bytes(b"a")
    # Whatever the machine's speed: the directory changed "just now".
    ctime = os.lstat(d).st_ctime_ns
    monkeypatch.setattr(listings, "time", SimpleNamespace(time_ns=lambda: ctime + RACY_NS // 2))
    _names(view, "/d")
    _names(view, "/d")
    assert counted == {b"d": 2}


def test_an_upper_directory_over_a_workspace_one_sees_outside_changes(tmp_path, counted):
    ws, view = open_view(tmp_path)
    d = tmp_path / "ws" / "d"
    d.mkdir()
    (d / "a").write_bytes(b"a")
    view.chmod("/d", 0o700)  # the directory is now an upper node, not opaque
    _settle(d)
    assert _names(view, "/d") == {"a": 0o100000}
    (d / "b").write_bytes(b"b")
    assert _names(view, "/d") == {"a": 0o100000, "b": 0o100000}


def test_the_cache_is_bounded(tmp_path):
    ws, view = open_view(tmp_path)
    for name in ("d1", "d2", "d3"):
        (tmp_path / "ws" / name).mkdir()
        _settle(tmp_path / "ws" / name)
    kept = Listings(view.root, limit=2)
    for name in ("d1", "d2", "d3"):
        assert kept.listdir(name.encode(), os.lstat(tmp_path / "ws" / name)) == []
    assert len(kept._kept) <= 2
