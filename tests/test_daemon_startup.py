"""The daemon finishes its start-up work before the mount reports ready
(``overlayfs.daemon.settle``): the first command run in a fresh mount must
not share the machine with it (cold ``find``/``git status`` measured 20-50%
slower, and bimodal, with the spare-inode filler and the collector's first
full pass of the start-up heap inside them)."""

from __future__ import annotations

import gc
import os

import pytest

from overlayfs import daemon
from store import spares
from store.workspace import Workspace


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


@pytest.mark.mount
def test_a_fresh_workspace_is_ready_with_its_spares_made(workspace, mount):
    """The first mount of a workspace makes its spare inodes before it is
    ready (not while the first commands in the mount run)."""
    (workspace / "f.txt").write_bytes(b"x\n")
    assert not (workspace / ".stepfs").exists()
    m = mount(workspace)
    assert len(os.listdir(workspace / ".stepfs" / "spare")) == spares.TARGET
    assert (m.mountpoint / "f.txt").read_bytes() == b"x\n"
