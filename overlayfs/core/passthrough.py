"""Unversioned paths: every operation straight on the workspace (FUSE-free).

What ``unversioned.Rules`` covers is served here: no staging, no store, no
version token, no draft, no lock held beyond the call.  A change lands in
the workspace at once, as in a build directory outside version control;
a step never records it and a rollback never touches it.

Containment is the workspace :class:`store.contained.Root`'s: every path
is resolved beneath the workspace with ``openat2`` without following a
symlink (a symlink planted in place of a directory gives ``ELOOP``), the
store (``.stepfs``) is unreachable, and each ``*at`` call is made relative
to a parent directory opened that way, on one name.

Handles are the workspace file's own descriptor, numbered
``HANDLE_BASE + fd`` so the view tells them from its own handles with one
comparison (``Content`` numbers its handles from 1).

Caveats: a path whose workspace parent directory does not exist (the
directory exists only in the open step) cannot be served here; the view
stages it like any other path (``Overlay._unversioned``).
"""

from __future__ import annotations

import errno
import os
import stat as stat_mod

from stepfs.overlayfs.core.errors import NotFound
from stepfs.overlayfs.core.upper import rel

#: First passthrough handle number (Content's count never gets there).
HANDLE_BASE = 1 << 48
_UTIME_NOW = (1 << 30) - 1
_UTIME_OMIT = (1 << 30) - 2


class Passthrough:
    """Operations on the workspace beneath ``root`` (a contained Root)."""

    def __init__(self, root):
        self.root = root
        self._euid = os.geteuid()
        self._egid = os.getegid()
        mask = os.umask(0)
        os.umask(mask)
        self._umask = mask

    # -- helpers -------------------------------------------------------------------

    def _parent(self, path: str) -> tuple[int, bytes]:
        return self.root.parent(rel(path))

    def parent_exists(self, path: str) -> bool:
        """Whether the workspace has the directory ``path`` would go in."""
        head = path.rpartition("/")[0]
        if not head:
            return True
        st = self.root.lstat_or_none(rel(head))
        return st is not None and stat_mod.S_ISDIR(st.st_mode)

    def exists(self, path: str) -> bool:
        return self.root.lstat_or_none(rel(path)) is not None

    def is_dir(self, path: str) -> bool:
        st = self.root.lstat_or_none(rel(path))
        return st is not None and stat_mod.S_ISDIR(st.st_mode)

    def _own(self, dfd: int, name: bytes, owner: tuple[int, int] | None, mode: int | None = None) -> None:
        """Give a new name the caller's owner and exactly ``mode`` (the
        daemon's own umask must not strip what the caller asked for)."""
        if owner is not None and (owner[0], owner[1]) != (self._euid, self._egid) and self._euid == 0:
            os.chown(name, owner[0], owner[1], dir_fd=dfd, follow_symlinks=False)
        if mode is not None and mode & self._umask & 0o777:
            os.chmod(name, stat_mod.S_IMODE(mode), dir_fd=dfd, follow_symlinks=False)

    @staticmethod
    def is_handle(fh) -> bool:
        return fh is not None and fh >= HANDLE_BASE

    # -- names ----------------------------------------------------------------------

    def mkdir(self, path: str, mode: int, owner=None) -> None:
        dfd, name = self._parent(path)
        try:
            os.mkdir(name, mode & 0o7777, dir_fd=dfd)
            self._own(dfd, name, owner, mode)
        finally:
            os.close(dfd)

    def rmdir(self, path: str) -> None:
        dfd, name = self._parent(path)
        try:
            os.rmdir(name, dir_fd=dfd)
        finally:
            os.close(dfd)

    def unlink(self, path: str) -> None:
        dfd, name = self._parent(path)
        try:
            os.unlink(name, dir_fd=dfd)
        finally:
            os.close(dfd)

    def symlink(self, path: str, target: str, owner=None) -> None:
        dfd, name = self._parent(path)
        try:
            os.symlink(os.fsencode(target), name, dir_fd=dfd)
            if owner is not None and tuple(owner) != (self._euid, self._egid) and self._euid == 0:
                os.chown(name, owner[0], owner[1], dir_fd=dfd, follow_symlinks=False)
        finally:
            os.close(dfd)

    def mknod(self, path: str, mode: int, dev: int = 0, owner=None) -> None:
        dfd, name = self._parent(path)
        try:
            os.mknod(name, mode, dev, dir_fd=dfd)
            self._own(dfd, name, owner, mode)
        finally:
            os.close(dfd)

    def rename(self, old: str, new: str, flags: int = 0) -> None:
        ofd, oname = self._parent(old)
        try:
            nfd, nname = self._parent(new)
            try:
                if flags:
                    _renameat2(ofd, oname, nfd, nname, flags)
                else:
                    os.rename(oname, nname, src_dir_fd=ofd, dst_dir_fd=nfd)
            finally:
                os.close(nfd)
        finally:
            os.close(ofd)

    def link(self, path: str, existing: str) -> None:
        efd, ename = self._parent(existing)
        try:
            nfd, nname = self._parent(path)
            try:
                os.link(ename, nname, src_dir_fd=efd, dst_dir_fd=nfd, follow_symlinks=False)
            finally:
                os.close(nfd)
        finally:
            os.close(efd)

    # -- metadata ------------------------------------------------------------------

    def chmod(self, path: str, mode: int) -> None:
        dfd, name = self._parent(path)
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            if stat_mod.S_ISLNK(st.st_mode):
                return  # a symlink's mode means nothing (Linux cannot change it)
            os.chmod(name, stat_mod.S_IMODE(mode), dir_fd=dfd, follow_symlinks=False)
        finally:
            os.close(dfd)

    def chown(self, path: str, uid: int, gid: int) -> None:
        dfd, name = self._parent(path)
        try:
            os.chown(name, uid, gid, dir_fd=dfd, follow_symlinks=False)
        finally:
            os.close(dfd)

    def utimens(self, path: str, times) -> None:
        dfd, name = self._parent(path)
        try:
            if times is None:
                os.utime(name, dir_fd=dfd, follow_symlinks=False)
            else:
                _utimensat(dfd, name, times)
        finally:
            os.close(dfd)

    def setxattr(self, path: str, name: str, value: bytes, options: int = 0) -> None:
        if not name.startswith("user."):
            # As for versioned paths: the mount shows user.* attributes only
            # (the adapter answers every other getxattr "none").
            raise OSError(errno.EOPNOTSUPP, "only user.* attributes", path)
        fd = self._fd_for_xattr(path)
        try:
            os.setxattr(fd, name, value, options)
        finally:
            os.close(fd)

    def removexattr(self, path: str, name: str) -> None:
        fd = self._fd_for_xattr(path)
        try:
            os.removexattr(fd, name)
        finally:
            os.close(fd)

    def _fd_for_xattr(self, path: str) -> int:
        # Attributes of a symlink itself cannot be set through an O_PATH
        # descriptor; user.* ones are not allowed on symlinks anyway.
        try:
            return self.root.open(rel(path), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise OSError(errno.EPERM, "no attributes on a symlink") from None
            raise

    def truncate(self, path: str, length: int) -> None:
        fd = self.root.open(rel(path), os.O_WRONLY | os.O_NOFOLLOW)
        try:
            os.ftruncate(fd, length)
        finally:
            os.close(fd)

    # -- open files -------------------------------------------------------------------

    def open(self, path: str, flags: int) -> int:
        try:
            fd = self.root.open(rel(path), (flags & ~os.O_CREAT) | os.O_NOFOLLOW)
        except FileNotFoundError:
            raise NotFound(path) from None
        return HANDLE_BASE + fd

    def create(self, path: str, mode: int, flags: int, owner=None) -> int:
        fd = self.root.open(rel(path), flags | os.O_CREAT | os.O_NOFOLLOW, mode & 0o7777)
        try:
            if owner is not None and (owner[0], owner[1]) != (self._euid, self._egid) and self._euid == 0:
                os.fchown(fd, owner[0], owner[1])
            if mode & self._umask & 0o777:
                os.fchmod(fd, stat_mod.S_IMODE(mode))
        except OSError:
            os.close(fd)
            raise
        return HANDLE_BASE + fd

    @staticmethod
    def read(fh: int, size: int, offset: int) -> bytes:
        return os.pread(fh - HANDLE_BASE, size, offset)

    @staticmethod
    def readinto(fh: int, buf: memoryview, offset: int) -> int:
        return os.preadv(fh - HANDLE_BASE, (buf,), offset)

    @staticmethod
    def write(fh: int, data: bytes, offset: int) -> int:
        return os.pwrite(fh - HANDLE_BASE, data, offset)

    @staticmethod
    def ftruncate(fh: int, length: int) -> None:
        os.ftruncate(fh - HANDLE_BASE, length)

    @staticmethod
    def fallocate(fh: int, mode: int, offset: int, length: int) -> None:
        if mode:
            raise OSError(errno.EOPNOTSUPP, "fallocate mode")
        os.posix_fallocate(fh - HANDLE_BASE, offset, length)

    @staticmethod
    def fsync(fh: int, datasync: bool) -> None:
        (os.fdatasync if datasync else os.fsync)(fh - HANDLE_BASE)

    @staticmethod
    def release(fh: int) -> None:
        os.close(fh - HANDLE_BASE)

    @staticmethod
    def fstat(fh: int) -> os.stat_result:
        return os.fstat(fh - HANDLE_BASE)


def _renameat2(ofd: int, oname: bytes, nfd: int, nname: bytes, flags: int) -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.renameat2(ofd, oname, nfd, nname, ctypes.c_uint(flags)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _utimensat(dfd: int, name: bytes, times) -> None:
    """``utimensat`` with UTIME_NOW / UTIME_OMIT honoured (os.utime cannot
    omit one of the two times)."""
    import ctypes

    class _Ts(ctypes.Structure):
        _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]

    pair = (_Ts * 2)()
    for i, t in enumerate(times):
        if t in (_UTIME_NOW, _UTIME_OMIT):
            pair[i].tv_sec, pair[i].tv_nsec = 0, t
        else:
            pair[i].tv_sec, pair[i].tv_nsec = divmod(t, 1_000_000_000)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.utimensat(dfd, name, pair, 0x100) != 0:  # AT_SYMLINK_NOFOLLOW
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
