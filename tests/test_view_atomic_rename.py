"""A rename is one change of the staged rows, however many rows it touches.

With ``row_delay=0`` (the library default) the view writes the rows of each
change at once.  A directory rename, a RENAME_EXCHANGE and a rename over an
existing name each change several rows (the old place, the new place, every
path below them): they must reach the store in ONE transaction, or a daemon
killed between two of them restarts with the subtree lost or half moved.

Each test forks a child that opens the view and does the rename, SIGKILLed
just before its k-th database COMMIT (``store.durable``), for every k the
rename reaches; the parent then opens the view again (a daemon restart) and
checks that it shows exactly the tree before the rename or the tree after it.
"""

from __future__ import annotations

import shutil

import pytest

from crashkit import Counter, KillAt, fork_run
from stepfs.overlayfs.core.view import RENAME_EXCHANGE, Overlay
from stepfs.store import durable
from stepfs.store.workspace import Workspace
from viewkit import view_manifest, write_file

COMMIT = frozenset({"commit"})
#: One mountpoint for every copy of a workspace, so each copy's view opens
#: the same step (steps are per mountpoint).
MOUNTPOINT = "/atomic-rename/mnt"


def _staged_tree(tmp_path) -> None:
    """A workspace with a directory of its own (``w``) and a staged subtree
    (``d``), files ``x`` and ``y`` staged, all rows in the store."""
    ws_dir = tmp_path / "ws"
    (ws_dir / "w" / "deep").mkdir(parents=True)
    (ws_dir / "w" / "one.txt").write_bytes(b"workspace one\n")
    (ws_dir / "w" / "deep" / "two.txt").write_bytes(b"workspace two\n")
    (ws_dir / "plain.txt").write_bytes(b"plain\n")
    ws = Workspace.open(str(ws_dir), create=True)
    view = Overlay(ws, mountpoint=MOUNTPOINT)
    view.mkdir("/d", 0o755)
    view.mkdir("/d/sub", 0o750)
    write_file(view, "/d/a.txt", b"staged a\n")
    write_file(view, "/d/sub/b.txt", b"staged b\n")
    view.symlink("/d/link", "a.txt")
    write_file(view, "/w/deep/three.txt", b"staged inside a workspace dir\n")
    write_file(view, "/x", b"x content\n")
    write_file(view, "/y", b"y content\n")
    view.close()
    ws.close()


def _open(ws_dir) -> tuple[Workspace, Overlay]:
    ws = Workspace.open(str(ws_dir))
    return ws, Overlay(ws, mountpoint=MOUNTPOINT, row_delay=0)


def _tree(ws_dir) -> dict:
    ws, view = _open(ws_dir)
    try:
        return view_manifest(view)
    finally:
        view.close()
        ws.close()


RENAMES = {
    "staged dir": ("/d", "/e", 0),
    "workspace dir with staged files": ("/w", "/v", 0),
    "staged dir over an empty dir": ("/d", "/empty", 0),
    "exchange of two dirs": ("/d", "/w", RENAME_EXCHANGE),
    "exchange of a dir and a file": ("/d", "/plain.txt", RENAME_EXCHANGE),
    "file over a file": ("/x", "/y", 0),
}


@pytest.mark.parametrize("case", sorted(RENAMES))
def test_a_rename_killed_at_any_commit_keeps_the_old_or_the_new_tree(tmp_path, case):
    old, new, flags = RENAMES[case]
    template = tmp_path / "template"
    template.mkdir()
    _staged_tree(template)
    if new == "/empty":
        ws, view = _open(template / "ws")
        view.mkdir("/empty", 0o700)
        view.close()
        ws.close()
    before = _tree(template / "ws")

    def run(dst, hook) -> str:
        shutil.copytree(template, dst, symlinks=True)

        def body() -> None:
            ws, view = _open(dst / "ws")
            with durable.installed(hook):
                view.rename(old, new, flags)

        return fork_run(body)

    # A clean run: the tree after, and how many COMMITs the rename makes.
    clean = tmp_path / "clean"
    counter = Counter(COMMIT)
    shutil.copytree(template, clean, symlinks=True)
    ws, view = _open(clean / "ws")
    with durable.installed(counter):
        view.rename(old, new, flags)
    view.close()
    ws.close()
    after = _tree(clean / "ws")
    assert after != before
    assert counter.n >= 1

    outcomes = []
    for k in range(1, counter.n + 1):
        dst = tmp_path / f"kill{k}"
        assert run(dst, KillAt(k, COMMIT)) == "killed"
        got = _tree(dst / "ws")
        if got == before:
            outcomes.append("old")
        elif got == after:
            outcomes.append("new")
        else:
            lost = sorted(p for p in set(before) | set(after) if got.get(p) not in (before.get(p), after.get(p)))
            missing = sorted(set(before) - set(got))
            raise AssertionError(f"{case}: killed at COMMIT {k} of {counter.n}: neither the old nor the new "
                                 f"tree; missing {missing}, differing {lost}")
    assert outcomes[0] == "old"  # killed before its first COMMIT: nothing of it reached the store


def test_a_rename_writes_its_rows_in_one_transaction(tmp_path):
    """The row writes of a directory rename are one COMMIT (copying up a
    workspace file for the move stores its object first: a COMMIT of its
    own that no staged row refers to until the rename's)."""
    _staged_tree(tmp_path)
    ws, view = _open(tmp_path / "ws")
    counter = Counter(COMMIT)
    with durable.installed(counter):
        view.rename("/d", "/e")
    assert counter.n == 1
    with durable.installed(counter):
        view.rename("/e", "/x", RENAME_EXCHANGE)
    assert counter.n == 2
    view.close()
    ws.close()
