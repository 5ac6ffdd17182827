"""Fault injection on the format-7 delta pass a commit runs once its layer
is committed (``store/delta.py``, called from ``publish.Commit.complete``;
issue 18's fault pass over #20's code).  Kernel-free.

The documented outcome (delta.py, FORMAT.md "Known limitations"): only an
encoding changes, so a crash or a failure of the pass leaves the layer
committed with every byte readable, ``delta_through`` where it was, and
gc's pass makes the deltas later.
"""

from __future__ import annotations

import errno
import os
import sqlite3

import pytest
import sqlalchemy.exc
from sqlalchemy import select

from crashkit import Counter, FailAt, KillAt, fork_run
from history_helpers import open_ws, read, write
from stepfs.overlayfs.core.view import Overlay
from stepfs.store import codec, durable, gc, schema, verify
from stepfs.store.workspace import Workspace

SMALL = b"".join(b"version = %d  # line %d of a small config file\n" % (1, i) for i in range(12))
BIG = b"".join(b"def function_%d(x):\n    return x * %d + 1  # a line of a bigger file\n" % (i, i)
               for i in range(1500))


def _edit(data: bytes) -> bytes:
    return data.replace(b"version = 1", b"version = 2", 3).replace(b"x * 7 ", b"x * 8 ")


def _workspace(tmp_path):
    ws_path = tmp_path / "ws"
    ws_path.mkdir(parents=True)
    (ws_path / "small.txt").write_bytes(SMALL)
    (ws_path / "big.txt").write_bytes(BIG)
    ws, view = open_ws(ws_path)
    view.close()
    ws.close()
    return ws_path


def _commit_edits(ws_path, hook=None) -> None:
    ws = Workspace.open(str(ws_path))
    view = Overlay(ws, str(ws_path.parent / "mnt-of-ws"))
    write(view, "/small.txt", _edit(SMALL))
    write(view, "/big.txt", _edit(BIG))
    if hook is None:
        assert view.commit(message="edits") == 1
    else:
        with durable.installed(hook):
            view.commit(message="edits")
    view.close()
    ws.close()


def _delta_rows(ws) -> int:
    with ws.db.read() as conn:
        return (conn.execute(select(schema.chunks.c.cid).where(schema.chunks.c.codec == codec.DELTA)).all().__len__()
                + conn.execute(select(schema.objects.c.oid).where(schema.objects.c.codec == codec.DELTA))
                .all().__len__())


def _delta_through(ws) -> int:
    with ws.db.read() as conn:
        v = conn.execute(select(schema.meta.c.value).where(schema.meta.c.key == "delta_through")).scalar()
    return int(v or 0)


def _check_history(ws_path) -> None:
    """Layer 1 committed, the workspace NEW, every version readable."""
    with Workspace.open(str(ws_path)) as ws:
        with ws.db.read() as conn:
            states = dict(conn.execute(select(schema.layers.c.number, schema.layers.c.state)).all())
        assert states == {0: "committed", 1: "committed"}
        assert (ws_path / "small.txt").read_bytes() == _edit(SMALL)
        assert (ws_path / "big.txt").read_bytes() == _edit(BIG)
        view = Overlay(ws, str(ws_path.parent / "mnt-check"))
        try:
            assert read(view, "/.stepfs/layers/0/small.txt") == SMALL
            assert read(view, "/.stepfs/layers/0/big.txt") == BIG
            assert read(view, "/.stepfs/layers/1/small.txt") == _edit(SMALL)
            assert read(view, "/.stepfs/layers/1/big.txt") == _edit(BIG)
        finally:
            view.close()
        assert verify.verify(ws).ok


def _delta_commit_positions(tmp_path) -> tuple[int, int]:
    """(position of the delta pass's COMMIT among the durability calls of
    a commit, how many calls the commit makes)."""
    ws_path = _workspace(tmp_path / "count")
    counter = Counter()
    _commit_edits(ws_path, counter)
    with Workspace.open(str(ws_path)) as ws:
        assert _delta_through(ws) == 1 and _delta_rows(ws) >= 2  # the pass made deltas of both files
    # The pass is the last COMMIT, after the durable 'committed' one.
    last_durable = counter.durable_commits[-1]
    after = [i + 1 for i, op in enumerate(counter.trace) if op == "commit" and i + 1 > last_durable]
    assert after, counter.trace
    return after[-1], counter.n


def test_a_crash_in_the_delta_pass_leaves_the_layer_committed_and_gc_makes_the_deltas(tmp_path):
    delta_at, total = _delta_commit_positions(tmp_path)
    # A kill at every durability call from the 'committed' record to the pass's COMMIT.
    for k in range(delta_at - 1, total + 1):
        ws_path = _workspace(tmp_path / f"k{k}")
        outcome = fork_run(lambda: _commit_edits(ws_path, KillAt(k)))
        assert outcome == "killed", k
        _check_history(ws_path)
        with Workspace.open(str(ws_path)) as ws:
            if k == delta_at:
                assert _delta_through(ws) == 0 and _delta_rows(ws) == 0  # the pass was lost whole
            report = gc.collect(ws)
            assert _delta_through(ws) == 1
            # (gc's level 3 may keep a chunk whole that the commit's level 1
            # made a delta: zstd's raw-content dictionary does worse there.)
            assert _delta_rows(ws) >= 1, report
            assert verify.verify(ws).ok
        _check_history(ws_path)


@pytest.mark.parametrize("code", [10, 13], ids=["SQLITE_IOERR", "SQLITE_FULL"])
def test_a_failed_delta_pass_leaves_the_commit_standing(tmp_path, code):
    delta_at, _total = _delta_commit_positions(tmp_path)

    class FailPass(Counter):
        def before(self, op, args):
            super().before(op, args)
            if op == "commit" and self.n == delta_at:
                orig = sqlite3.OperationalError("disk I/O error" if code == 10 else "database or disk is full")
                orig.sqlite_errorcode = code
                raise sqlalchemy.exc.OperationalError("COMMIT", {}, orig)

    ws_path = _workspace(tmp_path / "w")
    ws = Workspace.open(str(ws_path))
    view = Overlay(ws, str(ws_path.parent / "mnt-of-ws"))
    write(view, "/small.txt", _edit(SMALL))
    write(view, "/big.txt", _edit(BIG))
    with durable.installed(FailPass()):
        assert view.commit(message="edits") == 1  # the commit stands
    view.close()
    ws.close()
    _check_history(ws_path)
    with Workspace.open(str(ws_path)) as ws:
        assert _delta_through(ws) == 0 and _delta_rows(ws) == 0
        gc.collect(ws)
        assert _delta_through(ws) == 1 and _delta_rows(ws) >= 1
    _check_history(ws_path)


def test_an_eio_at_the_layers_fsync_before_the_pass_never_runs_it(tmp_path):
    """A commit that fails before its 'committed' record makes no delta:
    the pass reads only committed layers."""
    ws_path = _workspace(tmp_path / "w")
    counter = Counter()
    _commit_edits(_workspace(tmp_path / "count"), counter)
    fsyncs = counter.by_op["fsync"]
    ws = Workspace.open(str(ws_path))
    view = Overlay(ws, str(ws_path.parent / "mnt-of-ws"))
    write(view, "/small.txt", _edit(SMALL))
    write(view, "/big.txt", _edit(BIG))
    with durable.installed(FailAt("fsync", fsyncs, errno.EIO)):
        with pytest.raises(Exception):
            view.commit(message="fails at its last fsync")
    view.close()
    with ws.db.read() as conn:
        assert conn.execute(select(schema.layers.c.state).where(schema.layers.c.number == 1)).scalar() == "pending"
    assert _delta_rows(ws) == 0
    ws.close()
    _check_history(ws_path)  # recovery finishes the layer
    assert os.path.exists(ws_path / ".stepfs")
