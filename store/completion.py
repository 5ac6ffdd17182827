"""Step 5 of a commit (``store.publish``): the switch's last directory
fsyncs and the durable ``committed`` record that waits for them, and the
``outside-change`` conflicts recorded with it.
"""

from __future__ import annotations

import os
import time

from sqlalchemy import select

from stepfs.store import durable, schema, tokens
from stepfs.store.journal import _CONSUME_STEP, _MARK_COMMITTED, L
from stepfs.store.layers import Entry
from stepfs.store.plan import _lstat
from stepfs.store.wsparts import WorkspaceParts

#: Temporary files written before their fsyncs are issued together (and
#: descriptors held open at once): bounded so a huge layer cannot run out
#: of file descriptors.
SYNC_BATCH = 256


def _sync_closing(fds: list[int]) -> None:
    """fsync ``fds`` together, then close them (closed on failure too)."""
    try:
        durable.fsync_all(fds)
    finally:
        for fd in fds:
            os.close(fd)


def _sync_dirs(fds: list[int], wait: bool) -> _DirSync | None:
    """Step 4's directory fsyncs, on descriptors this call owns: every
    batch of :data:`SYNC_BATCH` but the last is fsynced and closed; the
    last is fsynced and closed too (``wait``) or returned still syncing as
    a :class:`_DirSync` (not yet begun) for :func:`_complete` to wait for.  Raises the
    first failed fsync's ``OSError``; every descriptor not handed over is
    closed either way."""
    try:
        while len(fds) > SYNC_BATCH:
            batch, fds = fds[:SYNC_BATCH], fds[SYNC_BATCH:]
            _sync_closing(batch)
        if not wait:
            last, fds = _DirSync(fds), []
            return last
        batch, fds = fds, []
        _sync_closing(batch)
        return None
    finally:
        for fd in fds:
            os.close(fd)


class _DirSync:
    """The last batch of a switch's directory fsyncs, not yet waited for:
    begun on the pool (``durable.start_fsync_all``) by :meth:`start`, once
    a daemon's answer is out (:func:`write_layer`), and waited for by the
    completion before its COMMIT (:func:`_complete`), which builds its
    transaction meanwhile.  Owns the descriptors; :meth:`close` once done."""

    def __init__(self, fds: list[int]):
        self.fds = fds
        #: ``.wait()``: every fsync has ended; raises the first failure
        #: (never retried).  None until :meth:`start`.
        self.syncing: durable.Syncing | None = None

    def start(self) -> durable.Syncing:
        if self.syncing is None:
            self.syncing = durable.start_fsync_all(self.fds)
        return self.syncing

    def close(self) -> None:
        if self.syncing is not None:
            self.syncing.abandon()  # nothing left to wait for once waited
        for fd in self.fds:
            os.close(fd)
        self.fds = []


def _complete(ws: WorkspaceParts, number: int, step: int | None, dir_sync: _DirSync | None = None,
              left: list[Entry] = ()) -> None:
    """Step 5: the layer is committed and its step's staged rows consumed.

    ``dir_sync``: the switch's last directory fsyncs, still running; the
    statements are run meanwhile and the COMMIT only once every one of them
    has ended (SQLite writes nothing of a transaction to the WAL as
    committed before its COMMIT).  If one failed, the transaction is rolled
    back and the ``OSError`` raised: the layer stays pending.

    ``left``: entries recovery did not publish (``recovery.classify``) or
    a commit's switch left (changed outside after the plan), each
    recorded in the same transaction as an ``outside-change`` conflict of
    the layer's mount holding the layer's after state (what ``stepfs
    status`` lists and ``MOUNT/.stepfs/conflicts/PATH`` shows)."""
    with ws.db.write(durable=True) as conn:
        _MARK_COMMITTED.execute(conn, {"n": number, "state": "committed"})
        if step is not None:
            _CONSUME_STEP.execute(conn, {"s": step})
        if left:
            mount, agent = conn.execute(select(L.c.mount, L.c.agent).where(L.c.number == number)).one()
            _record_outside(ws, conn, left, mount, agent)
        if dir_sync is not None:
            dir_sync.start().wait()


#: ``conflicts.reason`` of a path recovery left alone (see :func:`classify`).
OUTSIDE_CHANGE = "outside-change"


def _record_outside(ws: WorkspaceParts, conn, entries: list[Entry], mount: str, agent: str) -> None:
    """Each entry as an ``outside-change`` conflict of ``mount`` holding
    its after state (what ``stepfs status`` lists)."""
    now = time.time_ns()
    conn.execute(schema.conflicts.insert(), [dict(
        created_ns=now, path=e.path, mount=mount, agent=agent, reason=OUTSIDE_CHANGE,
        oid=e.after.oid if e.after.kind == "file" else None, mode=e.after.mode, token_mine="",
        token_theirs=_token_now(ws, e.path),
    ) for e in entries])


def _token_now(ws: WorkspaceParts, path: bytes) -> str:
    return tokens.of_path(_lstat(ws, path), lambda: ws.root.readlink(path))
