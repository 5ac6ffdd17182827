"""Staged rows on their way to the store, and the timer that writes them (FUSE-free).

Namespace and metadata changes change the upper layer in memory at once;
their staged rows are recorded in :class:`PendingRows` and all recorded
rows are written in one transaction (:meth:`StagedRows.sync`) at the next
close-write (in the same transaction as its content), ``fsync``, commit,
discard, status request, unmount, or at the latest ``delay`` seconds after
the first of them (the daemon's is :data:`ROW_DELAY`; ``delay=0`` writes
every change at once, as library callers and most tests expect; an
operation that changes several rows writes them together at its end:
:meth:`StagedRows.one_change`).  The store therefore always holds the upper
layer as it was at one moment: a daemon killed with SIGKILL loses at most
the changes of its last ``delay`` seconds, and never keeps a later change
without an earlier one.  (One transaction per change cost more than
everything else ``tar -x`` does through the mount.)

Lock rule: everything here runs under the view's lock (``lock``), which
the timer's thread takes itself before it writes.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from contextlib import contextmanager
from typing import Callable

from sqlalchemy.engine import Connection

from stepfs.store import staging
from stepfs.store.staging import StagedRow

log = logging.getLogger("stepfs.view")

#: Seconds a recorded staged-row change may wait for a transaction that
#: carries it anyway: the window of changes a daemon killed with SIGKILL
#: can lose.
ROW_DELAY = 0.05


class PendingRows:
    """Staged-row writes made in memory and not yet in the store.

    The view records every change of its staged rows here (``put`` a row,
    ``remove`` a path's row, ``remove_tree`` a subtree's rows) and
    :meth:`write` applies them all in one transaction.  Rows are snapshots
    taken when the change was made, so a write leaves the store exactly as
    the upper layer was at the last recorded change: never a mix of older
    and newer states of different paths.

    Coalescing keeps that true: a later change of a path replaces its
    earlier one, and ``remove_tree`` drops the recorded changes at and below
    its path (it deletes those rows anyway) and runs before every recorded
    row, which therefore all came after it.

    Lock rule: only touched under the owning view's lock.
    """

    __slots__ = ("rows", "trees")

    def __init__(self) -> None:
        self.rows: dict[bytes, StagedRow | None] = {}  # store path -> row, or None: delete it
        self.trees: list[bytes] = []

    def __bool__(self) -> bool:
        return bool(self.rows or self.trees)

    def __len__(self) -> int:
        return len(self.rows) + len(self.trees)

    def put(self, row: StagedRow) -> None:
        self.rows[row.path] = row

    def remove(self, path: bytes) -> None:
        self.rows[path] = None

    def remove_tree(self, path: bytes) -> None:
        prefix = path + b"/"
        for p in [p for p in self.rows if p == path or p.startswith(prefix)]:
            del self.rows[p]
        self.trees.append(path)

    def discard(self, path: bytes) -> None:
        """Forget the recorded change of ``path`` (its caller writes a newer
        row of that path in the same transaction, after :meth:`write`)."""
        self.rows.pop(path, None)

    def write(self, conn: Connection, step: int, empty_oid) -> None:
        """Apply every recorded change through ``conn`` (the caller's write
        transaction; :meth:`clear` once it committed).  ``empty_oid(conn)``
        stores the empty object for a file row that names no content yet (a
        created file nobody closed, moved or changed before its close)."""
        for path in self.trees:
            staging.remove_tree(conn, step, path)
        puts = []
        for path, row in self.rows.items():
            if row is None:
                staging.remove(conn, step, path)
                continue
            if row.kind == "file" and row.oid is None and row.scratch is None:
                row = dataclasses.replace(row, oid=empty_oid(conn))  # the snapshot stays as taken
            puts.append(row)
        staging.put_many(conn, step, puts)

    def clear(self) -> None:
        self.rows.clear()
        self.trees.clear()


class RowTimer:
    """Calls ``fire`` ``delay`` seconds after :meth:`arm`, once per arming
    (arming while armed changes nothing), on one thread that lives as long
    as the timer (a ``threading.Timer`` per arming put a thread start on
    the request that recorded the first row of each window).  The thread
    starts with the timer and ends at :meth:`stop`.

    Threading: ``arm``, ``cancel`` and ``stop`` may be called under the
    view's lock; ``fire`` runs on the timer's thread with no lock of the
    timer held (it takes the view's lock itself), so the two locks are
    never taken in the other order."""

    def __init__(self, delay: float, fire):
        self.delay = delay
        self._fire = fire
        self._cv = threading.Condition(threading.Lock())
        self._due: float | None = None  # time.monotonic() of the next call
        self._stopped = False
        self.fired = 0  # calls made so far (tests wait on it)
        self._thread = threading.Thread(target=self._run, name="stepfs-rows", daemon=True)
        self._thread.start()

    @property
    def armed(self) -> bool:
        return self._due is not None

    def arm(self) -> None:
        with self._cv:
            if self._due is not None or self._stopped:
                return
            self._due = time.monotonic() + self.delay
            self._cv.notify()

    def cancel(self) -> None:
        with self._cv:
            self._due = None

    def stop(self) -> None:
        """Cancel and end the thread (it is not waited for)."""
        with self._cv:
            self._due = None
            self._stopped = True
            self._cv.notify()

    def wait_fired(self, count: int, timeout: float) -> bool:
        """Wait until ``fire`` was called ``count`` times (tests)."""
        with self._cv:
            return self._cv.wait_for(lambda: self.fired >= count, timeout)

    def _run(self) -> None:
        while True:
            with self._cv:
                while True:
                    if self._stopped:
                        return
                    if self._due is None:
                        self._cv.wait()
                        continue
                    left = self._due - time.monotonic()
                    if left <= 0:
                        break
                    self._cv.wait(left)
                self._due = None
            try:
                self._fire()
            except Exception:  # the thread outlives a failed call: the next window still fires
                log.exception("the row timer's call failed")
            finally:
                with self._cv:
                    self.fired += 1
                    self._cv.notify_all()


class StagedRows:
    """The recorded rows of one step and when they are written.

    ``db``: the store's database; ``objects``: its object store (the empty
    object for a created file nobody closed yet); ``lock``: the view's;
    ``await_settled(writing=True)``: waits out a commit completing (its
    "committed" record consumes the step's rows); ``between()``: runs after
    a write made between operations (retired scratch files may go)."""

    def __init__(self, db, objects, step: int, lock, await_settled: Callable[..., None],
                 between: Callable[[], None], delay: float | None):
        self.db, self.objects, self.step, self.lock = db, objects, step, lock
        self._await_settled = await_settled
        self._between = between
        self.delay = delay
        self.pending = PendingRows()
        self.timer = RowTimer(delay, self._timed_sync) if delay and delay > 0 else None
        # > 0 inside an operation that records several row changes which
        # must reach the store together (``one_change``).
        self._depth = 0

    def recorded(self) -> None:
        """Rows were recorded: write them now, or arm the timer."""
        if self.delay is None or self._depth:
            return
        if self.delay <= 0:
            self.sync(between=False)
        else:
            self.timer.arm()

    @contextmanager
    def one_change(self):
        """The rows recorded inside the block are one change: they reach
        the store in one transaction, at its end (with ``delay=0``) or with
        the next flush.  A rename records several (the old place, the new
        place, every path below them); written one by one, a crash between
        two of them would lose or half-move a subtree.  If the block raises,
        what it recorded goes the same way (the upper layer in memory has
        those changes).  Call under the lock."""
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if not self._depth and self.pending:
                self.recorded()

    def _timed_sync(self) -> None:
        with self.lock:
            try:
                self.sync()
            except Exception:  # a store error also made the view read-only
                log.exception("writing %d staged rows failed; they stay pending", len(self.pending))

    def sync(self, between: bool = True) -> None:
        """Write every recorded staged row now, in one transaction.
        ``between``: called between operations (not from inside one, where
        a node may be out of the tree on its way to another place), so
        retired by-reference files can go too."""
        with self.lock:
            if self.pending:
                self._await_settled(writing=True)
                with self.db.write() as conn:
                    self.write(conn)
                self.written()
            if between:
                self._between()

    def write(self, conn: Connection, superseded=()) -> None:
        """Write the recorded rows through ``conn``, a write transaction of
        the caller, who calls :meth:`written` once it committed.
        ``superseded``: store paths whose rows the caller writes next, in
        the same transaction (their recorded rows are older)."""
        for path in superseded:
            self.pending.discard(path)
        if self.pending:
            self.pending.write(conn, self.step, self._empty_oid)

    def written(self) -> None:
        self.pending.clear()

    def _empty_oid(self, conn) -> str:
        return self.objects.put_bytes(conn, b"")

    def stop(self) -> None:
        if self.timer is not None:
            self.timer.stop()
