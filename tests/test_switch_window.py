"""The one-call window between a commit's per-path token check and its
rename (issue 18 item 8): a name made outside stepfs in that window, at a
path the layer creates, is never replaced (``RENAME_NOREPLACE``); it is
left and recorded as an ``outside-change`` conflict.  (For a path that
exists the window cannot be closed: ``store/switch.py`` says why.)
Kernel-free: the outside change is made from a ``store.durable`` hook just
before the rename."""

from __future__ import annotations

import os

import pytest

from sqlalchemy import select

from history_helpers import open_ws, write
from stepfs.store import durable, schema
from stepfs.store import rollback as rb
from stepfs.store.publish import OUTSIDE_CHANGE


class BeforeRename:
    """Runs ``edit`` once, just before the rename that publishes a path
    whose name is ``name`` (after the switch checked that path)."""

    def __init__(self, name: bytes, edit):
        self.name, self.edit, self.done = name, edit, False

    def before(self, op: str, args: tuple) -> None:
        if op == "rename" and args[1] == self.name and not self.done:
            self.done = True
            self.edit()

    def after(self, op: str, args: tuple) -> None:
        pass


def _conflicts(ws) -> list[tuple[bytes, str]]:
    with ws.db.read() as conn:
        return sorted((r.path, r.reason) for r in conn.execute(select(schema.conflicts)))


def test_a_name_made_outside_just_before_a_new_files_rename_is_kept(tmp_path):
    ws_path = tmp_path / "ws"
    ws_path.mkdir()
    ws, view = open_ws(ws_path)
    try:
        write(view, "/new.txt", b"mine\n")
        write(view, "/other.txt", b"other\n")
        hook = BeforeRename(b"new.txt", lambda: (ws_path / "new.txt").write_text("made outside\n"))
        with durable.installed(hook):
            assert view.commit(message="new files") == 1
        assert hook.done
        assert (ws_path / "new.txt").read_text() == "made outside\n"
        assert (ws_path / "other.txt").read_text() == "other\n"
        assert _conflicts(ws) == [(b"new.txt", OUTSIDE_CHANGE)]
        with ws.db.read() as conn:
            oid = conn.execute(select(schema.conflicts.c.oid)).scalar()
            assert ws.objects.read_all(conn, oid) == b"mine\n"
    finally:
        ws.close()
    assert not [n for n in os.listdir(ws_path) if n not in ("new.txt", "other.txt", ".stepfs")]


def test_a_path_a_rollback_restores_made_outside_just_before_its_rename_is_kept(tmp_path):
    ws_path = tmp_path / "ws"
    ws_path.mkdir()
    (ws_path / "c.txt").write_text("c at 0\n")
    ws, view = open_ws(ws_path)
    try:
        view.unlink("/c.txt")
        assert view.commit(message="c removed") == 1
        view.close()
        hook = BeforeRename(b"c.txt", lambda: (ws_path / "c.txt").write_text("c made outside\n"))
        with durable.installed(hook):
            assert rb.rollback(ws, 0).layer == 2
        assert hook.done
        assert (ws_path / "c.txt").read_text() == "c made outside\n"
        assert _conflicts(ws) == [(b"c.txt", OUTSIDE_CHANGE)]
    finally:
        ws.close()


def test_a_removed_directory_replaced_by_a_file_still_publishes(tmp_path):
    """A path the switch itself emptied (a directory the layer turns into a
    file) is published with the same no-replace rename."""
    ws_path = tmp_path / "ws"
    (ws_path / "d").mkdir(parents=True)
    ws, view = open_ws(ws_path)
    try:
        view.rmdir("/d")
        write(view, "/d", b"a file now\n")
        assert view.commit(message="d is a file") == 1
        assert (ws_path / "d").read_text() == "a file now\n"
        assert _conflicts(ws) == []
    finally:
        ws.close()


class BeforeMkdir:
    def __init__(self, name: bytes, edit):
        self.name, self.edit, self.done = name, edit, False

    def before(self, op: str, args: tuple) -> None:
        if op == "mkdir" and args[0] == self.name and not self.done:
            self.done = True
            self.edit()

    def after(self, op: str, args: tuple) -> None:
        pass


def test_a_name_made_outside_where_a_commit_makes_a_directory_is_kept(tmp_path):
    """``mkdir`` never replaces: a file made at the new directory's path in
    the window is left, with what the layer puts below it, and recorded; the
    rest of the layer is committed (it failed the commit as a whole, and
    left the layer pending, before)."""
    ws_path = tmp_path / "ws"
    ws_path.mkdir()
    ws, view = open_ws(ws_path)
    try:
        view.mkdir("/d", 0o755)
        view.mkdir("/d/sub", 0o755)
        write(view, "/d/sub/f.txt", b"below d\n")
        write(view, "/other.txt", b"other\n")
        hook = BeforeMkdir(b"d", lambda: (ws_path / "d").write_text("a file made outside\n"))
        with durable.installed(hook):
            assert view.commit(message="new directory") == 1
        assert hook.done
        assert view.readonly_reason is None
        assert (ws_path / "d").read_text() == "a file made outside\n"
        assert (ws_path / "other.txt").read_text() == "other\n"
        assert _conflicts(ws) == [(b"d", OUTSIDE_CHANGE), (b"d/sub", OUTSIDE_CHANGE),
                                  (b"d/sub/f.txt", OUTSIDE_CHANGE)]
        with ws.db.read() as conn:
            oid = conn.execute(select(schema.conflicts.c.oid).where(schema.conflicts.c.path == b"d/sub/f.txt")).scalar()
            assert ws.objects.read_all(conn, oid) == b"below d\n"
    finally:
        ws.close()


class BeforeOp:
    def __init__(self, op: str, name: bytes, edit):
        self.op, self.name, self.edit, self.done = op, name, edit, False

    def before(self, op: str, args: tuple) -> None:
        if op == self.op and args[0] == self.name and not self.done:
            self.done = True
            self.edit()

    def after(self, op: str, args: tuple) -> None:
        pass


@pytest.mark.parametrize("kind", ["file", "dir"])
def test_a_path_removed_outside_while_the_commit_removes_it_commits(tmp_path, kind):
    """Both sides want it gone: the commit's unlink or rmdir finding it gone
    already is no failure (it failed the whole commit, pending, before)."""
    ws_path = tmp_path / "ws"
    ws_path.mkdir()
    if kind == "file":
        (ws_path / "gone").write_text("old\n")
    else:
        (ws_path / "gone").mkdir()
    ws, view = open_ws(ws_path)
    try:
        (view.unlink if kind == "file" else view.rmdir)("/gone")
        write(view, "/other.txt", b"other\n")
        remove = (lambda: os.unlink(ws_path / "gone")) if kind == "file" else (lambda: os.rmdir(ws_path / "gone"))
        hook = BeforeOp("unlink" if kind == "file" else "rmdir", b"gone", remove)
        with durable.installed(hook):
            assert view.commit(message="removal") == 1
        assert hook.done and view.readonly_reason is None
        assert not (ws_path / "gone").exists()
        assert (ws_path / "other.txt").read_text() == "other\n"
        assert _conflicts(ws) == []
    finally:
        ws.close()
