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

The pass itself (:func:`delta.after_commit`) is one short transaction per
file, safe against gc, other passes and a crash at any point.  The thread
makes no delta while a commit of this process runs (``Spares.wait_idle``:
it would take the CPU and the GIL from the commit), and stops between two
files when the workspace closes: what it did not reach, gc's delta pass
does (``meta.delta_through``).
"""

from __future__ import annotations

import logging
import threading
from collections import deque

from stepfs.store import delta
from stepfs.store.spares import Spares

log = logging.getLogger("stepfs.store")

#: Seconds :meth:`DeltaWork.stop` waits for the file in progress.
STOP_WAIT = 5


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
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Make deltas in a background thread from now on (long-lived
        processes only: a queued layer dies with the process, for gc)."""
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

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Whether every layer submitted so far is done (within ``timeout``)."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._queue and not self._busy, timeout)

    def stop(self) -> None:
        """End the thread after the file in progress; queued layers are
        left to gc."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=STOP_WAIT)
            self._thread = None

    def _go(self) -> bool:
        """Between two files: wait while a commit of this process runs;
        False once stopping."""
        while not self._stopping and not self.spares.wait_idle(0.5):
            pass
        return not self._stopping

    def _loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._queue or self._stopping)
                if self._stopping:
                    self._queue.clear()
                    self._cv.notify_all()
                    return
                number = self._queue.popleft()
                self._busy = True
            try:
                delta.after_commit(self.ws, number, go=self._go)
            except Exception:  # an encoding only: gc's pass does the layer again
                log.exception("deltas of layer %d failed; gc makes them", number)
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()
