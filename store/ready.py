"""New files of a mount's open step written ahead of its commit.

Step 2 of the commit protocol (``store/publish.py``) makes every new
regular file of the layer from its object: a spare inode renamed into
``tmp/``, its bytes, owner, mode, attributes and mtime, then an ``fsync``
of all of them, on the step's critical path.  A mount daemon knows a small
file's final bytes when it is closed after writing, so it can do that work
then, on the fsync pool, while the agent goes on: a *ready file* is a spare
(still in ``spare/``, under a fresh name) holding exactly those bytes and
metadata, fsynced.  The commit then only checks it and renames it into
``tmp/`` under the entry's temporary name; the rest of the protocol is
unchanged (the switch renames it into place, recovery rewrites every new
file from the store as before).

A ready file is used only for the entry it was written for: same path and
the same *key* (object id, mode, owner, attributes, mtime: everything step 2
gives a file), and only if its inode is still the one written (inode, size,
mtime and ctime as after its ``fsync``: a write since changes the ctime).
Anything else (a path written again after it was readied, a chmod, a rename)
leaves it unused, and the commit writes that file itself.  Unused ready files
go back to the spares, which every taker empties first; one a dead daemon
left is a spare like any other (FORMAT.md, ``spare/``).

Only files a spare may become again are readied (one that outlives its
daemon is a spare for the next process): none with ``user.*`` attributes
(they would pass to the spare's next file), none owned by another user
(every taker refuses those).  At most :data:`READY_MAX` paths per step, the
first close of each, files up to :data:`READY_SIZE_MAX` bytes: a commit of a few edited files (an
agent's step) loses its file writes and fsyncs, a bulk write (an untar) pays
a bounded number of background writes.

Thread safety: :meth:`ReadyFiles.offer` and :meth:`ReadyFiles.detach` are
called under the view's lock, :meth:`ReadyFiles.take` by the commit (which
holds it); the writes run on the fsync pool, and the view waits for them
all before the store closes (:meth:`ReadyFiles.give_back`).
"""

from __future__ import annotations

import logging
import os
import stat
import threading

from stepfs.store import durable
from stepfs.store.spares import Spares

log = logging.getLogger("stepfs.ready")

#: Paths of one step readied at most (the spare pool holds 64).
READY_MAX = 32
#: Bytes of a file readied at most.
READY_SIZE_MAX = 64 << 10

#: What step 2 gives a file: ``(oid, permission bits, uid, gid, encoded
#: user.* attributes or None, mtime in ns or None)``; the owner is set
#: when running as root (``switch._owner_for``: the recorded one).
Key = tuple


def key_of(oid: str | None, mode: int, uid: int | None, gid: int | None, attrs: bytes | None,
           mtime_ns: int | None) -> Key:
    return (oid, stat.S_IMODE(mode), uid, gid, attrs or None, mtime_ns or None)


class _Ready:
    __slots__ = ("key", "job")

    def __init__(self, key: Key, job):
        self.key, self.job = key, job


class ReadyFiles:
    """The ready files of one mount's open step (see the module doc)."""

    def __init__(self, spares: Spares):
        self._spares = spares
        self._lock = threading.Lock()
        self._files: dict[bytes, _Ready] = {}  # guarded by _lock
        self._offered: set[bytes] = set()  # guarded by _lock: paths readied this step, used or not
        #: Entries the commits took a ready file for (tests and the log read it).
        self.used = 0

    def offer(self, path: bytes, key: Key, data: bytes) -> bool:
        """Write ``data`` as the new file of ``path`` with ``key``, on the
        pool; False if not taken on (the path was readied this step
        already, too many were, too big, no spare on hand)."""
        # Only files a spare could become again: one with attributes would
        # pass them on to the spare's next file, one owned by another user
        # is refused by every taker (a daemon that dies leaves them as spares).
        if path in self._offered or len(data) > READY_SIZE_MAX or key[2] != os.geteuid() or key[4] is not None \
                or not self._spares.available():
            return False
        with self._lock:
            if path in self._offered or len(self._offered) >= READY_MAX:
                return False
            self._offered.add(path)
            # With a test's hook installed the write runs here, at once, and
            # its fsync goes through the seam the hook sees; on the pool it
            # never does (a hook installed meanwhile must not count it).
            self._files[path] = _Ready(key, durable.run_meanwhile(self._write, key, data, durable.hooked()))
        return True

    def _write(self, key: Key, data: bytes, seam: bool) -> tuple[str, tuple] | None:
        """On the pool: a spare with ``data`` and ``key``'s metadata,
        fsynced (through ``store.durable`` if ``seam``); ``(its name in
        spare/, its identity)``, or None."""
        try:
            got = self._spares.take_ahead()
        except OSError as exc:  # the spare directory gone or unwritable: the commit copes without
            log.debug("no ready file: %s", exc)
            return None
        if got is None:
            return None
        name, fd = got
        path = os.path.join(self._spares.directory, name)
        try:
            try:
                view, done = memoryview(data), 0
                while done < len(view):
                    done += os.pwrite(fd, view[done:], done)
                _oid, mode, uid, gid, _attrs, mtime = key
                if os.geteuid() == 0:
                    os.fchown(fd, uid, gid)
                os.fchmod(fd, mode)
                if mtime:
                    os.utime(fd, ns=(mtime, mtime))
                (durable.fsync if seam else os.fsync)(fd)
                st = os.fstat(fd)
            finally:
                os.close(fd)
        except OSError as exc:  # a full disk, EIO: the commit writes the file itself
            log.debug("no ready file: %s", exc)
            _unlink(path)
            return None
        return name, _identity(st)

    def take(self, path: bytes, key: Key, tmp_name: bytes, tmp_fd: int) -> bool:
        """Rename the ready file of ``path`` to ``tmp_name`` in ``tmp_fd`` if
        it was written with exactly ``key`` and is unchanged since (waits
        for its write if still running); False: the caller makes the file."""
        with self._lock:
            ready = self._files.pop(path, None)
        if ready is None:
            return False
        got = _result(ready.job)
        if got is None:
            return False
        name, ident = got
        src = os.path.join(self._spares.directory, name)
        try:
            st = os.lstat(src)
        except OSError:
            return False  # taken by another process as a spare
        if _identity(st) != ident or not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            _unlink(src)  # changed since it was written: not ours to use or to keep
            return False
        if ready.key != key:
            self._spares.give_back(name)  # its next taker empties it and sets its mode
            return False
        try:
            os.rename(src, tmp_name, dst_dir_fd=tmp_fd)
        except FileNotFoundError:
            return False
        if os.stat(tmp_name, dir_fd=tmp_fd, follow_symlinks=False).st_ino != st.st_ino:
            os.unlink(tmp_name, dir_fd=tmp_fd)  # swapped in between: not ours to use
            return False
        self.used += 1
        return True

    def detach(self) -> list[_Ready]:
        """Forget this step's ready files (a commit ran: the next step starts
        afresh); returns the unused ones for :meth:`give_back`."""
        with self._lock:
            left = list(self._files.values())
            self._files.clear()
            self._offered.clear()
        return left

    def give_back(self, left: list[_Ready]) -> None:
        """Return unused ready files to the spares (waits for their writes)."""
        for ready in left:
            got = _result(ready.job)
            if got is not None:
                self._spares.give_back(got[0])


def _result(job) -> tuple[str, tuple] | None:
    try:
        return job.result()
    except Exception:  # a bug in the write: the commit makes the file itself
        log.exception("writing a ready file failed")
        return None


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _identity(st: os.stat_result) -> tuple:
    return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns
