"""Issue 18 item 8 for rollback: an edit made outside stepfs between a
rollback's plan and its switch is never overwritten; each path's token is
checked just before its rename, as a commit's are (design semantics 10 and
14).  Kernel-free: the edit is made from a ``store.durable`` hook at the
intent's durable COMMIT (after the plan, before the switch)."""

from __future__ import annotations

import os

from sqlalchemy import select

from history_helpers import open_ws, write
from stepfs.store import durable, schema
from stepfs.store import rollback as rb
from stepfs.store.publish import OUTSIDE_CHANGE
from stepfs.store.workspace import Workspace
from test_commit_outside_changes import EditAtIntent


def _conflicts(ws: Workspace) -> list[tuple[bytes, str]]:
    with ws.db.read() as conn:
        return sorted((r.path, r.reason) for r in conn.execute(select(schema.conflicts)))


def _two_layers(tmp_path):
    ws_path = tmp_path / "ws"
    ws_path.mkdir()
    for name in ("a.txt", "b.txt", "c.txt"):
        (ws_path / name).write_text(f"{name} at 0\n")
    (ws_path / "link").symlink_to("a.txt")
    ws, view = open_ws(ws_path)
    write(view, "/a.txt", b"a at 1\n")
    write(view, "/b.txt", b"b at 1\n")
    write(view, "/n.txt", b"n made at 1\n")
    view.unlink("/c.txt")
    view.unlink("/link")
    view.symlink("/link", "b.txt")
    assert view.commit(message="layer 1") == 1
    view.close()
    return ws_path, ws


def test_a_rollback_leaves_a_path_edited_outside_after_its_plan(tmp_path):
    ws_path, ws = _two_layers(tmp_path)
    try:
        def edit():
            (ws_path / "a.txt").write_text("a edited outside, longer\n")  # would be rolled back to 'a at 0'
            (ws_path / "c.txt").write_text("c made outside\n")  # would be restored
            (ws_path / "n.txt").write_text("n edited outside\n")  # would be removed
            os.unlink(ws_path / "link")
            os.symlink("c.txt", ws_path / "link")  # would be pointed back at a.txt

        hook = EditAtIntent(edit)
        with durable.installed(hook):
            result = rb.rollback(ws, 0)
        assert hook.done and result.layer == 2
        assert (ws_path / "a.txt").read_text() == "a edited outside, longer\n"
        assert (ws_path / "c.txt").read_text() == "c made outside\n"
        assert (ws_path / "n.txt").read_text() == "n edited outside\n"
        assert os.readlink(ws_path / "link") == "c.txt"
        # What nobody touched is rolled back.
        assert (ws_path / "b.txt").read_text() == "b.txt at 0\n"
        assert _conflicts(ws) == [(b"a.txt", OUTSIDE_CHANGE), (b"c.txt", OUTSIDE_CHANGE),
                                  (b"link", OUTSIDE_CHANGE), (b"n.txt", OUTSIDE_CHANGE)]
        with ws.db.read() as conn:
            kept = {r.path: r.oid for r in conn.execute(select(schema.conflicts))}
            # The version the rollback could not write is kept.
            assert ws.objects.read_all(conn, kept[b"a.txt"]) == b"a.txt at 0\n"
    finally:
        ws.close()
    with Workspace.open(str(ws_path)) as again:  # committed, nothing left to recover
        with again.db.read() as conn:
            assert conn.execute(select(schema.layers.c.state).where(schema.layers.c.number == 2)).scalar() \
                == "committed"


def test_a_rollback_without_outside_edits_records_no_conflict(tmp_path):
    ws_path, ws = _two_layers(tmp_path)
    try:
        assert rb.rollback(ws, 0).layer == 2
        assert _conflicts(ws) == []
        assert (ws_path / "a.txt").read_text() == "a.txt at 0\n"
        assert (ws_path / "c.txt").read_text() == "c.txt at 0\n"
        assert not (ws_path / "n.txt").exists()
        assert os.readlink(ws_path / "link") == "a.txt"
    finally:
        ws.close()
