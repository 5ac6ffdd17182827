"""The commit's two phases (``store.publish.Commit``, ``overlayfs.committing.ViewCommit``), kernel-free.

``c.publish()`` leaves the layer on disk and ``pending``; ``c.complete()``
marks it committed and consumes the step's rows; leaving the block after a
publish completes the layer even when the caller failed in between (a
daemon whose answer could not be sent), and the view's lock is held from
the publish to the bookkeeping of ``complete`` only.
"""

from __future__ import annotations

import os
import threading

import pytest
from sqlalchemy import select

from stepfs.store import publish, schema
from stepfs.store.errors import NothingToCommit
from store_kit import Stager, open_workspace
from viewkit import open_view, read_all, write_file


def _states(ws) -> dict[int, str]:
    with ws.db.read() as conn:
        return dict(conn.execute(select(schema.layers.c.number, schema.layers.c.state)).all())


@pytest.fixture
def ws(tmp_path):
    w = open_workspace(tmp_path / "ws", {"old.txt": ("file", 0o644, b"old\n")})
    try:
        yield w
    finally:
        w.close()


def test_publish_leaves_the_layer_on_disk_and_pending_until_complete(ws):
    st = Stager(ws)
    st.file("new.txt", b"new\n")
    with publish.begin(ws, st.step, message="two phases") as c:
        number = c.publish()
        assert number == 1
        assert open(os.path.join(ws.path, "new.txt"), "rb").read() == b"new\n"
        assert _states(ws)[1] == "pending"
        assert [r.path for r in st.rows()] == [b"new.txt"]  # consumed only by the completion
        c.complete()
        assert _states(ws)[1] == "committed"
        assert st.rows() == []
    # The commit lock is free again: another commit (here: recovery) gets it.
    assert publish.recover(ws) == []


def test_a_failure_between_the_phases_still_completes_the_layer_and_is_raised(ws):
    st = Stager(ws)
    st.file("new.txt", b"new\n")

    class AnswerLost(Exception):
        pass

    with pytest.raises(AnswerLost):
        with publish.begin(ws, st.step) as c:
            c.publish()
            raise AnswerLost()
    assert _states(ws) == {0: "committed", 1: "committed"}
    assert st.rows() == []


def test_nothing_to_commit_drops_the_no_op_rows_and_writes_no_layer(ws):
    st = Stager(ws)
    st.file("old.txt", b"old\n")  # equals the workspace
    with pytest.raises(NothingToCommit):
        with publish.begin(ws, st.step) as c:
            c.publish()
    assert _states(ws) == {0: "committed"}
    assert st.rows() == []


def test_the_view_holds_its_lock_from_publish_to_its_bookkeeping_only(tmp_path):
    _ws, view = open_view(tmp_path)
    write_file(view, "/a.txt", b"a\n")
    other: dict = {}

    def reader() -> None:
        other["staged"] = view.staged_paths()  # takes the view's lock

    with view.begin_commit("phases") as c:
        assert c.publish() == 1
        t = threading.Thread(target=reader)
        t.start()
        t.join(0.3)
        assert t.is_alive(), "the view's lock was free between publish and complete"
        assert not view.commit_idle.is_set()
        c.complete()
        t.join(10)
        assert other["staged"] == []  # it ran after the bookkeeping: nothing staged any more
    assert view.settled.is_set() and view.commit_idle.is_set()
    assert read_all(view, "/a.txt") == b"a\n"
    write_file(view, "/b.txt", b"b\n")
    assert view.commit("next") == 2
