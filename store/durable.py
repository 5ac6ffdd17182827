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
``rename``  a temporary file or symlink renamed into place
``unlink``  a file or symlink removed from the workspace
``rmdir``   a directory removed from the workspace
``mkdir``   a directory created in the workspace
``symlink`` a symlink created (as a temporary name)
``write``   ``pwrite`` of object bytes into a file being published
``commit``  the COMMIT of a writing database transaction (``args[0]``
            is true for a durable one: ``synchronous=FULL``)
==========  ==========================================================

A hook's ``before`` runs before the call (raise to make the call fail, or
kill the process to crash "at" it); ``after`` runs once it has succeeded.

Threading: the hook is process-global; tests install it around
single-threaded code.
"""

from __future__ import annotations

import os
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


def fsync(fd: int) -> None:
    hook = _hook
    if hook is None:
        return os.fsync(fd)
    hook.before("fsync", (fd,))
    os.fsync(fd)
    hook.after("fsync", (fd,))


def rename(src: bytes, dst: bytes, *, src_dir_fd: int, dst_dir_fd: int) -> None:
    """``args``: ``(src, dst, src_dir_fd, dst_dir_fd)``."""
    hook = _hook
    if hook is None:
        return os.rename(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
    args = (src, dst, src_dir_fd, dst_dir_fd)
    hook.before("rename", args)
    os.rename(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
    hook.after("rename", args)


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
