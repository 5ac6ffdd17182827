"""Issue 18 item 8, the replaced-directory gap: a directory a step removes
and then *replaces* (a new directory, a file or a symlink at its name) must
leave what was made inside it from outside after the removal, as a removed
one already does (design semantics 14): the names are kept and recorded as
``outside-change`` conflicts.  Kernel-free (the overlay core and the store)."""

from __future__ import annotations

import os

import pytest
from sqlalchemy import select

from history_helpers import after_the_removal_tick, open_ws, read, write
from stepfs.overlayfs.core.view import Overlay
from stepfs.store import schema, staging
from stepfs.store.publish import OUTSIDE_CHANGE
from stepfs.store.workspace import Workspace


def _conflicts(ws: Workspace) -> list[tuple[bytes, str]]:
    with ws.db.read() as conn:
        return sorted((r.path, r.reason) for r in conn.execute(select(schema.conflicts)))


def _workspace(tmp_path):
    ws_path = tmp_path / "ws"
    (ws_path / "d" / "sub").mkdir(parents=True)
    (ws_path / "d" / "seen").write_text("seen by the step\n")
    (ws_path / "d" / "sub" / "seen2").write_text("also seen\n")
    return ws_path


def _remove_d(view: Overlay) -> None:
    view.unlink("/d/seen")
    view.unlink("/d/sub/seen2")
    view.rmdir("/d/sub")
    view.rmdir("/d")


def _made_outside(ws_path) -> None:
    after_the_removal_tick()
    (ws_path / "d" / "new").write_text("made outside\n")
    (ws_path / "d" / "sub" / "deeper").write_text("also outside\n")


def _assert_outside_kept(ws_path) -> None:
    assert (ws_path / "d" / "new").read_text() == "made outside\n"
    assert (ws_path / "d" / "sub" / "deeper").read_text() == "also outside\n"
    assert not (ws_path / "d" / "seen").exists()
    assert not (ws_path / "d" / "sub" / "seen2").exists()


def test_a_directory_removed_and_made_again_keeps_what_was_made_outside(tmp_path):
    ws_path = _workspace(tmp_path)
    ws, view = open_ws(ws_path)
    try:
        _remove_d(view)
        _made_outside(ws_path)
        view.mkdir("/d", 0o755)
        write(view, "/d/mine", b"made in the mount\n")
        assert view.commit(message="rm -rf d; mkdir d") == 1
        _assert_outside_kept(ws_path)
        assert (ws_path / "d" / "mine").read_text() == "made in the mount\n"
        assert _conflicts(ws) == [(b"d/new", OUTSIDE_CHANGE), (b"d/sub", OUTSIDE_CHANGE),
                                  (b"d/sub/deeper", OUTSIDE_CHANGE)]
    finally:
        ws.close()


@pytest.mark.parametrize("how", ["file", "symlink", "rename"])
def test_a_directory_replaced_by_a_non_directory_is_left_when_made_into_outside(tmp_path, how):
    ws_path = _workspace(tmp_path)
    (ws_path / "other").write_text("moved over d\n")
    ws, view = open_ws(ws_path)
    try:
        _remove_d(view)
        _made_outside(ws_path)
        if how == "file":
            write(view, "/d", b"a file where d was\n")
        elif how == "symlink":
            view.symlink("/d", "elsewhere")
        else:
            view.rename("/other", "/d")
        write(view, "/b.txt", b"the rest of the step\n")
        assert view.commit(message=f"d replaced by a {how}") == 1
        # d cannot become a non-directory without deleting what it holds now:
        # it stays a directory, and the step's d is kept as a conflict.
        _assert_outside_kept(ws_path)
        assert (ws_path / "b.txt").read_text() == "the rest of the step\n"
        got = _conflicts(ws)
        assert (b"d", OUTSIDE_CHANGE) in got and (b"d/new", OUTSIDE_CHANGE) in got
        if how == "file":
            with ws.db.read() as conn:
                oid = conn.execute(select(schema.conflicts.c.oid).where(schema.conflicts.c.path == b"d")).scalar()
                assert ws.objects.read_all(conn, oid) == b"a file where d was\n"
    finally:
        ws.close()


def test_a_replaced_directory_without_outside_changes_is_replaced(tmp_path):
    """The rule only spares what changed after the removal: a file that
    replaces a directory nothing touched outside is published."""
    ws_path = _workspace(tmp_path)
    ws, view = open_ws(ws_path)
    try:
        _remove_d(view)
        write(view, "/d", b"a file now\n")
        assert view.commit(message="d is a file") == 1
        assert (ws_path / "d").read_text() == "a file now\n"
        assert _conflicts(ws) == []
    finally:
        ws.close()


def test_removed_again_keeps_the_first_removal_time(tmp_path):
    """rm -r d; mkdir d; rmdir d: the workspace's d was hidden since the
    first removal, so a name made outside between the two removals was never
    seen either."""
    ws_path = _workspace(tmp_path)
    ws, view = open_ws(ws_path)
    try:
        _remove_d(view)
        _made_outside(ws_path)
        view.mkdir("/d", 0o755)
        view.rmdir("/d")
        assert view.commit(message="d gone twice") == 1
        _assert_outside_kept(ws_path)
    finally:
        ws.close()


def test_the_removal_time_survives_a_restart_of_the_view(tmp_path):
    """The removal time of a replaced path is in its staged row: a mount
    restarted (or a CLI step after a crash) still spares the outside names."""
    ws_path = _workspace(tmp_path)
    ws, view = open_ws(ws_path)
    try:
        _remove_d(view)
        _made_outside(ws_path)
        view.mkdir("/d", 0o755)
        view.sync_rows()
        with ws.db.read() as conn:
            (row,) = [r for r in staging.load(conn, view.step) if r.path == b"d"]
        assert row.kind == "dir" and row.removed_ns is not None and row.base == "dir:755"
        view.close()
        again = Overlay(ws, str(tmp_path / "mnt-of-ws"))  # the same mount: its open step
        try:
            write(again, "/d/mine", b"after the restart\n")
            assert read(again, "/d/mine") == b"after the restart\n"
            assert again.commit(message="after a restart") == 1
        finally:
            again.close()
        _assert_outside_kept(ws_path)
    finally:
        ws.close()


def test_a_row_without_a_removal_time_reads_as_before(tmp_path):
    """Rows written before this change (no removal suffix) load unchanged."""
    ws_path = tmp_path / "ws"
    ws_path.mkdir()
    ws = Workspace.open(str(ws_path), create=True)
    try:
        with ws.db.write() as conn:
            step = staging.open_step(conn, "m")
            staging.put(conn, step, staging.StagedRow(b"x", "dir", 0o40755, base="dir:755", opaque=True))
            staging.put(conn, step, staging.StagedRow(b"y", "dir", 0o40755, base="dir:755", opaque=True,
                                                      removed_ns=123))
            raw = dict(conn.execute(select(schema.staged.c.path, schema.staged.c.base)).all())
            got = {r.path: (r.base, r.removed_ns) for r in staging.load(conn, step)}
        assert got == {b"x": ("dir:755", None), b"y": ("dir:755", 123)}
        assert raw[b"x"] == "dir:755" and raw[b"y"] != "dir:755"  # an older reader sees a changed base
    finally:
        ws.close()
    assert os.path.isdir(ws_path)
