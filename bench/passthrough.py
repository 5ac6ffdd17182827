"""A minimal mfusepy passthrough: the floor of Python FUSE overhead.

``python bench/passthrough.py SOURCE MOUNTPOINT [--attr-timeout S]
[--entry-timeout S] [--negative-timeout S]`` serves SOURCE at MOUNTPOINT
in the foreground until unmounted (``fusermount3 -u``).

It is what stepfs would cost if it did nothing but forward each call to the
directory below: the same library (libfuse3 through
``FUSE_LIBRARY_NAME=fuse3``), the same single-threaded loop, the same kernel
cache timeouts as ``overlayfs/fuse_ops.run`` (the bench passes the values it
reads from there), ``default_permissions`` and ``use_ino``; ``hard_remove``
so an unlinked open file costs no rename.  Extended attributes are served
as stepfs serves them (the kernel asks a filesystem that answers getxattr
at every ``ls -l`` of a file, for ``security.selinux``; one that answers
ENOSYS is never asked again, which would spare the reference requests
stepfs must answer), with ``FUSE_CAP_POSIX_ACL`` so the kernel caches ACL
answers, as stepfs asks.  No overlay, no store, no locks.
Every path is joined under SOURCE; it is a benchmark reference, not a
contained filesystem.
"""

from __future__ import annotations

import argparse
import errno
import os
import stat
import sys
import time

os.environ.setdefault("FUSE_LIBRARY_NAME", "fuse3")

import mfusepy  # noqa: E402  (needs the environment variable above)

#: The kernel caches POSIX ACLs (``overlayfs/daemon/fuse_ops.py`` asks the same).
FUSE_CAP_POSIX_ACL = 1 << 19
UTIME_NOW = (1 << 30) - 1
UTIME_OMIT = (1 << 30) - 2
STAT_KEYS = ("st_mode", "st_ino", "st_nlink", "st_size", "st_uid", "st_gid", "st_blocks", "st_blksize")


def _os_errors(method):
    """OSError -> FuseOSError with the same errno (mfusepy would log and EIO)."""

    def wrapper(self, *args):
        try:
            return method(self, *args)
        except OSError as exc:
            raise mfusepy.FuseOSError(exc.errno or errno.EIO) from None

    wrapper.__name__ = method.__name__
    return wrapper


class Passthrough(mfusepy.Operations):
    use_ns = True

    def __init__(self, source: str):
        self.source = os.path.realpath(source)

    def _full(self, path: str) -> str:
        return self.source + path if path != "/" else self.source

    def init_with_config(self, conn, config):
        if conn is not None and conn.capable & FUSE_CAP_POSIX_ACL:
            conn.want |= FUSE_CAP_POSIX_ACL

    @_os_errors
    def getxattr(self, path, name, position=0):
        return os.getxattr(self._full(path), name, follow_symlinks=False)

    @_os_errors
    def listxattr(self, path):
        return os.listxattr(self._full(path), follow_symlinks=False)

    @_os_errors
    def getattr(self, path, fh=None):
        st = os.fstat(fh) if fh is not None else os.lstat(self._full(path))
        out = {key: getattr(st, key) for key in STAT_KEYS}
        out.update(st_atime=st.st_atime_ns, st_mtime=st.st_mtime_ns, st_ctime=st.st_ctime_ns)
        return out

    @_os_errors
    def readdir(self, path, fh):
        # With use_ino, entries need their inode: glibc's readdir skips d_ino 0.
        full = self._full(path)
        st = os.lstat(full)
        out = [(".", {"st_ino": st.st_ino, "st_mode": st.st_mode}, 0), ("..", {"st_ino": 1, "st_mode": st.st_mode}, 0)]
        with os.scandir(full) as it:
            for entry in it:
                # d_type from the directory itself: no extra stat per entry.
                kind = (stat.S_IFDIR if entry.is_dir(follow_symlinks=False)
                        else stat.S_IFLNK if entry.is_symlink() else stat.S_IFREG)
                out.append((entry.name, {"st_ino": entry.inode(), "st_mode": kind}, 0))
        return out

    @_os_errors
    def readlink(self, path):
        return os.readlink(self._full(path))

    @_os_errors
    def mkdir(self, path, mode):
        os.mkdir(self._full(path), mode)

    @_os_errors
    def rmdir(self, path):
        os.rmdir(self._full(path))

    @_os_errors
    def unlink(self, path):
        os.unlink(self._full(path))

    @_os_errors
    def symlink(self, target, source):
        os.symlink(source, self._full(target))

    @_os_errors
    def rename(self, old, new):
        os.rename(self._full(old), self._full(new))

    @_os_errors
    def link(self, target, source):
        os.link(self._full(source), self._full(target))

    @_os_errors
    def chmod(self, path, mode):
        os.chmod(self._full(path), mode)

    @_os_errors
    def chown(self, path, uid, gid):
        os.chown(self._full(path), uid, gid, follow_symlinks=False)

    @_os_errors
    def utimens(self, path, times=None):
        full = self._full(path)
        if times is None or UTIME_NOW in times or UTIME_OMIT in times:
            # libfuse3 passes UTIME_NOW / UTIME_OMIT as the nanosecond field.
            st = os.lstat(full)
            now = time.time_ns()
            a, m = times or (UTIME_NOW, UTIME_NOW)
            times = (st.st_atime_ns if a == UTIME_OMIT else now if a == UTIME_NOW else a,
                     st.st_mtime_ns if m == UTIME_OMIT else now if m == UTIME_NOW else m)
        os.utime(full, ns=times, follow_symlinks=False)

    @_os_errors
    def truncate(self, path, length, fh=None):
        if fh is not None:
            os.ftruncate(fh, length)
        else:
            os.truncate(self._full(path), length)

    @_os_errors
    def open(self, path, flags):
        return os.open(self._full(path), flags & ~os.O_CREAT)

    @_os_errors
    def create(self, path, mode, flags):
        return os.open(self._full(path), flags | os.O_CREAT, mode)

    @_os_errors
    def read(self, path, size, offset, fh):
        return os.pread(fh, size, offset)

    @_os_errors
    def write(self, path, data, offset, fh):
        return os.pwrite(fh, data, offset)

    def flush(self, path, fh):
        return 0

    @_os_errors
    def fsync(self, path, datasync, fh):
        (os.fdatasync if datasync else os.fsync)(fh)
        return 0

    @_os_errors
    def release(self, path, fh):
        os.close(fh)
        return 0

    @_os_errors
    def statfs(self, path):
        sv = os.statvfs(self._full(path))
        return {key: getattr(sv, key) for key in (
            "f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files", "f_ffree", "f_favail",
            "f_flag", "f_namemax")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench-passthrough")
    parser.add_argument("source")
    parser.add_argument("mountpoint")
    parser.add_argument("--attr-timeout", type=float, default=1.0)
    parser.add_argument("--entry-timeout", type=float, default=1.0)
    parser.add_argument("--negative-timeout", type=float, default=0.0)
    args = parser.parse_args(argv)
    mfusepy.FUSE(
        Passthrough(args.source),
        args.mountpoint,
        foreground=True,
        nothreads=True,
        fsname="bench-passthrough",
        subtype="passthrough",
        default_permissions=True,
        use_ino=True,
        hard_remove=True,
        attr_timeout=args.attr_timeout,
        entry_timeout=args.entry_timeout,
        negative_timeout=args.negative_timeout,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
