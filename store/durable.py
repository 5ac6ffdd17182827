"""The durability seam: every call that moves or persists committed state.

The commit protocol (``publish.py``) and the database's commits call these
functions instead of ``os.*`` so that one place can observe them.  In
production nothing is installed and each function is the plain system call
behind one ``is None`` test.  Tests install a :class:`Hook` with
:func:`installed` to count the calls, to SIGKILL the process (in a forked
child) at the k-th call, to make the n-th call fail with ``EIO`` /
``ENOSPC`` / ``EDQUOT``, or to record what has been made durable and rebuild
the tree a power loss would leave.

Operations (the ``op`` names a hook sees):

==========  ==========================================================
``fsync``   ``os.fsync`` of a temporary file or a workspace directory
            (:func:`fsync_all` reports one ``fsync`` per descriptor)
``rename``  a temporary file or symlink renamed into place
``unlink``  a file or symlink removed from the workspace
``rmdir``   a directory removed from the workspace
``mkdir``   a directory created in the workspace
``symlink`` a symlink created (as a temporary name)
``write``   ``pwrite`` of object bytes into a file being published
``syncfs``  ``syncfs`` of a whole new tree's filesystem (a clone: every
            file and directory it wrote, before the one rename that
            publishes the tree)
``commit``  the COMMIT of a writing database transaction (``args[0]``
            is true for a durable one: ``synchronous=FULL``)
==========  ==========================================================

A hook's ``before`` runs before the call (raise to make the call fail, or
kill the process to crash "at" it); ``after`` runs once it has succeeded.

Threading: the hook is process-global; tests install it around
single-threaded code.  :func:`fsync_all` runs its fsyncs on a small thread
pool when no hook is installed (so the filesystem can fold them into one
journal commit), and one after the other, in order, through the hook when
one is: the set of calls, and the rule that all of them have ended before
it returns, are the same either way.
"""

from __future__ import annotations

import errno
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Callable, Iterator, Protocol


class Hook(Protocol):
    def before(self, op: str, args: tuple) -> None: ...

    def after(self, op: str, args: tuple) -> None: ...


_hook: Hook | None = None


@contextmanager
def installed(hook: Hook) -> Iterator[Hook]:
    """Install ``hook`` for the duration of the block (tests only)."""
    global _hook
    previous, _hook = _hook, hook
    try:
        yield hook
    finally:
        _hook = previous


def hooked() -> bool:
    """Whether a hook is installed (a test is counting or failing calls)."""
    return _hook is not None


def fsync(fd: int) -> None:
    hook = _hook
    if hook is None:
        return os.fsync(fd)
    hook.before("fsync", (fd,))
    os.fsync(fd)
    hook.after("fsync", (fd,))


#: Threads of the fsync pool: enough for the fsyncs of one batch to be in
#: the kernel together (ext4 commits its journal once for all of them).
FSYNC_THREADS = 16

_pool: ThreadPoolExecutor | None = None
_pool_pid = 0
_pool_lock = threading.Lock()


def _executor() -> ThreadPoolExecutor:
    """The fsync pool of this process (a forked child makes its own: the
    parent's threads do not exist there)."""
    global _pool, _pool_pid
    with _pool_lock:
        if _pool is None or _pool_pid != os.getpid():
            _pool = ThreadPoolExecutor(max_workers=FSYNC_THREADS, thread_name_prefix="stepfs-fsync")
            _pool_pid = os.getpid()
        return _pool


def _fsync_or_error(fd: int) -> OSError | None:
    try:
        os.fsync(fd)
    except OSError as exc:
        return exc
    return None


def fsync_all(fds: list[int]) -> None:
    """``fsync`` every descriptor in ``fds``; returns once all of them
    have ended, and raises the first error (in ``fds`` order) if any
    failed.  A failed descriptor is never fsynced again here (a second
    fsync after a failed write-back can succeed with the bytes lost).

    Without a hook the calls run concurrently, so the filesystem can fold
    them into one journal commit instead of one per descriptor; with a hook
    each goes through :func:`fsync`, in order, and the first failure ends
    the batch (the caller then fails as it would have on that call)."""
    if _hook is not None or len(fds) < 2:
        for fd in fds:
            fsync(fd)
        return
    start_fsync_all(fds).wait()


class Syncing:
    """fsyncs begun by :func:`start_fsync_all`.  The caller MUST end it with
    :meth:`wait` or :meth:`abandon` before closing any of the descriptors
    (a pool thread may still be in ``fsync`` on them)."""

    def __init__(self, fds: list[int], futures: list | None):
        self.fds = fds
        self.futures = futures  # None: a hook is installed, nothing started yet

    def wait(self) -> None:
        """Every fsync has ended; raises the first error (in ``fds`` order).
        With a hook, runs them now, one by one, through :func:`fsync`."""
        if self.futures is None:
            for fd in self.fds:
                fsync(fd)
            return
        errors = [f.result() for f in self.futures]
        for exc in errors:
            if exc is not None:
                raise exc

    def abandon(self) -> None:
        """The caller fails anyway: let started fsyncs end, ignore their
        results (with a hook none is run)."""
        for f in self.futures or ():
            f.result()


def start_fsync_all(fds: list[int]) -> Syncing:
    """Begin ``fsync`` of every descriptor in ``fds`` on the pool, so the
    caller can do other work meanwhile (the commit records its intent
    while its new files are synced, and answers its caller while the
    workspace directories are); :meth:`Syncing.wait` ends them.  With
    a hook installed nothing starts here: ``wait`` runs each through
    :func:`fsync`, in order, at the point where it is called, which is one
    of the orders the concurrent run may take.

    A single descriptor goes to the pool too: run here, its fsync was one
    more sync round in front of the intent's COMMIT and, for a directory,
    in front of the daemon's answer (1-file steps took about 0.25 and
    0.5 ms longer each way, A/B on the 2-core bench machine under load)."""
    if _hook is not None:
        return Syncing(list(fds), None)
    if not fds:
        return Syncing([], [])
    pool = _executor()
    return Syncing(list(fds), [pool.submit(_fsync_or_error, fd) for fd in fds])


def run_meanwhile(fn: Callable, *args) -> "Syncing | _Done":
    """Run ``fn(*args)`` on the pool while the caller goes on (a commit
    prepares its switch while its intent's COMMIT waits for the disk);
    ``.result()`` waits for it and returns its value or raises its
    exception.  With a hook installed it runs here, at once, so the hook
    sees every call in one order: ``fn`` MAY make a durability call of
    this module only where it might as well be made at the call point, and
    only when it runs here (a ready file's fsync, ``store/ready.py``; never
    the switch's preparation, which runs beside the intent's COMMIT): one
    on the pool could meet a hook installed after it started."""
    if _hook is not None:
        try:
            return _Done(fn(*args))
        except BaseException as exc:
            return _Failed(exc)
    return _executor().submit(fn, *args)


class _Failed:
    """An exception known already, shaped like a failed future."""

    def __init__(self, exc: BaseException):
        self.exc = exc

    def result(self):
        raise self.exc


class _Done:
    """A result known already, shaped like a finished future."""

    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value


def rename(src: bytes, dst: bytes, *, src_dir_fd: int, dst_dir_fd: int, noreplace: bool = False) -> None:
    """``args``: ``(src, dst, src_dir_fd, dst_dir_fd)``.  ``noreplace``:
    fail with ``FileExistsError`` if ``dst`` exists (``RENAME_NOREPLACE``:
    the check and the rename are one call)."""
    hook = _hook
    do = _rename_noreplace if noreplace else os.rename
    if hook is None:
        return do(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
    args = (src, dst, src_dir_fd, dst_dir_fd)
    hook.before("rename", args)
    do(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
    hook.after("rename", args)


_RENAME_NOREPLACE = 1
_renameat2 = None


def _rename_noreplace(src: bytes, dst: bytes, *, src_dir_fd: int, dst_dir_fd: int) -> None:
    """``renameat2(..., RENAME_NOREPLACE)`` (glibc 2.28+; Python has no
    wrapper).  A filesystem without the flag (``EINVAL``) gets the plain
    rename the caller's token check was made for."""
    global _renameat2
    if _renameat2 is None:
        import ctypes  # noqa: PLC0415  (only commits that make new paths need it)

        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
        fn.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
        fn.restype = ctypes.c_int
        _renameat2 = (fn, ctypes.get_errno)
    fn, get_errno = _renameat2
    if fn(src_dir_fd, src, dst_dir_fd, dst, _RENAME_NOREPLACE) == 0:
        return
    err = get_errno()
    if err == errno.EINVAL:
        return os.rename(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
    raise OSError(err, os.strerror(err), dst)


_syncfs = None


def syncfs(fd: int) -> None:
    """``syncfs(2)`` of the filesystem holding ``fd`` (one call for every
    file a clone wrote, instead of an fsync each); ``args``: ``(fd,)``.
    Raises ``OSError`` on failure (Linux 5.8+ reports write-back errors)."""
    global _syncfs
    hook = _hook
    if hook is not None:
        hook.before("syncfs", (fd,))
    if _syncfs is None:
        import ctypes  # noqa: PLC0415  (only a clone needs it)

        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.syncfs
        fn.argtypes = (ctypes.c_int,)
        fn.restype = ctypes.c_int
        _syncfs = (fn, ctypes.get_errno)
    fn, get_errno = _syncfs
    if fn(fd) != 0:
        err = get_errno()
        raise OSError(err, os.strerror(err))
    if hook is not None:
        hook.after("syncfs", (fd,))


def unlink(name: bytes, *, dir_fd: int) -> None:
    """``args``: ``(name, dir_fd)``."""
    hook = _hook
    if hook is None:
        return os.unlink(name, dir_fd=dir_fd)
    hook.before("unlink", (name, dir_fd))
    os.unlink(name, dir_fd=dir_fd)
    hook.after("unlink", (name, dir_fd))


def rmdir(name: bytes, *, dir_fd: int) -> None:
    """``args``: ``(name, dir_fd)``."""
    hook = _hook
    if hook is None:
        return os.rmdir(name, dir_fd=dir_fd)
    hook.before("rmdir", (name, dir_fd))
    os.rmdir(name, dir_fd=dir_fd)
    hook.after("rmdir", (name, dir_fd))


def mkdir(name: bytes, mode: int, *, dir_fd: int) -> None:
    """``args``: ``(name, mode, dir_fd)``."""
    hook = _hook
    if hook is None:
        return os.mkdir(name, mode, dir_fd=dir_fd)
    hook.before("mkdir", (name, mode, dir_fd))
    os.mkdir(name, mode, dir_fd=dir_fd)
    hook.after("mkdir", (name, mode, dir_fd))


def symlink(target: bytes, name: bytes, *, dir_fd: int) -> None:
    """``args``: ``(target, name, dir_fd)``."""
    hook = _hook
    if hook is None:
        return os.symlink(target, name, dir_fd=dir_fd)
    hook.before("symlink", (target, name, dir_fd))
    os.symlink(target, name, dir_fd=dir_fd)
    hook.after("symlink", (target, name, dir_fd))


def pwrite(fd: int, data, offset: int) -> int:
    """``args``: ``(fd, data, offset)``."""
    hook = _hook
    if hook is None:
        return os.pwrite(fd, data, offset)
    hook.before("write", (fd, data, offset))
    n = os.pwrite(fd, data, offset)
    hook.after("write", (fd, data, offset))
    return n


def commit(do_commit: Callable[[], None], is_durable: bool) -> None:
    """Run ``do_commit`` (a database COMMIT) through the seam; ``args``:
    ``(is_durable,)``."""
    hook = _hook
    if hook is None:
        return do_commit()
    hook.before("commit", (is_durable,))
    do_commit()
    hook.after("commit", (is_durable,))
