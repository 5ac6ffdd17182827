"""Issue 18 item 8 and the commit's temporary directory: a commit never
deletes or overwrites what it never saw (design semantics 14).  A path
changed outside stepfs after the step saw it, or made outside inside a
directory the step removes, is left as it is and recorded as an
``outside-change`` conflict; the rest of the step is committed.  Kernel-free
(the overlay core and the store); decoys live in temp dirs."""

from __future__ import annotations

import os

from sqlalchemy import select

from history_helpers import after_the_removal_tick, open_ws, write
from stepfs.store import durable, layers, schema
from stepfs.store.publish import OUTSIDE_CHANGE
from stepfs.store.workspace import Workspace


def _conflicts(ws: Workspace) -> list[tuple[bytes, str]]:
    with ws.db.read() as conn:
        return sorted((r.path, r.reason) for r in conn.execute(select(schema.conflicts)))


def _entries(ws: Workspace, number: int) -> list[bytes]:
    with ws.db.read() as conn:
        return [e.path for e in layers.entries(conn, number)]


def test_files_made_outside_inside_a_directory_the_step_removes_are_left(tmp_path):
    ws_path = tmp_path / "ws"
    (ws_path / "d" / "sub").mkdir(parents=True)
    (ws_path / "d" / "a").write_text("a\n")
    (ws_path / "d" / "sub" / "b").write_text("b\n")
    (ws_path / "gone").mkdir()
    (ws_path / "gone" / "c").write_text("c\n")
    ws, view = open_ws(ws_path)
    try:
        for path in ("/d/a", "/d/sub/b", "/gone/c"):
            view.unlink(path)
        for path in ("/d/sub", "/d", "/gone"):
            view.rmdir(path)
        after_the_removal_tick()
        # Made outside after the step removed their directories: never seen by it.
        (ws_path / "d").joinpath("new").write_text("made outside\n")
        (ws_path / "d" / "sub").joinpath("deeper").write_text("also outside\n")
        assert view.commit(message="rm -rf d gone") == 1
        # What the step saw is removed; what it never saw is kept, with the
        # directories that hold it, and recorded.
        assert not (ws_path / "gone").exists()
        assert not (ws_path / "d" / "a").exists() and not (ws_path / "d" / "sub" / "b").exists()
        assert (ws_path / "d" / "new").read_text() == "made outside\n"
        assert (ws_path / "d" / "sub" / "deeper").read_text() == "also outside\n"
        assert _entries(ws, 1) == [b"d/a", b"d/sub/b", b"gone", b"gone/c"]
        assert _conflicts(ws) == [(b"d", OUTSIDE_CHANGE), (b"d/new", OUTSIDE_CHANGE),
                                  (b"d/sub", OUTSIDE_CHANGE), (b"d/sub/deeper", OUTSIDE_CHANGE)]
    finally:
        ws.close()


class EditAtIntent:
    """A ``store.durable`` hook that, at the intent's durable COMMIT (after
    the plan captured every path, before the switch), runs ``edit`` once:
    an edit made outside stepfs between a commit's plan and its switch."""

    def __init__(self, edit):
        self.edit = edit
        self.done = False

    def before(self, op: str, args: tuple) -> None:
        if op == "commit" and args[0] and not self.done:
            self.done = True
            self.edit()

    def after(self, op: str, args: tuple) -> None:
        pass


def test_an_edit_made_outside_between_the_plan_and_the_switch_is_not_overwritten(tmp_path):
    ws_path = tmp_path / "ws"
    ws_path.mkdir()
    for name in ("a.txt", "b.txt", "c.txt", "n.txt"):
        (ws_path / name).write_text(f"{name} old\n")
    os.unlink(ws_path / "n.txt")
    ws, view = open_ws(ws_path)
    try:
        write(view, "/a.txt", b"a mine\n")
        write(view, "/b.txt", b"b mine\n")
        write(view, "/n.txt", b"n mine\n")
        view.unlink("/c.txt")

        def edit():
            (ws_path / "a.txt").write_text("a edited outside, longer\n")
            (ws_path / "c.txt").write_text("c edited outside\n")
            (ws_path / "n.txt").write_text("n made outside\n")

        hook = EditAtIntent(edit)
        with durable.installed(hook):
            assert view.commit(message="over an outside edit") == 1
        assert hook.done
        assert (ws_path / "a.txt").read_text() == "a edited outside, longer\n"
        assert (ws_path / "c.txt").read_text() == "c edited outside\n"
        assert (ws_path / "n.txt").read_text() == "n made outside\n"
        assert (ws_path / "b.txt").read_text() == "b mine\n"
        assert _conflicts(ws) == [(b"a.txt", OUTSIDE_CHANGE), (b"c.txt", OUTSIDE_CHANGE),
                                  (b"n.txt", OUTSIDE_CHANGE)]
        with ws.db.read() as conn:
            kept = {r.path: r.oid for r in conn.execute(select(schema.conflicts))}
            # The step's own version of a file it could not write is kept.
            assert ws.objects.read_all(conn, kept[b"a.txt"]) == b"a mine\n"
    finally:
        ws.close()
    with Workspace.open(str(ws_path)) as again:  # nothing pending, nothing left to recover
        with again.db.read() as conn:
            assert conn.execute(select(schema.layers.c.state).where(schema.layers.c.number == 1)).scalar() \
                == "committed"


def test_a_tmp_directory_swapped_for_a_symlink_does_not_redirect_a_commit(tmp_path):
    ws_path = tmp_path / "ws"
    ws_path.mkdir()
    (ws_path / "a.txt").write_text("old\n")
    decoy = tmp_path / "decoy"
    decoy.mkdir()
    (decoy / "keep-me").write_text("not the store's\n")
    (decoy / "L1-0").write_text("a decoy temporary name\n")
    ws, view = open_ws(ws_path)
    try:
        write(view, "/a.txt", b"new\n")
        write(view, "/b.txt", b"b\n")
        tmp = ws_path / ".stepfs" / "tmp"
        os.rename(tmp, ws_path / ".stepfs" / "tmp-moved")
        os.symlink(decoy, tmp)
        assert view.commit(message="through the held tmp handle") == 1
    finally:
        ws.close()
    assert sorted(os.listdir(decoy)) == ["L1-0", "keep-me"]
    assert (decoy / "keep-me").read_text() == "not the store's\n"
    assert (decoy / "L1-0").read_text() == "a decoy temporary name\n"
    assert (ws_path / "a.txt").read_text() == "new\n"
    assert (ws_path / "b.txt").read_text() == "b\n"


def test_spare_and_retired_directories_swapped_for_symlinks_do_not_redirect_a_commit(tmp_path):
    """The same for ``.stepfs/retired`` (names of replaced inodes, deleted
    after the commit) and ``.stepfs/spare``: followed by name, the sweep
    deleted every file of the directory a link named."""
    ws_path = tmp_path / "ws"
    ws_path.mkdir()
    (ws_path / "a.txt").write_text("old\n")
    decoys = {}
    for sub in ("retired", "spare"):
        decoys[sub] = tmp_path / f"decoy-{sub}"
        decoys[sub].mkdir()
        (decoys[sub] / "keep-me").write_text(f"not the store's {sub}\n")
    ws, view = open_ws(ws_path)
    try:
        write(view, "/a.txt", b"new\n")  # replaces a file with one link: its inode is retired
        for sub, decoy in decoys.items():
            os.rename(ws_path / ".stepfs" / sub, ws_path / ".stepfs" / f"{sub}-moved")
            os.symlink(decoy, ws_path / ".stepfs" / sub)
        assert view.commit(message="through the held handles") == 1
        ws.spares.sweep()
        ws.spares.fill(2)
    finally:
        ws.close()
    for sub, decoy in decoys.items():
        assert os.listdir(decoy) == ["keep-me"], sub
        assert (decoy / "keep-me").read_text() == f"not the store's {sub}\n"
    assert (ws_path / "a.txt").read_text() == "new\n"
