"""When a committed layer's deltas are made (``store/delta.py``): after the
commit lock is released, never inside the commit.

Inside the completion, with the lock held, they delayed the next step and
the mount's next row writes (measured: 33 ms on the median 10-file step of
one-line edits to 20 KB files).  :meth:`DeltaWork.submit` is called by
``publish.Commit`` once the layer is committed and its hold of the lock
has ended (a caller that holds the lock itself, as rollback does, still
holds it then).  A process that started the background thread (the mount
daemon, :meth:`start`) queues the layer for it; any other process (the
CLI, tests) makes the deltas there and then, before ``Commit`` returns.

The pass itself (:func:`delta.after_commit`) plans in a read transaction
and writes in short checked batches, safe against gc, other passes and a
crash at any point.  The thread shares the daemon's GIL with the threads
that answer FUSE requests: a Python thread descheduled by a loaded machine
while it holds the GIL stalls them all.  So it starts a layer only once
the process has been quiet (:func:`_quiet`: under :data:`QUIET_CPU` of a
CPU for :data:`QUIET_WINDOW`, read from ``os.times``; or after
:data:`MAX_DEFER` seconds of waiting), makes no delta while a commit of
this process runs (``Spares.wait_idle``; :meth:`DeltaWork.pausing`).  When the workspace closes it
does the layers still queued for at most :data:`STOP_WAIT` seconds, then
stops between two files: what it did not reach, gc's delta pass does
(``meta.delta_through``).

The same thread then remembers the layer's line counts
(:func:`linecounts.fill_layer`), so that ``log`` reads them instead of
diffing; a process without the thread leaves them to the first reader
that writes (the commit's own latency is the same either way).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from contextlib import contextmanager
from typing import Iterator

from stepfs.store import delta, linecounts
from stepfs.store.spares import Spares

log = logging.getLogger("stepfs.store")

#: Seconds :meth:`DeltaWork.stop` gives the layers still queued.
STOP_WAIT = 5
#: The process is quiet when it used at most this fraction of one CPU ...
QUIET_CPU = 0.25
#: ... over this many seconds (``os.times`` counts in 10 ms ticks).
QUIET_WINDOW = 0.1
#: A layer waits at most this long for a quiet process, then starts anyway.
MAX_DEFER = 2.0


class DeltaWork:
    def __init__(self, ws, spares: Spares):
        """``ws``: the ``store.workspace.Workspace`` whose layers these are
        (not imported: workspace imports this module)."""
        self.ws = ws
        self.spares = spares
        self._cv = threading.Condition()
        self._queue: deque[int] = deque()  # guarded by _cv
        self._busy = False  # guarded by _cv: a layer is being done
        self._stopping = False
        self._stop_by = 0.0  # monotonic deadline of the drain once stopping
        #: Held by the pass's write transactions and by a commit of this
        #: process for its whole length (:meth:`pausing`).
        self._writing = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Make deltas in a background thread from now on (long-lived
        processes only: a layer still queued when the process dies is left
        to gc)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="stepfs-deltas", daemon=True)
            self._thread.start()

    def submit(self, number: int) -> None:
        """Layer ``number`` was just committed: its deltas, now or queued."""
        if self._thread is None:
            delta.after_commit(self.ws, number)
            return
        with self._cv:
            self._queue.append(number)
            self._cv.notify_all()

    @contextmanager
    def pausing(self) -> Iterator[None]:
        """Around a commit of this process (``publish.Commit``): the pass
        begins no write transaction meanwhile, and one it began ends first.
        Otherwise the commit's ``BEGIN IMMEDIATE`` waits in SQLite's busy
        handler, whose sleeps grow to tens of milliseconds, for a
        transaction of a thread the loaded machine may have descheduled."""
        with self._writing:
            yield

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Whether every layer submitted so far is done (within ``timeout``)."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._queue and not self._busy, timeout)

    def stop(self) -> None:
        """End the thread: the layers still queued are done first, without
        waiting for a quiet process, for up to :data:`STOP_WAIT` seconds
        (an unmount leaves a compact store); what is left then, gc does."""
        with self._cv:
            self._stop_by = time.monotonic() + STOP_WAIT
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=STOP_WAIT + 1)
            self._thread = None

    def _quiet(self) -> None:
        """Wait until the process is quiet (see the module doc), stopping,
        or :data:`MAX_DEFER` has passed."""
        deadline = time.monotonic() + MAX_DEFER
        while not self._stopping and time.monotonic() < deadline:
            t0, c0 = time.monotonic(), _cpu()
            with self._cv:
                if self._cv.wait_for(lambda: self._stopping, QUIET_WINDOW):
                    return
            if _cpu() - c0 <= QUIET_CPU * (time.monotonic() - t0):
                return

    def _go(self) -> bool:
        """Between two files: wait while a commit of this process runs;
        False once stopping and past its deadline."""
        while not self._stopping and not self.spares.wait_idle(0.5):
            pass
        return not self._stopping or time.monotonic() < self._stop_by

    def _loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._queue or self._stopping)
                if not self._queue or (self._stopping and time.monotonic() >= self._stop_by):
                    self._queue.clear()
                    self._cv.notify_all()
                    return
                number = self._queue.popleft()
                self._busy = True
            try:
                self._quiet()
                delta.after_commit(self.ws, number, go=self._go, writing=self._writing)
                linecounts.fill_layer(self.ws, number, go=self._go, writing=self._writing)
            except Exception:  # an encoding only: gc's pass does the layer again
                log.exception("deltas of layer %d failed; gc makes them", number)
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()


def _cpu() -> float:
    """Seconds of CPU this process has used (every thread)."""
    t = os.times()
    return t.user + t.system
