"""Staged rows on their way to the store, and the timer that writes them (FUSE-free).

Namespace and metadata changes change the upper layer in memory at once;
their staged rows are recorded in :class:`PendingRows` and all recorded
rows are written in one transaction (:meth:`StagedRows.sync`) at the next
``fsync``, commit, discard, status request, unmount, or at the latest
``delay`` seconds after the first of them (the daemon's is :data:`ROW_DELAY`; ``delay=0`` writes
every change at once, as library callers and most tests expect; an
operation that changes several rows writes them together at its end:
:meth:`StagedRows.one_change`).  The store therefore always holds the upper
layer as it was at one moment: a daemon killed with SIGKILL loses at most
the changes of its last ``delay`` seconds, and never keeps a later change
without an earlier one.  (One transaction per change cost more than
everything else ``tar -x`` does through the mount.)

A small file's close-write is recorded the same way (:meth:`StagedRows.record_content`):
its bytes wait here, under a placeholder object id, and are stored as an
object in the transaction that writes its row; until then reads of the
file are served from these bytes.  So the close itself runs no SQL.  The
bytes held here are bounded (:data:`PENDING_CONTENT_MAX`: reaching it
writes at once).

Lock rule: everything here runs under the view's lock (``lock``), except
the timer's transaction: the timer's thread takes the batch under the lock
(a fresh :class:`PendingRows` takes its place), writes it with the lock
released, so requests go on meanwhile (SQLite runs without the GIL), and
takes the lock again to give the nodes their stored ids.  Every other
writer of rows first waits for that batch (:meth:`StagedRows.drain`), so
batches reach the store in the order they were recorded.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from contextlib import ExitStack, contextmanager
from typing import Callable

from sqlalchemy.engine import Connection

from stepfs.store import staging
from stepfs.store.staging import StagedRow

log = logging.getLogger("stepfs.view")

#: Seconds a recorded staged-row change may wait for a transaction that
#: carries it anyway: the window of changes a daemon killed with SIGKILL
#: can lose.
ROW_DELAY = 0.05
#: Bytes of close-written content that may wait in memory for their
#: transaction; recording more writes everything at once.
PENDING_CONTENT_MAX = 8 << 20


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

    __slots__ = ("rows", "trees", "contents", "content_bytes", "stored", "_keys")

    def __init__(self, keys=None) -> None:
        self.rows: dict[bytes, StagedRow | None] = {}  # store path -> row, or None: delete it
        self.trees: list[bytes] = []
        # Placeholder object id -> bytes to store (a close-write's content).
        self.contents: dict[str, bytes] = {}
        self.content_bytes = 0
        # Placeholder -> object id, filled by the last :meth:`write`.
        self.stored: dict[str, str] = {}
        # Shared by the batches of one step: a placeholder names one content.
        self._keys = keys if keys is not None else itertools.count(1)

    def __bool__(self) -> bool:
        return bool(self.rows or self.trees or self.contents)

    def put_content(self, digest: str, data: bytes) -> str:
        """Hold ``data`` (whose XXH3-128 is ``digest``) until the next
        write; returns the placeholder id rows name it by.  It starts with
        the digest (what tokens take from an object id) and cannot be a
        stored id (those are ``digest`` or ``digest.<n>``)."""
        key = f"{digest}.p{next(self._keys)}"
        self.contents[key] = data
        self.content_bytes += len(data)
        return key

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

    def write(self, conn: Connection, step: int, empty_oid, put_many, held=frozenset(), earlier=None) -> None:
        """Apply every recorded change through ``conn`` (the caller's write
        transaction; :meth:`clear` once it committed).  ``empty_oid(conn)``
        stores the empty object for a file row that names no content yet (a
        created file nobody closed, moved or changed before its close);
        ``put_many(conn, contents)`` stores held contents (their object
        ids, in order: one batch, not a few statements per file);
        ``held``: placeholders a node still has as its content;
        ``earlier``: placeholder -> object id of the batch written before
        this one (rows recorded before its nodes were given their ids)."""
        # Content no row and no node names any more (a file closed again,
        # or removed, before this write) is never stored.
        named = {row.oid for row in self.rows.values() if row is not None and row.oid in self.contents}
        keys = [key for key in self.contents if key in named or key in held]
        self.stored = dict(zip(keys, put_many(conn, [self.contents[key] for key in keys]))) if keys else {}
        # Trees go first (every recorded row came after them); the removals
        # and puts name distinct paths, so each kind runs as one batch.
        staging.remove_trees(conn, step, self.trees)
        # The snapshots stay as taken (a failed write is written again):
        # the object id a row gets is passed beside it, never set in it.
        puts, oids, removes = [], [], []
        stored = self.stored
        empty = None
        for path, row in self.rows.items():
            if row is None:
                removes.append(path)
                continue
            oid = row.oid
            if oid is None:
                if row.kind == "file" and row.scratch is None:
                    if empty is None:
                        empty = empty_oid(conn)  # once per write: a few created files are often still open
                    oid = empty
            elif oid in stored:
                oid = stored[oid]
            elif earlier and oid in earlier:
                oid = earlier[oid]
            puts.append(row)
            oids.append(oid)
        staging.remove_many(conn, step, removes)
        staging.put_many(conn, step, puts, oids)

    def merge_later(self, later: "PendingRows") -> None:
        """Take ``later``'s changes (recorded after this batch's) on top of
        this batch's: a batch whose write failed goes back in front."""
        for path in later.trees:
            self.remove_tree(path)
        self.rows.update(later.rows)
        self.contents.update(later.contents)
        self.content_bytes += later.content_bytes

    def clear(self) -> None:
        self.rows.clear()
        self.trees.clear()
        self.contents.clear()
        self.content_bytes = 0
        self.stored = {}


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
        if self._due is not None:
            # Armed: nothing changes (read without the lock: the timer's
            # thread clears it before it takes the view's lock to fire, so
            # the caller's rows, recorded under that lock, go with the firing).
            return
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
        self._keys = itertools.count(1)
        self.pending = PendingRows(self._keys)
        # Placeholder object id -> the node that holds it (record_content).
        self._holders: dict[str, object] = {}
        # The batch the timer writes outside the lock (_timed_sync): its
        # rows, its holders, set once its transaction ended, and its error.
        self._flight: PendingRows | None = None
        self._flight_holders: dict[str, object] = {}
        self._flight_done = threading.Event()
        self._flight_error: BaseException | None = None
        # Placeholder -> object id of the last batch written outside the lock.
        self._earlier: dict[str, str] = {}
        self.timer = RowTimer(delay, self._timed_sync) if delay and delay > 0 else None
        # > 0 inside an operation that records several row changes which
        # must reach the store together (``one_change``).
        self._depth = 0

    def recorded(self) -> None:
        """Rows were recorded: write them now, or arm the timer."""
        if self._depth:
            return
        if self.pending.content_bytes >= PENDING_CONTENT_MAX or (self.delay is not None and self.delay <= 0):
            self.sync(between=False)
        elif self.delay is not None:
            self.timer.arm()

    def waits(self) -> bool:
        """Whether :meth:`recorded` leaves the rows for later (no
        transaction at once, so nothing there can fail), given content
        that :meth:`may_hold`."""
        return (self.delay is None or self.delay > 0) and not self._depth

    def may_hold(self, size: int) -> bool:
        """Whether ``size`` more bytes of content stay under
        :data:`PENDING_CONTENT_MAX` (else :meth:`recorded` writes at once)."""
        return self.pending.content_bytes + size < PENDING_CONTENT_MAX

    def record_content(self, node, digest: str, data: bytes) -> str:
        """Hold the close-written content of file ``node`` until its row
        is written (module doc); returns the placeholder id to give
        ``node.oid`` now, replaced by the stored id once written.  The
        caller records the node's rows next."""
        key = self.pending.put_content(digest, data)
        self._holders[key] = node
        return key

    def forget_content(self, key: str) -> None:
        """Drop placeholder ``key``'s bytes (a close that failed after
        :meth:`record_content`: no row names them any more)."""
        data = self.pending.contents.pop(key, None)
        if data is not None:
            self.pending.content_bytes -= len(data)
        self._holders.pop(key, None)

    def content_of(self, oid: str | None) -> bytes | None:
        """The bytes of a placeholder id not stored yet, else None."""
        if oid is None:
            return None
        data = self.pending.contents.get(oid)
        flight = self._flight
        if data is None and flight is not None:
            data = flight.contents.get(oid)
        return data

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
        """The timer's write: the batch is taken under the lock and written
        without it (module doc), then the nodes get their ids."""
        transaction = ExitStack()
        with self.lock:
            try:
                self.drain()
                if not self.pending:
                    self._between()
                    return
                self._await_settled(writing=True)
                # BEGIN IMMEDIATE under the lock: a writer that comes after
                # (under the lock) waits for this batch in SQLite, and never
                # holds the store's write lock while this batch needs it.
                conn = transaction.enter_context(self.db.write())
            except Exception:  # a store error also made the view read-only
                log.exception("writing %d staged rows failed; they stay pending", len(self.pending))
                return
            batch = self._flight = self.pending
            held = {key for key, node in self._holders.items() if node.oid == key}
            self._flight_holders, self._holders = self._holders, {}
            self.pending = PendingRows(self._keys)
            self._flight_error = None
            self._flight_done.clear()
            earlier = self._earlier
        try:
            with transaction:
                batch.write(conn, self.step, self._empty_oid, self.objects.put_many, held, earlier)
        except BaseException as exc:
            self._flight_error = exc
        finally:
            self._flight_done.set()
        with self.lock:
            self._land(batch, between=True)

    def drain(self) -> None:
        """Wait for the batch the timer is writing outside the lock, and
        settle it (call under the lock, before any write of rows)."""
        flight = self._flight
        if flight is not None:
            self._flight_done.wait()
            self._land(flight)

    def _land(self, batch: PendingRows, between: bool = False) -> None:
        """Under the lock, once ``batch``'s transaction ended: its nodes get
        their stored ids, or, if it failed, it goes back in front of what
        was recorded since (nothing is lost; the next write carries it).
        ``between``: called between operations (see :meth:`sync`)."""
        if self._flight is not batch:
            return  # settled already by drain
        self._flight = None
        holders, self._flight_holders = self._flight_holders, {}
        exc, self._flight_error = self._flight_error, None
        if exc is not None:
            later = self.pending
            batch.stored = {}
            batch.merge_later(later)
            holders.update(self._holders)
            self.pending, self._holders = batch, holders
            if isinstance(exc, Exception):  # a store error also made the view read-only
                log.error("writing %d staged rows failed; they stay pending: %s", len(batch), exc)
            return
        for key, oid in batch.stored.items():
            node = holders.get(key)
            if node is not None and node.oid == key:
                node.oid = oid
        self._earlier = batch.stored
        if between and not self.pending:  # a node retired since the swap still has its row in the store
            self._between()

    def sync(self, between: bool = True) -> None:
        """Write every recorded staged row now, in one transaction.
        ``between``: called between operations (not from inside one, where
        a node may be out of the tree on its way to another place), so
        retired by-reference files can go too."""
        with self.lock:
            self.drain()
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
        self.drain()  # (the timer's transaction began before the caller's: it has ended)
        for path in superseded:
            self.pending.discard(path)
        if self.pending:
            held = {key for key, node in self._holders.items() if node.oid == key}
            self.pending.write(conn, self.step, self._empty_oid, self.objects.put_many, held, self._earlier)

    def written(self) -> None:
        for key, oid in self.pending.stored.items():
            node = self._holders.get(key)
            if node is not None and node.oid == key:
                node.oid = oid
        self._holders.clear()
        self.pending.clear()

    def _empty_oid(self, conn) -> str:
        return self.objects.put_bytes(conn, b"")

    def stop(self) -> None:
        if self.timer is not None:
            self.timer.stop()
