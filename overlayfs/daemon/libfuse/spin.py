"""The request loop, polling briefly for the next request before it sleeps
(daemon side; public libfuse API: ``fuse_session_receive_buf``,
``fuse_session_process_buf``).

Why: a FUSE round trip is two wake-ups, the daemon's when a request
arrives and the caller's when its reply is written.  On a virtual machine
whose idle vCPU halts (the haltpoll cpuidle driver with
``guest_halt_poll_ns=0``, as on the machines this project is measured on) each
wake-up of a halted vCPU costs tens of microseconds, more than most
handlers: a sequential caller (``tar -x``, ``rm -rf``, ``git status``) then
spends most of its time waiting for vCPUs to wake.  A daemon that is still
polling when the next request arrives takes it without being woken, so that
vCPU never halts in the middle of a burst.

What it costs: CPU while it polls and no request comes.  The poll window
adapts as KVM's halt polling does (:class:`Window`): it grows while
requests arrive soon after the loop went to sleep (a burst the window was
too short for) and drops to zero after a long sleep (no burst), so an idle
mount, or one asked something every few milliseconds, does not poll at
all.  :data:`SPIN_ENV` sets the limit in microseconds; ``0`` runs libfuse's
own ``fuse_loop`` instead.

The loop is libfuse 3.14's ``fuse_session_loop`` (lib/fuse_loop.c) over
a device read without blocking, with the poll and the sleep where a read
found nothing: ``EINTR`` retried, a receive of 0 or less ends it (0:
unmounted or aborted), ``fuse_session_reset`` at the end.  The
high-level ``fuse_loop`` only adds the ``remember`` option's node
pruning, which the daemon does not ask for.
"""

from __future__ import annotations

import ctypes
import errno
import os
import select
import time

from stepfs.overlayfs.daemon.libfuse.bufs import FUSE_BUF_IS_FD, FuseBuf

#: The poll window's limit in microseconds (``0``: libfuse's own loop, no polling).
SPIN_ENV = "STEPFS_SPIN_US"
#: Default limit: longer than a caller's wake-up plus its work between two
#: requests on those machines, short enough that a failed poll costs little.
SPIN_US = 200
#: The window a growth starts from.
GROW_START_NS = 10_000


def limit_ns() -> int:
    """The poll window's limit from :data:`SPIN_ENV` (default :data:`SPIN_US`):
    a whole number of microseconds, a negative one counting as 0 (off); a
    value that is not a whole number is the default."""
    raw = os.environ.get(SPIN_ENV, "")
    try:
        us = int(raw) if raw else SPIN_US
    except ValueError:
        us = SPIN_US
    return max(0, us) * 1000


class Window:
    """How long to poll for the next request before sleeping (ns).

    After a poll that found nothing the loop sleeps in ``read``; what it
    slept decides the next window: a request that came within ``limit`` of
    falling asleep means a burst the window was too short for (double it,
    from :data:`GROW_START_NS`, up to ``limit``); a longer sleep means no
    burst (zero: the next requests are taken by sleeping until a burst
    shows again).  A request found while polling keeps the window."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.ns = 0

    def slept(self, ns: int) -> None:
        if ns <= self.limit:
            self.ns = min(self.limit, max(self.ns * 2, GROW_START_NS))
        else:
            self.ns = 0


class Counts:
    """What the loop did, for ``ping`` (one loop per daemon: :data:`COUNTS`)."""

    def __init__(self) -> None:
        self.polled = 0  # requests found while polling
        self.slept = 0  # requests the loop slept for
        self.window: Window | None = None  # the polling loop's (None: libfuse's own loop)

    def as_dict(self) -> dict:
        w = self.window
        return {"limit_us": w.limit // 1000 if w else 0, "polled": self.polled, "slept": self.slept,
                "window_us": w.ns // 1000 if w else 0}


COUNTS = Counts()


def _bind(lib) -> None:
    for name, args, res in (("fuse_session_receive_buf", [ctypes.c_void_p, ctypes.POINTER(FuseBuf)], ctypes.c_int),
                            ("fuse_session_process_buf", [ctypes.c_void_p, ctypes.POINTER(FuseBuf)], None),
                            ("fuse_session_exited", [ctypes.c_void_p], ctypes.c_int),
                            ("fuse_session_fd", [ctypes.c_void_p], ctypes.c_int),
                            ("fuse_session_reset", [ctypes.c_void_p], None)):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res


#: ``struct pollfd`` (poll.h), for the poll and the sleep (see :func:`loop`).
class _PollFd(ctypes.Structure):
    _fields_ = [("fd", ctypes.c_int), ("events", ctypes.c_short), ("revents", ctypes.c_short)]


#: ``FUSE_LOOKUP`` (linux/fuse.h) and the offset of a request's data after
#: its ``struct fuse_in_header`` (``len``, ``opcode``, ``unique``,
#: ``nodeid``, ``uid``, ``gid``, ``pid``, two 16-bit fields: 40 bytes).
FUSE_LOOKUP = 1
IN_HEADER_SIZE = 40


def loop(lib, libc, fuse: int, se: int, limit: int, lookups=None) -> int:
    """Serve session ``se`` until it exits or is unmounted; 0 or a negative
    errno, as ``fuse_loop``.  ``limit`` 0: libfuse's own loop.  ``libc``:
    the C library with ``free`` bound (``loop.main_with_hook``'s).

    ``lookups`` (a ``lowlevel.ListingCache``, or None) is told of each
    LOOKUP around its processing (:meth:`~ListingCache.lookup_begins`,
    :meth:`~ListingCache.lookup_ends`), read from the request's kernel
    header (``struct fuse_in_header``, a stable kernel interface), instead
    of through a wrapped libfuse entry that crosses from C to Python and
    back on every LOOKUP.

    The device is read without blocking: a burst's queued requests are
    read at once, with no ``poll`` in front of each; only a read that finds
    nothing polls for the window, then sleeps in ``poll(2)``, both through
    ctypes (Python's own ``poll`` would retry after libfuse's signal handler
    ended the session, and sleep on)."""
    if limit <= 0:
        return lib.fuse_loop(fuse)
    _bind(lib)
    libc.poll.argtypes, libc.poll.restype = [ctypes.POINTER(_PollFd), ctypes.c_ulong, ctypes.c_int], ctypes.c_int
    buf = FuseBuf()  # libfuse allocates its memory at the first receive and reuses it
    ref = ctypes.byref(buf)
    fd = lib.fuse_session_fd(se)
    os.set_blocking(fd, False)
    pollfd = _PollFd(fd, select.POLLIN, 0)
    pfd = ctypes.byref(pollfd)
    now, poll = time.monotonic_ns, libc.poll
    receive, process, exited = lib.fuse_session_receive_buf, lib.fuse_session_process_buf, lib.fuse_session_exited
    window = Window(limit)
    counts = COUNTS
    counts.window = window
    if lookups is not None:
        lookups.loop_tells(True)
    header_at, opcode, nodeid = 0, None, None
    res = 0
    woke = False  # the request about to be read is the one the loop slept for
    try:
        while not exited(se):
            res = receive(se, ref)
            if res == -errno.EAGAIN:
                if window.ns:
                    deadline = now() + window.ns
                    while not (ready := poll(pfd, 1, 0) > 0) and now() < deadline:
                        pass
                    if ready:
                        continue
                if exited(se):  # a signal while polling: do not sleep
                    break
                asleep = now()
                poll(pfd, 1, -1)  # EINTR: the loop's test sees a signal's exit
                window.slept(now() - asleep)
                woke = True
                continue
            if res == -errno.EINTR:
                continue
            if res <= 0:
                break
            if woke:
                counts.slept += 1
                woke = False
            else:
                counts.polled += 1
            if lookups is None or buf.flags & FUSE_BUF_IS_FD:
                process(se, ref)
                continue
            if buf.mem != header_at:  # the first request (libfuse keeps its buffer)
                header_at = buf.mem
                opcode = (ctypes.c_uint32 * 2).from_address(header_at)
                nodeid = (ctypes.c_uint64 * 3).from_address(header_at)
            if opcode[1] != FUSE_LOOKUP:
                process(se, ref)
                continue
            lookups.lookup_begins(nodeid[2], header_at + IN_HEADER_SIZE)
            try:
                process(se, ref)
            finally:
                lookups.lookup_ends()
    finally:
        if lookups is not None:
            lookups.loop_tells(False)
        libc.free(buf.mem)
        lib.fuse_session_reset(se)
    return min(res, 0)
