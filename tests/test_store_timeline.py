"""The history in pages (``store.timeline``) and a rollback's compare-and-swap
on the head (``expect_head``): kernel-free tier, real stores."""

from __future__ import annotations

import pytest

from stepfs.store import layers, publish, rollback, timeline
from stepfs.store.errors import HeadMoved, NoSuchLayer
from store_kit import Stager, open_workspace


def commit(ws, stage, message: str = "", meta: dict | None = None) -> int:
    st = Stager(ws)
    stage(st)
    return publish.commit_step(ws, st.step, message=message, meta=meta or {})


@pytest.fixture
def ws(tmp_path):
    """1: a, b (meta tool=edit); 2: a again (tool=shell); 3: c/x, c (tool=edit, n=3);
    4: b deleted, a back to its layer-1 bytes (tool=shell)."""
    w = open_workspace(tmp_path / "ws")
    commit(w, lambda st: (st.file("a", b"one\n"), st.file("b", b"bee\n" * 100)), "first", {"tool": "edit"})
    commit(w, lambda st: st.file("a", b"one\ntwo\n"), "second", {"tool": "shell"})
    commit(w, lambda st: (st.dir("c"), st.file("c/x", b"x\n")), "third", {"tool": "edit", "n": 3})
    commit(w, lambda st: (st.whiteout("b"), st.file("a", b"one\n")), "fourth", {"tool": "shell"})
    yield w
    w.close()


def numbers(page) -> list[int]:
    return [r["number"] for r in page.rows]


def test_pages_walk_the_history_newest_first(ws):
    with ws.db.read() as conn:
        p1 = timeline.layer_page(ws.objects, conn, limit=2)
        p2 = timeline.layer_page(ws.objects, conn, limit=2, before=p1.next_before)
        p3 = timeline.layer_page(ws.objects, conn, limit=2, before=p2.next_before)
    assert (numbers(p1), p1.next_before) == ([4, 3], 3)
    assert (numbers(p2), p2.next_before) == ([2, 1], 1)
    assert (numbers(p3), p3.next_before) == ([0], None)


def test_rows_carry_counts_lines_and_metadata(ws):
    with ws.db.read() as conn:
        rows = {r["number"]: r for r in timeline.layer_page(ws.objects, conn).rows}
    assert rows[1]["files"] == 2 and rows[1]["added"] == 2 and rows[1]["meta"] == {"tool": "edit"}
    assert (rows[1]["lines_added"], rows[1]["lines_removed"]) == (101, 0)
    assert (rows[2]["lines_added"], rows[2]["lines_removed"]) == (1, 0)
    assert (rows[4]["deleted"], rows[4]["modified"]) == (1, 1)


def test_new_content_counts_objects_no_earlier_layer_referenced(ws):
    with ws.db.read() as conn:
        got = timeline.new_content(conn, [1, 2, 3, 4])
    assert got[1] == len(b"one\n") + len(b"bee\n" * 100)
    assert got[2] == len(b"one\ntwo\n")
    assert got[3] == len(b"x\n")
    assert 4 not in got  # "one\n" came back, b's bytes were there already


def test_filters_by_path_and_by_metadata(ws):
    with ws.db.read() as conn:
        assert numbers(timeline.layer_page(ws.objects, conn, path=b"a")) == [4, 2, 1]
        assert numbers(timeline.layer_page(ws.objects, conn, path=b"c")) == [3]
        assert numbers(timeline.layer_page(ws.objects, conn, path=b"nothing")) == []
        assert numbers(timeline.layer_page(ws.objects, conn, meta={"tool": "shell"})) == [4, 2]
        assert numbers(timeline.layer_page(ws.objects, conn, meta={"tool": "edit", "n": "3"})) == [3]
        page = timeline.layer_page(ws.objects, conn, meta={"tool": "edit"}, limit=1)
        assert (numbers(page), page.next_before) == ([3], 3)
        assert numbers(timeline.layer_page(ws.objects, conn, meta={"tool": "edit"}, before=3)) == [1]


def test_a_metadata_filter_reads_past_its_first_batch(ws, monkeypatch):
    monkeypatch.setattr(timeline, "_BATCH", 1)
    with ws.db.read() as conn:
        assert numbers(timeline.layer_page(ws.objects, conn, meta={"tool": "edit"})) == [3, 1]


def test_card_page_slices_files_and_keeps_the_totals(ws):
    with ws.db.read() as conn:
        card, changes = timeline.card_page(ws.objects, conn, 1, offset=1, limit=1)
    assert card["total_files"] == 2 and [f["path"] for f in card["files"]] == ["b"]
    assert [c.path for c in changes] == [b"b"]
    assert (card["added"], card["lines_added"]) == (2, 101)  # the whole layer's


def test_card_page_of_a_large_layer_does_not_count_lines(ws, monkeypatch):
    monkeypatch.setattr(timeline, "LINE_COUNT_FILES", 1)
    with ws.db.read() as conn:
        card, _ = timeline.card_page(ws.objects, conn, 1, limit=1)
        row = timeline.layer_page(ws.objects, conn, before=2).rows[0]
    assert card["lines_added"] is None and card["added"] == 2
    assert row["lines_added"] is None and row["files"] == 2


def test_touching_and_change_at(ws):
    with ws.db.read() as conn:
        assert [(t["number"], t["op"]) for t in timeline.touching(conn, b"a")] == [(4, "modified"), (2, "modified"),
                                                                                  (1, "added")]
        assert [(t["number"], t["op"]) for t in timeline.touching(conn, b"b")] == [(4, "deleted"), (1, "added")]
        assert timeline.change_at(conn, 2, b"a").after.kind == "file"
        assert timeline.change_at(conn, 2, b"b") is None
        with pytest.raises(NoSuchLayer):
            timeline.card_page(ws.objects, conn, 9)


def test_activity_changes_with_the_head_and_the_open_steps(ws):
    with ws.db.read() as conn:
        before = timeline.activity(conn)
    st = Stager(ws)
    st.file("new", b"n\n")
    with ws.db.read() as conn:
        staged = timeline.activity(conn)
    publish.commit_step(ws, st.step)
    with ws.db.read() as conn:
        after = timeline.activity(conn)
    assert before != staged != after and after[0] == before[0] + 1


def test_rollback_against_a_moved_head_is_refused_and_writes_nothing(ws):
    with pytest.raises(HeadMoved) as err:
        rollback.rollback(ws, 1, expect_head=3)
    assert err.value.head == 4 and "moved from layer 3 to layer 4" in str(err.value)
    with ws.db.read() as conn:
        assert layers.head(conn) == 4
    assert not ws.root.exists(b"b")
    res = rollback.rollback(ws, 2, [b"a"], expect_head=4)
    assert res.layer == 5
    with open(f"{ws.path}/a", "rb") as f:
        assert f.read() == b"one\ntwo\n"
