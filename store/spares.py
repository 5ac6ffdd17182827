"""Spare inodes: empty files made ahead of time, so that publishing a file
does not allocate an inode on the commit's critical path.

Every file a layer publishes is a new inode (it is renamed over its path,
DESIGN's atomic replacement).  On some filesystems allocating an inode is
the dearest call of a commit: on the ext4 of the benchmark machine a
``creat`` costs about 1 ms of kernel CPU, while ``open`` of an existing
file, ``rename`` and ``link`` cost a few microseconds.  So a long-lived
process (the mount daemon) keeps a pool of empty files in
``.stepfs/spare/``, refilled in a background thread between commits, and
``switch._prepare`` renames one to its temporary name
(``.stepfs/tmp/L<layer>-<seq>``) and opens it with ``O_TRUNC`` instead of
creating that name.  Nothing else changes: the file gets its content,
owner, mode, attributes and mtime and is fsynced exactly as a created one
(store/FORMAT.md, "Publishing a layer").

Invariants:

* A file in ``spare/`` is a regular file created empty (``O_CREAT |
  O_EXCL``, mode 0600) by :meth:`Spares.fill` and never written there; it
  belongs to no layer and carries nothing.  Any process may take any spare
  (``rename`` is atomic: of two takers one gets ``ENOENT`` and moves on to
  the next), and a crash at any point leaves at most empty spares, which
  the next process adopts (or deletes, see :meth:`Spares.clear`).
* The taker opens the taken file ``O_NOFOLLOW`` and empties it only if
  it is a regular file of this user with exactly one link (the name it
  was just renamed to), so a spare that somehow has bytes cannot leak into
  a published file, and a hard link planted in ``spare/`` to a file
  elsewhere is never written: it is unlinked and the commit falls back to
  creating the temporary file.  The pool's directories are named through
  the store's directory handle (``Workspace.store_dir``), never by the
  workspace's path.
* With no spare left (none made yet, or a commit larger than the pool),
  the temporary file is created as before.  A process that never calls
  :meth:`fill` (the CLI, tests) uses only spares it finds on disk.

Retired inodes are the same cost at the other end.  Renaming a new file
over a workspace file drops the old inode's last link, and the kernel frees
it inside the ``rename`` (about as dear as allocating one: a few hundred
microseconds to a millisecond each on the bench disk, most of a 10-file
commit's switch).  So before a commit replaces (or removes) a file that has
one link, :meth:`retire` gives its inode a second name in
``.stepfs/retired/`` (``link``: a few microseconds); the rename then only
drops a link, and :meth:`sweep` deletes the retired names, and so frees
the inodes, after the commit: in the background thread of a filling
process, else at once.

* A file in ``retired/`` is a second name of an inode a commit was about
  to replace; it is never opened, read or written, and deleting it at any
  time is harmless: before the rename it only drops the link count back to
  one (the rename then frees the inode itself, as without retiring), after
  it frees an inode that no workspace path names any more.  A crash leaves
  retired names behind; the next sweep deletes them.
* Only inodes with exactly one link are retired: a file with other hard
  links is not freed by the rename, and a retired name must not show in
  the other names' link count after the commit.

Threading: :meth:`take`, :meth:`fill`, :meth:`retire` and :meth:`sweep` may
run concurrently (one lock guards the in-memory lists of names; no system
call is made under it); the background filler is one daemon thread per
:class:`Spares`, and it sweeps before it fills.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import stat
import threading
from collections import deque
from contextlib import contextmanager
from typing import Iterator

log = logging.getLogger("stepfs.spares")

#: Spares a filling process keeps on hand: a few steps' worth of files.
TARGET = 64


def _open_own_empty(name: bytes | str, dir_fd: int) -> int | None:
    """``name`` in ``dir_fd`` opened for writing and emptied, if it is a
    regular file of this user with one link; else None, having written
    nothing.  A spare with a second link (a hard link planted in
    ``spare/`` to a file elsewhere) or another owner would make the
    commit write into that file: checked before ``O_TRUNC``, on the very
    inode opened (``O_NOFOLLOW | O_NONBLOCK``: no symlink, no FIFO wait)."""
    try:
        before = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return None
    if not _own_single(before):
        return None  # not even opened: a device's open may do something
    try:
        fd = os.open(name, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None
    st = os.fstat(fd)
    if not _own_single(st) or (st.st_dev, st.st_ino) != (before.st_dev, before.st_ino):
        os.close(fd)
        return None
    os.ftruncate(fd, 0)
    return fd


def _own_single(st: os.stat_result) -> bool:
    return stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and st.st_uid == os.geteuid()


class Spares:
    def __init__(self, directory: str, retired_directory: str | None = None):
        self.directory = directory
        self.retired_directory = retired_directory  # None: nothing is retired
        self._lock = threading.Lock()
        self._names: deque[str] = deque()  # guarded by _lock
        self._adopted = False  # guarded by _lock: the directory was listed once
        self._retired: list[str] = []  # guarded by _lock: names in retired_directory to delete
        self._retired_adopted = False  # guarded by _lock: retired_directory was listed once
        self._seq = itertools.count()
        self._prefix = f"S{os.getpid()}-{id(self):x}-"
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._filled = threading.Event()  # the filler finished a round since the last refill()
        self._commits = 0  # guarded by _lock: commits of this process in progress
        self._idle = threading.Event()  # set while no commit of this process runs
        self._idle.set()
        self._thread: threading.Thread | None = None

    # -- taking -------------------------------------------------------------

    def _adopt(self) -> None:
        """Caller holds ``_lock``: list the spares already on disk once (a
        dead process's, or another live one's: a lost race is harmless)."""
        if self._adopted:
            return
        self._adopted = True
        try:
            self._names.extend(os.listdir(self.directory))
        except FileNotFoundError:
            pass

    def take(self, name: bytes, dir_fd: int) -> int | None:
        """Move a spare to ``name`` in directory ``dir_fd`` (replacing what
        is there) and return it opened for writing, empty; None if no spare
        is left (the caller creates the file itself)."""
        while True:
            with self._lock:
                self._adopt()
                if not self._names:
                    return None
                spare = self._names.popleft()
            try:
                os.rename(os.path.join(self.directory, spare), name, dst_dir_fd=dir_fd)
            except FileNotFoundError:
                continue  # taken by another process, or the directory is gone
            fd = _open_own_empty(name, dir_fd)
            if fd is None:
                log.warning("spare %s is not a file of ours with one link; refused, creating the file instead",
                            spare)
                os.unlink(name, dir_fd=dir_fd)
                return None
            return fd

    def take_ahead(self) -> tuple[str, int] | None:
        """A spare moved to a fresh name in the spare directory (no other
        taker of this process gets it) and opened for writing, empty: a
        file written ahead of a commit (``store/ready.py``).  ``(name,
        fd)``, or None if no spare is on hand."""
        name = f"{self._prefix}{next(self._seq)}"
        fd = self.take(os.path.join(self.directory, name), None)
        return None if fd is None else (name, fd)

    def give_back(self, name: str) -> None:
        """``name`` (in the spare directory, from :meth:`take_ahead`) is a
        spare again: its next taker empties it."""
        with self._lock:
            self._names.append(name)

    def available(self) -> int:
        with self._lock:
            self._adopt()
            return len(self._names)

    # -- retiring -----------------------------------------------------------

    def retire(self, name: bytes, dir_fd: int) -> None:
        """``name`` in directory ``dir_fd`` is about to be renamed over or
        unlinked: if it is a non-directory with one link, give its inode a
        second name in the retired directory, so that call does not free it
        (:meth:`sweep` does, later).  Best effort: if the link cannot be
        made, the caller's call frees the inode itself, as it always did."""
        if self.retired_directory is None:
            return
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except OSError:
            return  # nothing there (a new path), or the caller's own call will say why
        if st.st_nlink != 1 or stat.S_ISDIR(st.st_mode):
            return
        retired = f"{self._prefix}{next(self._seq)}"
        target = os.path.join(self.retired_directory, retired)
        try:
            os.link(name, target, src_dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            try:  # the directory is missing (a store made before it existed)
                os.makedirs(self.retired_directory, mode=0o700, exist_ok=True)
                os.link(name, target, src_dir_fd=dir_fd, follow_symlinks=False)
            except OSError:
                return
        except OSError as exc:  # EPERM (protected_hardlinks), EMLINK, ENOSPC, ...: not retired
            log.debug("could not retire %r: %s", name, exc)
            return
        with self._lock:
            self._retired.append(retired)

    def retired(self) -> int:
        """Retired names this process knows of and has not deleted yet."""
        with self._lock:
            return len(self._retired)

    def release(self) -> None:
        """A commit has made its renames: free what it retired, in the
        background thread when there is one (after the commit, see
        :meth:`pausing`), else now.  Inside :meth:`pausing` the thread is
        not woken here (its end wakes it): woken in the middle of a
        commit, it only took the GIL from the commit to find it paused."""
        if self._thread is not None:
            with self._lock:
                if self._commits:
                    return
            self.refill()
        else:
            self.sweep()

    def sweep(self) -> int:
        """Delete every retired name (this process's and, once, any left on
        disk by a dead process), one at a time and never alongside a commit
        of this process (an inode freed holds a journal handle, like one
        allocated, see :meth:`fill`).  Returns how many were deleted."""
        if self.retired_directory is None:
            return 0
        removed = 0
        while True:
            with self._lock:
                if not self._retired_adopted:
                    self._retired_adopted = True
                    try:
                        self._retired.extend(set(os.listdir(self.retired_directory)) - set(self._retired))
                    except FileNotFoundError:
                        pass
                if not self._retired:
                    break
                name = self._retired.pop()
            if self._thread is not None and threading.current_thread() is self._thread:
                self._idle.wait()
            try:
                os.unlink(os.path.join(self.retired_directory, name))
                removed += 1
            except FileNotFoundError:
                pass
            except OSError as exc:  # EIO, a read-only store: the name stays until a later sweep
                log.warning("could not delete the retired inode %s: %s", name, exc)
                with self._lock:
                    self._retired.append(name)
                break
        return removed

    # -- filling ------------------------------------------------------------

    def fill(self, target: int = TARGET) -> int:
        """Create spares until ``target`` are on hand (this process's count);
        returns how many were made.  Raises ``OSError`` (ENOSPC, ...)."""
        made = 0
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        while not self._stop.is_set():
            with self._lock:
                self._adopt()
                if len(self._names) >= target:
                    break
            # Never alongside a commit: an inode allocation holds a journal
            # handle for its whole (long) run, and the commit's fsyncs wait
            # for every open handle before the journal can commit.
            self._idle.wait()
            name = f"{self._prefix}{next(self._seq)}"
            try:
                os.close(os.open(os.path.join(self.directory, name),
                                 os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
            except FileExistsError:
                continue
            with self._lock:
                self._names.append(name)
            made += 1
        return made

    def start_filling(self, target: int = TARGET) -> None:
        """Keep ``target`` spares on hand from a background thread, woken
        by :meth:`refill` (after a commit, not during it: the filler's
        creates would compete with the commit for the CPU), until
        :meth:`stop`.  For long-lived processes only (the mount daemon)."""
        if self._thread is not None:
            return

        def run() -> None:
            while not self._stop.is_set():
                self._wake.clear()  # before filling: a refill asked meanwhile is not lost
                try:
                    self.sweep()
                    self.fill(target)
                except OSError as exc:
                    # A full disk or a removed store: commits create their
                    # files themselves meanwhile; try again at the next take.
                    if exc.errno not in (errno.ENOSPC, errno.EDQUOT, errno.ENOENT):
                        log.warning("making spare files failed: %s", exc)
                self._filled.set()
                self._wake.wait()

        self._thread = threading.Thread(target=run, name="stepfs-spares", daemon=True)
        self._thread.start()

    @contextmanager
    def pausing(self) -> Iterator[None]:
        """Around a commit: the background filler makes no spare meanwhile
        (one already being made finishes), and is woken afterwards to
        replace the spares the commit took."""
        with self._lock:
            self._commits += 1
            self._idle.clear()
        try:
            yield
        finally:
            with self._lock:
                self._commits -= 1
                if self._commits == 0:
                    self._idle.set()
            self.refill()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Whether no commit of this process runs (within ``timeout``
        seconds): background work waits for it (``store.deltawork``)."""
        return self._idle.wait(timeout)

    def refill(self) -> None:
        """Wake the background filler, if any (call after a commit)."""
        self._filled.clear()
        self._wake.set()

    def wait_filled(self, timeout: float | None = None) -> bool:
        """Whether the background filler finished a round since the last
        :meth:`refill` (within ``timeout`` seconds)."""
        return self._filled.wait(timeout)

    def stop(self) -> None:
        """End the background filler (spares on disk stay for the next
        process)."""
        self._stop.set()
        self._wake.set()
        self._idle.set()  # a filler waiting for a commit to end: let it see the stop
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        self.sweep()  # what the thread had no time for (the names would stay on disk till the next sweep)

    def clear(self) -> int:
        """Delete every spare on disk (none may be taken meanwhile)."""
        removed = 0
        with self._lock:
            self._names.clear()
            self._adopted = True
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return 0
        for name in names:
            try:
                os.unlink(os.path.join(self.directory, name))
                removed += 1
            except FileNotFoundError:
                pass
        return removed
