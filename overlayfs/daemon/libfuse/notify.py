"""Invalidation of the kernel's caches of one mount (daemon side, libfuse
internals: ``fuse_invalidate_path`` and a raw notification on ``/dev/fuse``)."""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import struct
import threading
import time

from stepfs.overlayfs.daemon.libfuse import mfusepy

log = logging.getLogger("stepfs.fuse")

#: ``struct fuse_out_header`` of FUSE_NOTIFY_INC_EPOCH (len, code 8, unique 0).
_INC_EPOCH = struct.pack("<IiQ", 16, 8, 0)
#: FUSE_NOTIFY_INVAL_ENTRY: ``fuse_out_header`` (code 3) + ``struct
#: fuse_notify_inval_entry_out`` (parent, namelen, flags) + name + NUL.
_INVAL_ENTRY = 3
#: Its flag that only expires the name (protocol 7.38, Linux 6.2): a full
#: invalidation would also detach whatever is mounted on a directory.
_EXPIRE_ONLY = 1
#: The protocol minor of FUSE_NOTIFY_INC_EPOCH (Linux 6.16).
INC_EPOCH_MINOR = 44
#: A negative name this young whose expiry found no name in the kernel may
#: belong to a LOOKUP still in flight: every name is renewed instead.
_IN_FLIGHT_S = 2.0
#: Negative names recorded at most (:meth:`KernelCache.note_negative`);
#: beyond it, once the expired ones are dropped, negatives are not cached.
NEGATIVE_LIMIT = 20000


def _ancestors(path: str) -> list[str]:
    """The directories above view path ``path``: ``/a/b/c`` -> ``/a/b``, ``/a``, ``/``."""
    out = []
    while path not in ("/", ""):
        path = path.rsplit("/", 1)[0] or "/"
        out.append(path)
    return out


class KernelCache:
    """Invalidation of the kernel's caches for paths of one mount.

    libfuse3's ``fuse_invalidate_path(struct fuse *, path)`` makes the kernel
    forget the cached attributes and page cache of a path it knows (a path
    the kernel never looked up is not cached: -ENOENT, ignored).  The
    ``struct fuse *`` is only reachable from inside a callback, so ``init``
    records it here.

    Threading: call from any thread except the FUSE loop's, and never while
    holding the view's lock: the kernel may have to wait for a request in
    flight (a read holding a page lock) that the loop can only finish by
    taking that lock.  Every libfuse call goes through a gate that
    :meth:`detach` closes when the loop has returned, before libfuse tears
    the session down (``loop.py``): it also waits for the calls in
    flight, so none runs on any thread once teardown starts.

    Names (dentries) cannot be invalidated this way (libfuse3 3.14 offers
    that only by node id, which the high-level API keeps to itself), so a
    name whose file was removed or replaced is put in :attr:`gone` before
    its attributes are dropped: the next GETATTR of it (the kernel's
    question once the attributes are gone) answers ``ESTALE`` once, and the
    VFS retries the lookup with revalidation, which drops or rebinds the
    name (a kind change, file -> directory, included).  ``gone`` is a plain
    set: added to by the control and watcher threads, consumed by the loop.
    Without ``lowlevel``'s lookup hook (:attr:`lookups_told` False) a
    LOOKUP cannot be told from a GETATTR, and an ESTALE to a LOOKUP fails
    the system call (``mkdir`` of a name removed outside); those mounts
    renew every name instead (:meth:`new_epoch`, Linux 6.16+; on an older
    kernel a name whose kind changed outside answers EIO once).  One race
    stays there: an ``open(O_CREAT)`` through the mount of a name removed
    outside at that very moment can fail with ENOENT, when the permission
    check's GETATTR lands between the walk and the renewal.

    :meth:`new_epoch` is the one call that is safe on the loop thread and
    under the view's lock: it only bumps a counter in the kernel.
    """

    def __init__(self) -> None:
        self._fuse: int | None = None
        lib = mfusepy._libfuse
        self._call = lib.fuse_invalidate_path
        self._call.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        self._call.restype = ctypes.c_int
        lib.fuse_get_session.argtypes = [ctypes.c_void_p]
        lib.fuse_get_session.restype = ctypes.c_void_p
        lib.fuse_session_fd.argtypes = [ctypes.c_void_p]
        lib.fuse_session_fd.restype = ctypes.c_int
        self._dev_fd = -1  # the session's /dev/fuse descriptor (libfuse's own)
        # The gate: _fuse (None once closed) and the libfuse calls in flight.
        self._gate = threading.Condition()
        self._inflight = 0
        self.gone: set[str] = set()
        #: Whether directory listings are being cached (ListingCache; for
        #: the control channel's ``ping``, any thread).
        self.listings_cached = False
        #: Whether a LOOKUP can be told from a GETATTR (ListingCache's hook
        #: installed).  When not, gone names never get ESTALE and
        #: :meth:`invalidate` renews every name instead.
        self.lookups_told = True
        # Names the kernel was told are absent, with a timeout: view path ->
        # (parent node id, name, monotonic expiry, when noted).  Added by the loop
        # (note_negative), expired by forget from any other thread.
        self._negatives: dict[str, tuple[int, bytes, float, float]] = {}
        # Every directory above a recorded name -> how many are below it: a
        # forget of a path with none below costs no scan.
        self._above: dict[str, int] = {}
        self._neg_lock = threading.Lock()
        #: How many forgets began (read by the loop before it asks the view).
        self.forgets = 0
        #: Whether negative names are being cached (``StepFS._negative``;
        #: for the control channel's ``ping``).
        self.negatives_cached = False
        self._loop_thread = 0

    def attach(self) -> None:
        """Record the running ``struct fuse *`` (from inside a callback)."""
        lib = mfusepy._libfuse
        self._fuse = lib.fuse_get_context().contents.fuse
        self._dev_fd = lib.fuse_session_fd(lib.fuse_get_session(self._fuse))
        self._loop_thread = threading.get_ident()

    def detach(self, wait: float = 10.0) -> bool:
        """The session is ending: close the gate (later calls do nothing),
        then wait at most ``wait`` seconds for the libfuse calls in flight;
        False when one is still running (the kernel holds it until the
        unmount aborts the connection: it has walked the node table
        already, and only waits in its write).  On the loop thread: after
        the loop returned (``loop.py``), and again from ``destroy``."""
        with self._gate:
            self._fuse = None
            self._dev_fd = -1  # new_epoch runs on this same thread: no race
            done = self._gate.wait_for(lambda: self._inflight == 0, wait)
        if not done:
            log.warning("an invalidation is still running in the kernel at unmount")
        return done

    def new_epoch(self) -> bool:
        """Make the kernel look up again every name it holds before it uses
        the name or its cached attributes (FUSE_NOTIFY_INC_EPOCH, Linux
        6.16+; libfuse 3.14 has no call for it, so the notification is
        written to the session's descriptor as libfuse writes its own: a
        bare ``fuse_out_header`` with ``unique`` 0).  Each name then costs
        one lookup, once; pages are kept (the bytes did not change).

        Unlike :meth:`forget` this is safe on the FUSE loop thread and under
        the view's lock: the kernel only increments the connection's epoch
        (no inode, page or dentry lock; dentries are checked at their next
        walk), so it cannot wait for a request the loop has yet to answer.
        A name reached only through an open descriptor (``fstat``) is not
        walked and keeps its attributes until the timeout.  Returns False
        when the kernel refused (older than 6.16: logged once; cached
        attributes then last until the timeout, as before)."""
        fd = self._dev_fd
        if fd < 0:
            return False
        try:
            os.write(fd, _INC_EPOCH)
        except OSError as exc:
            log.warning("the kernel refused FUSE_NOTIFY_INC_EPOCH (%s): other names of a workspace hard link "
                        "show their old link count until the attribute timeout", os.strerror(exc.errno))
            self._dev_fd = -1
            return False
        return True

    def note_negative(self, path: str, parent: int, name: bytes, timeout: float, forgets: int) -> bool:
        """Record that the LOOKUP being answered tells the kernel ``path``
        (``name`` in node ``parent``) is absent for ``timeout`` seconds, so
        that :meth:`forget` of it (or of a directory above it) can expire
        the kernel's negative name; False (do not cache it) when too many
        are recorded, or when a forget ran since :attr:`forgets` was
        ``forgets`` (it may have been about this name, before it was
        recorded).  On the loop thread.

        Records are kept in the order they were noted (a name noted again
        moves to the end), which with the one timeout the mount uses is
        the order they expire in: at the limit only the expired records at
        the front are looked at (:meth:`_prune`).  Scanning every record
        instead cost a millisecond per LOOKUP of an absent name once the
        limit was reached (the last 4,000 files of a 20,000-file create)."""
        now = time.monotonic()
        with self._neg_lock:
            if self.forgets != forgets:
                return False
            negs = self._negatives
            if path in negs:
                self._drop(path)  # noted again: to the end, with its new expiry
            elif len(negs) >= NEGATIVE_LIMIT:
                self._prune(now)
                if len(negs) >= NEGATIVE_LIMIT:
                    return False
            for up in _ancestors(path):
                self._above[up] = self._above.get(up, 0) + 1
            negs[path] = (parent, name, now + timeout, now)
        return True

    def _prune(self, now: float) -> None:
        """Drop the expired records at the front of the record (under
        :attr:`_neg_lock`): stops at the first one still live, so it costs
        what it drops.  A record noted with a shorter timeout behind a
        longer one waits for that one; it only takes a place meanwhile."""
        expired = []
        for key, rec in self._negatives.items():
            if rec[2] > now:
                break
            expired.append(key)
        for key in expired:
            self._drop(key)

    def _drop(self, path: str) -> tuple[int, bytes, float, float]:
        """Remove one record (under :attr:`_neg_lock`)."""
        above = self._above
        for up in _ancestors(path):
            left = above[up] - 1
            if left:
                above[up] = left
            else:
                del above[up]
        return self._negatives.pop(path)

    def negatives_noted(self) -> int:
        """How many negative names are recorded (expired ones included until
        pruned); any thread."""
        with self._neg_lock:
            return len(self._negatives)

    def _expire_negatives(self, path: str | None) -> None:
        """Expire the kernel's cached negative names of ``path`` and below
        it (None: all of them).  Not on the loop thread: the kernel takes
        the parent directory's lock, which a request waiting for the loop
        may hold."""
        now = time.monotonic()
        with self._neg_lock:
            self.forgets += 1
            negs = self._negatives
            if not negs:
                return
            if path is None or path == "/":
                keys = list(negs)
            else:
                keys = [path] if path in negs else []
                if path in self._above:  # a directory with recorded names below it
                    under = path + "/"
                    keys += [k for k in negs if k.startswith(under)]
            todo = [self._drop(k) for k in keys]
        todo = [rec for rec in todo if rec[2] > now]
        if not todo:
            return
        with self._gate:
            fd = self._dev_fd if self._fuse else -1
            if fd < 0:
                return
            self._inflight += 1
        renew = False
        try:
            for parent, name, _until, noted in todo:
                body = struct.pack("<QII", parent, len(name), _EXPIRE_ONLY) + name + b"\0"
                try:
                    os.write(fd, struct.pack("<IiQ", 16 + len(body), _INVAL_ENTRY, 0) + body)
                except OSError as exc:
                    if exc.errno != errno.ENOENT:
                        log.warning("expiring the negative name %r failed: %s", name, os.strerror(exc.errno))
                        renew = True
                    elif now - noted < _IN_FLIGHT_S:
                        # Not in the kernel yet: its LOOKUP may still be on
                        # its way back.  A new epoch invalidates what that
                        # LOOKUP caches (the kernel read the epoch before
                        # sending it).  Otherwise the name is simply gone.
                        renew = True
            if renew:
                self.new_epoch()
        finally:
            with self._gate:
                self._inflight -= 1
                if not self._inflight:
                    self._gate.notify_all()

    def expire_negatives(self) -> None:
        """Expire every negative name the kernel holds (the mount stops
        watching); on the loop thread it renews every name instead."""
        if threading.get_ident() == self._loop_thread:
            with self._neg_lock:
                self.forgets += 1
                self._negatives.clear()
                self._above.clear()
            self.new_epoch()
        else:
            self._expire_negatives(None)

    def forget(self, path: str) -> bool:
        """Invalidate one view path; True when the kernel had it cached.
        A negative name cached for it or below it is expired too (except on
        the loop thread: hard-link names, which exist)."""
        if threading.get_ident() != self._loop_thread:
            self._expire_negatives(path)
        with self._gate:
            fuse = self._fuse
            if not fuse:
                return False
            self._inflight += 1
        try:
            rc = self._call(fuse, os.fsencode(path))
        finally:
            with self._gate:
                self._inflight -= 1
                if not self._inflight:
                    self._gate.notify_all()
        if rc != 0 and rc != -errno.ENOENT:
            log.warning("fuse_invalidate_path(%r) failed: %s", path, os.strerror(-rc))
        return rc == 0

    def invalidate(self, paths: list[str], gone: bool = False) -> int:
        """Invalidate ``paths`` (view paths); returns how many the kernel had
        cached.  ``gone``: their files were removed or replaced (see above)."""
        if gone:
            self.gone.update(paths)
        if gone and not self.lookups_told:
            # The kernel then looks every name up again before using it, and
            # a name whose kind changed gets the truth from that LOOKUP
            # instead of an EIO from a GETATTR of the old kind.
            self.new_epoch()
        return sum(1 for path in paths if self.forget(path))
