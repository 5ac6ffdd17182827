"""`stepfs discard`: drop staged paths so the rest can be committed; the
bytes of a path changed in the workspace meanwhile (a version that lost)
are kept as conflicts, other drafts go with the next gc (issues:
crash-atomic commit, conflicts; 20, bounded history)."""

from __future__ import annotations

import json
import os

import pytest

from stepfs.cli import exitcodes
from conftest import stepfs
from stepfs.overlayfs.client import manage
from stepfs.overlayfs.core.view import Overlay
from stepfs.store import errors, gc
from stepfs.store.workspace import Workspace


@pytest.mark.mount
def test_discard_resolves_a_commit_conflict(workspace, mount):
    (workspace / "a").write_text("original\n")
    m = mount(workspace)
    m.path("a").write_text("agent's version\n")
    m.path("b").write_text("new file\n")
    (workspace / "a").write_text("edited outside\n")  # an editor, straight into the workspace
    refused = stepfs("step", m.mountpoint)
    assert refused.returncode == dict(exitcodes.CODES)[errors.CommitConflict]
    assert not (workspace / "b").exists(), "a refused commit wrote something"
    dropped = stepfs("discard", "--json", m.mountpoint, "a")
    assert dropped.returncode == 0, dropped.stderr
    assert json.loads(dropped.stdout)["discarded"] == ["a"]
    assert m.path("a").read_text() == "edited outside\n"  # the workspace shows through again
    assert stepfs("step", m.mountpoint).returncode == 0
    assert (workspace / "a").read_text() == "edited outside\n"
    assert (workspace / "b").read_text() == "new file\n"
    status = json.loads(stepfs("status", "--json", workspace).stdout)
    (conflict,) = status["conflicts"]
    assert (conflict["path"], conflict["reason"]) == ("a", "discarded")
    with Workspace.open(str(workspace)) as ws, ws.db.read() as conn:
        assert ws.objects.read_all(conn, conflict["oid"]) == b"agent's version\n"


def test_discard_of_a_dead_daemons_step(tmp_path):
    ws_path = tmp_path / "ws"
    ws_path.mkdir()
    ws = Workspace.open(str(ws_path), create=True)
    view = Overlay(ws, str(tmp_path / "mnt"))  # stands for a daemon that died
    view.mkdir("/d", 0o755)
    for name in ("/d/x", "/d/y", "/keep"):
        fh = view.create(name, 0o644)
        view.write(fh, name.encode(), 0)
        view.flush(fh)
        view.release(fh)
    ws.close()
    dropped = manage.discard(manage.Target(str(ws_path)), ["d"])
    assert dropped == ["d", "d/x", "d/y"]
    assert manage.step(manage.Target(str(ws_path))) == [1]
    assert sorted(os.listdir(ws_path)) == [".stepfs", "keep"]
    with Workspace.open(str(ws_path)) as ws2:
        st = manage.status(manage.Target(str(ws2.path)))
        assert st["conflicts"] == []  # drafts of paths nobody else wrote: not kept
        assert gc.collect(ws2).objects == 2


def test_discard_and_step_of_a_dead_daemons_big_files(tmp_path):
    """Files the dead daemon staged by reference (store/refs.py): the
    discard keeps the bytes of one whose workspace path appeared meanwhile
    as a conflict object, the step imports the rest."""
    from stepfs.store import refs

    ws_path = tmp_path / "ws"
    ws_path.mkdir()
    ws = Workspace.open(str(ws_path), create=True)
    view = Overlay(ws, str(tmp_path / "mnt"))  # stands for a daemon that died
    data = {name: name.encode() * (refs.MIN_SIZE // 2) for name in ("/gone", "/kept")}
    for name, content in data.items():
        fh = view.create(name, 0o644)
        view.write(fh, content, 0)
        view.flush(fh)
        view.release(fh)
    ws.close()
    (ws_path / "gone").write_bytes(b"written outside meanwhile\n")
    assert manage.discard(manage.Target(str(ws_path)), ["gone"]) == ["gone"]
    assert manage.step(manage.Target(str(ws_path))) == [1]
    assert (ws_path / "kept").read_bytes() == data["/kept"]
    assert (ws_path / "gone").read_bytes() == b"written outside meanwhile\n"
    st = manage.status(manage.Target(str(ws_path)))
    (conflict,) = st["conflicts"]
    with Workspace.open(str(ws_path)) as ws2, ws2.db.read() as conn:
        assert ws2.objects.read_all(conn, conflict["oid"]) == data["/gone"]
