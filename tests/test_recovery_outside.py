"""Recovery never overwrites what it did not write: a path changed outside
stepfs while a layer was pending keeps the outside change.

A forked child commits a staged step (``crashkit``'s 8-change template)
and is SIGKILLed at every durability call after the intent's COMMIT, so
the layer is pending; then a program outside stepfs changes one path the
layer touches (or something inside a directory the layer removes).
Recovery must publish every other path (the tree is NEW elsewhere), leave
the changed path exactly as the outside program left it, commit the layer,
and name the path: a warning in the log and an ``outside-change`` conflict
row (what ``stepfs status`` lists), holding the layer's own bytes.
"""

from __future__ import annotations

import logging
import os
import shutil

import pytest
from sqlalchemy import select

from conftest import manifest
from crashkit import (  # noqa: F401  (fast_tmp is a fixture)
    Counter, KillAt, copy_template, crash_commit, fast_tmp, make_template,
)
from stepfs.store import durable, schema
from stepfs.store.workspace import Workspace


def _write(path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def _modify(ws):  # the layer rewrites r000/mod.txt
    _write(ws / "r000" / "mod.txt", b"edited outside\n")
    return b"r000/mod.txt"


def _recreate_deleted(ws):  # the layer deletes r000/del.txt
    _write(ws / "r000" / "del.txt", b"written outside after the delete\n")
    return b"r000/del.txt"


def _create_added(ws):  # the layer creates r000/new.txt
    _write(ws / "r000" / "new.txt", b"created outside\n")
    return b"r000/new.txt"


def _swap_symlink(ws):  # the layer creates the symlink r000/link -> keep.txt
    p = ws / "r000" / "link"
    if os.path.lexists(p):
        os.unlink(p)
    os.symlink("elsewhere", p)
    return b"r000/link"


def _fill_removed_dir(ws):  # the layer removes the empty directory r000/emptyold
    d = ws / "r000" / "emptyold"
    d.mkdir(mode=0o755, exist_ok=True)
    _write(d / "outside.txt", b"a new file in a directory the layer removes\n")
    return b"r000/emptyold"


def _file_for_new_dir(ws):  # the layer turns file r000/f2d into a directory with a file inside
    p = ws / "r000" / "f2d"
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    elif os.path.lexists(p):
        os.unlink(p)
    _write(p, b"a file again, from outside\n")
    return b"r000/f2d"


EDITS = {
    "modify": _modify, "recreate-deleted": _recreate_deleted, "create-added": _create_added,
    "swap-symlink": _swap_symlink, "fill-removed-dir": _fill_removed_dir, "file-for-new-dir": _file_for_new_dir,
}


def _under(path: bytes, root: bytes) -> bool:
    return path == root or path.startswith(root + b"/")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("edit", sorted(EDITS))
def test_recovery_leaves_a_path_changed_outside_while_the_layer_was_pending(fast_tmp, edit, caplog):
    t = make_template(fast_tmp, 8)
    counter = Counter()
    probe = copy_template(t, fast_tmp / "count")
    with Workspace.open(str(probe), recover=False) as ws, durable.installed(counter):
        from crashkit import commit

        commit(ws, t)
    shutil.rmtree(fast_tmp / "count")
    intent = counter.durable_commits[0]  # the first durable COMMIT of a commit is its intent
    done = counter.durable_commits[-1]  # its last, the "committed" record (the deltas' COMMIT follows)
    points = range(intent + 1, done + 1)  # killed before call k: the intent is durable, the layer pending
    assert len(points) > 5, counter.trace
    for k in points:
        run = fast_tmp / f"k{k}"
        assert crash_commit(t, run, KillAt(k)) == "killed"
        ws_path = run / "ws"
        root = EDITS[edit](ws_path)
        outside = {p: v for p, v in manifest(ws_path).items() if _under(p, root)}
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="stepfs.publish"):
            with Workspace.open(str(ws_path)) as ws:  # recovery
                tree = manifest(ws_path)
                with ws.db.read() as conn:
                    states = dict(conn.execute(select(schema.layers.c.number, schema.layers.c.state)).all())
                    kept = conn.execute(select(schema.conflicts.c.path, schema.conflicts.c.reason,
                                               schema.conflicts.c.mount)).all()
        where = f"killed before call {k} ({counter.trace[k - 1]}), then {edit}"
        assert states == {0: "committed", 1: "committed"}, where
        expected = {p: v for p, v in t.new.items() if not _under(p, root)}
        expected.update(outside)
        assert tree == expected, f"{where}: {_diff(tree, expected)}"
        assert (root, "outside-change", "/crashkit/mnt") in [(bytes(p), r, m) for p, r, m in kept], (where, kept)
        assert any(os.fsdecode(root) in r.getMessage() for r in caplog.records), (where, caplog.text)
        shutil.rmtree(run)


def _diff(tree: dict, expected: dict) -> str:
    paths = sorted(p for p in set(tree) | set(expected) if tree.get(p) != expected.get(p))
    return "; ".join(f"{p!r}: {tree.get(p)!r:.60} != {expected.get(p)!r:.60}" for p in paths[:6])


@pytest.mark.timeout(60)
def test_a_hard_link_of_a_path_left_alone_gets_the_layers_bytes_as_a_file_of_its_own(fast_tmp):
    """The layer writes ``a`` and links ``b`` to it; before the first rename
    the commit is killed and ``a`` replaced outside.  Recovery leaves ``a``
    alone and publishes ``b`` with the layer's bytes, not as a link of the
    outside file."""
    from crashkit import fork_run
    from stepfs.overlayfs.core.view import Overlay
    from stepfs.store import publish
    from viewkit import write_file

    ws_path = fast_tmp / "ws"
    ws_path.mkdir()
    (ws_path / "a").write_bytes(b"old a\n")
    with Workspace.open(str(ws_path), create=True) as ws:
        view = Overlay(ws, "/outside/mnt")
        write_file(view, "/a", b"layer a\n")
        view.link("/b", "/a")
        step = view.step
    template = fast_tmp / "template"
    shutil.copytree(ws_path, template, symlinks=True)

    def commit_with(hook):
        def body():
            ws = Workspace.open(str(ws_path), recover=False)
            with durable.installed(hook):
                publish.commit_step(ws, step, mount="/outside/mnt", overwrite={b"a", b"b"})
        return fork_run(body)

    counter = Counter()
    with Workspace.open(str(ws_path), recover=False) as ws, durable.installed(counter):
        publish.commit_step(ws, step, mount="/outside/mnt", overwrite={b"a", b"b"})
    first_rename = counter.trace.index("rename") + 1
    shutil.rmtree(ws_path)
    shutil.copytree(template, ws_path, symlinks=True)
    assert commit_with(KillAt(first_rename)) == "killed"
    os.rename(ws_path / "a", ws_path / "a.old")  # replaced outside: a new inode with other bytes
    _write(ws_path / "a", b"outside a\n")
    os.unlink(ws_path / "a.old")
    with Workspace.open(str(ws_path)) as ws:
        with ws.db.read() as conn:
            kept = [bytes(p) for p, in conn.execute(select(schema.conflicts.c.path))]
    assert (ws_path / "a").read_bytes() == b"outside a\n"
    assert (ws_path / "b").read_bytes() == b"layer a\n"
    assert os.stat(ws_path / "a").st_ino != os.stat(ws_path / "b").st_ino
    assert kept == [b"a"]
