"""The daemon finishes its start-up work before the mount reports ready
(``overlayfs/daemon/main.py``: ``settle``): the first command run in a fresh mount must
not share the machine with it (cold ``find``/``git status`` measured 20-50%
slower, and bimodal, with the spare-inode filler and the collector's first
full pass of the start-up heap inside them)."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import pytest

from stepfs.overlayfs.daemon import main as daemon
from stepfs.store import objects, publish, spares, staging
from stepfs.store.db import Prepared
from stepfs.store.workspace import Workspace


def test_settle_waits_for_the_first_round_of_spares_and_freezes_the_heap(tmp_path):
    (tmp_path / "ws").mkdir()
    ws = Workspace.open(str(tmp_path / "ws"), create=True)
    frozen = gc.get_freeze_count()
    try:
        ws.spares.start_filling()
        daemon.settle(ws)
        assert ws.spares.available() == spares.TARGET
        assert len(os.listdir(ws.spares.directory)) == spares.TARGET
        # Everything alive now is out of the collector's full passes.
        assert gc.get_freeze_count() > frozen
    finally:
        gc.unfreeze()  # the test process's objects go back to the collector
        ws.close()


def test_settle_compiles_every_prepared_statement(tmp_path, monkeypatch):
    """The first close-write and the first commit of a mount find their
    statements compiled (each compile took 0.1-0.6 ms on their path)."""
    for prepared in Prepared.ALL:
        monkeypatch.setattr(prepared, "_by_dialect", {})  # as in a fresh daemon
    # No spare filler runs here: settle's wait for one would only time out.
    monkeypatch.setattr(daemon, "SPARES_WAIT", 0.0)
    (tmp_path / "ws").mkdir()
    ws = Workspace.open(str(tmp_path / "ws"), create=True)
    try:
        daemon.settle(ws)
        dialect = ws.db.engine.dialect.name
        assert all(dialect in p._by_dialect for p in Prepared.ALL)
        assert Prepared.warm(ws.db) == 0
        for used in (staging._SQLITE_UPSERT, objects._OBJECT_INSERT):
            assert used in Prepared.ALL
        # Compiled once and kept: a staged write and a commit compile nothing.
        compiled = {id(p): p._by_dialect[dialect] for p in Prepared.ALL}
        with ws.db.write() as conn:
            oid = ws.objects.put_bytes(conn, b"x" * 100)
        assert oid and {id(p): p._by_dialect[dialect] for p in Prepared.ALL} == compiled
    finally:
        gc.unfreeze()
        ws.close()


def test_the_daemon_has_every_store_statement_before_it_settles():
    """``Prepared.warm`` compiles what was imported: the daemon module
    imports every store module with statements before it serves."""
    code = ("import stepfs.overlayfs.daemon.main, stepfs.store.db as db; n = len(db.Prepared.ALL); "
            "import stepfs.store.objects, stepfs.store.staging, stepfs.store.publish, stepfs.store.layers; "
            "print(n, len(db.Prepared.ALL))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == out[1] and int(out[0]) > 0


@pytest.mark.mount
def test_a_fresh_workspace_is_ready_with_its_spares_made(workspace, mount):
    """The first mount of a workspace makes its spare inodes before it is
    ready (not while the first commands in the mount run)."""
    (workspace / "f.txt").write_bytes(b"x\n")
    assert not (workspace / ".stepfs").exists()
    m = mount(workspace)
    assert len(os.listdir(workspace / ".stepfs" / "spare")) == spares.TARGET
    assert (m.mountpoint / "f.txt").read_bytes() == b"x\n"
