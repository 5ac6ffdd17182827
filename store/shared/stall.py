"""Every answer of a PostgreSQL server bounded on the client: a statement
that waits longer than its bound has its connection's socket shut down,
so the waiting call fails at once (a dropped connection) instead of
hanging.  The server's own timeouts cannot fire when the server is
stopped, and a Unix socket has no keepalive.

One watchdog thread per ``Remote``, started at the first statement, looks
at the statement in flight a few times a second: arming and disarming a
statement only swap a tuple under a lock (a timer thread started per
statement cost more than the statement on a busy machine).
"""

from __future__ import annotations

import os
import socket
import threading
import time

#: Seconds a statement (or a wait for the history's lock) may take.
STATEMENT_TIMEOUT = 120
#: Seconds the client waits for any one answer of the server before it cuts
#: the connection (the server's own timeouts cannot fire when the server is
#: stopped, and a Unix socket has no keepalive).
STALL_TIMEOUT = 60
#: Seconds between two looks of the watchdog: how late past its bound a
#: stalled statement may be cut.
POLL = 0.25


class Watchdog:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._armed: tuple[float, int, float] | None = None  # (deadline, socket fd, bound)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: The bound a cut statement overran, once one was cut.
        self.stalled: float | None = None

    def arm(self, fd: int, bound: float) -> None:
        with self._lock:
            self._armed = (time.monotonic() + bound, fd, bound)
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="stepfs-history-watchdog", daemon=True)
                self._thread.start()

    def disarm(self) -> None:
        with self._lock:
            self._armed = None

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(POLL):
            with self._lock:
                armed = self._armed
                if armed is None or time.monotonic() < armed[0]:
                    continue
                self._armed = None
                self.stalled = armed[2]
                _shut(armed[1])


def _shut(fd: int) -> None:
    try:
        sock = socket.socket(fileno=os.dup(fd))
        try:
            sock.shutdown(socket.SHUT_RDWR)
        finally:
            sock.close()
    except OSError:
        pass  # closed meanwhile: nothing waits on it any more


def session_args(connect_timeout: float) -> dict:
    """The arguments of ``psycopg.connect`` that bound a history's session:
    the connect, every statement, a transaction left idle, a dead peer
    (the same for ``Remote`` and ``logread``)."""
    return {
        "connect_timeout": connect_timeout,
        "options": f"-c statement_timeout={STATEMENT_TIMEOUT * 1000} "
                   f"-c idle_in_transaction_session_timeout={STATEMENT_TIMEOUT * 1000}",
        "keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 5, "keepalives_count": 3,
    }


#: What to do after a lost connection, for a command that publishes (a step,
#: a sync, a rollback: a cut before COMMIT publishes nothing) ...
PUBLISH_HINT = "nothing was published: start or reach the server, then run 'stepfs sync'."
#: ... and for one that only reads, or changes the history in one
#: transaction of its own (prune, gc-history): the same command again.
RETRY_HINT = "start or reach the server, then run the same command again."


def unreachable(display: str, exc: BaseException, stalled: float | None, hint: str = PUBLISH_HINT):
    """The :class:`HistoryUnreachable` a failed or cut connection to the
    history ``display`` is reported as (``stalled``: the bound a cut
    statement overran; ``hint``: what to do next)."""
    from stepfs.store.errors import HistoryUnreachable

    text = str(getattr(exc, "orig", exc)).strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    if stalled is not None:
        first = f"the server did not answer for {stalled:g} s"
    return HistoryUnreachable(f"the shared history {display} cannot be reached ({first}); {hint}")
