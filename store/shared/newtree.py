"""A clone's tree written into a new, empty directory nobody else sees yet
(``store.shared.cloning``): each path straight at its place, no temporary
file, no token check, no fsync (the clone syncs the filesystem once).
An all-zero stretch of 64 KiB is left a hole, so a sparse file stays sparse.

Paths are made parents first, in path order.  Each is made through its
parent's descriptor, every directory opened without following a symlink,
and a path that would leave the tree or enter its store is refused
(:class:`HistoryError`): a path of the history never reaches outside,
whatever it names.

Directories are made on the caller's thread, in order; files, symlinks
and nodes of a batch are made on a few threads at once: creating a file
mostly waits for the filesystem's journal, and several creates wait
together.  Directory modes and attributes are set last, deepest
first, so a read-only directory is filled before it becomes one.
"""

from __future__ import annotations

import errno
import os
from concurrent.futures import Future, ThreadPoolExecutor, wait

from stepfs.store import xattrs
from stepfs.store.contained import NODE_KINDS, rdev_of
from stepfs.store.errors import HistoryError
from stepfs.store.paths import STORE_DIR
from stepfs.store.shared.stateread import PathState

#: Threads that make a batch's files (few: the machine's other work keeps its share).
THREADS = 4
#: Paths per task handed to a thread.
TASK_PATHS = 64
#: Directory descriptors kept open between batches (path order revisits
#: few; beyond this many all are closed once a batch is written).
OPEN_DIRS = 256
#: A file's bytes are written in windows of this many; an all-zero window
#: is left a hole, so a sparse file of the history stays sparse (a
#: multiple of every usual block size; smaller files are written whole).
HOLE_WINDOW = 64 * 1024
_ZEROS = bytes(HOLE_WINDOW)

_STORE = STORE_DIR.encode()


def check_path(path: bytes) -> tuple[bytes, bytes]:
    """``(parent, name)`` of a path of the history, or HistoryError for one
    that would leave the tree or enter its store."""
    framed = b"/" + path + b"/"
    if (b"//" in framed or b"/./" in framed or b"/../" in framed or b"\0" in path
            or path.split(b"/", 1)[0] == _STORE):
        raise HistoryError(f"the shared history names the path {path!r}, which is not a path inside a workspace; "
                           f"the history is damaged: run 'stepfs verify-history'.")
    parent, _, name = path.rpartition(b"/")
    return parent or b".", name


class NewTree:
    """Use :meth:`write` then :meth:`wait` per batch, :meth:`finish` once
    all are written, and :meth:`close` always."""

    def __init__(self, root: str):
        self.root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        # Read, never set: a program that calls ``sync.clone`` from several
        # threads keeps its own umask for its own files.
        self._umask = current_umask()
        self.fds: dict[bytes, int] = {}
        self.dirs: list[tuple[bytes, int, bytes | None]] = []  # modes and attributes, set by finish
        self._pool = ThreadPoolExecutor(max_workers=THREADS, thread_name_prefix="stepfs-clone-write")

    def _dir(self, path: bytes) -> int:
        """The descriptor of directory ``path`` of the tree (caller's thread only)."""
        if path == b".":
            return self.root_fd
        fd = self.fds.get(path)
        if fd is None:
            up, name = check_path(path)
            try:
                fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self._dir(up))
            except OSError as exc:
                if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                    raise HistoryError(f"the shared history names {path!r} below something that is not a directory "
                                       f"in it; the history is damaged: run 'stepfs verify-history'.") from None
                raise
            self.fds[path] = fd
        return fd

    def write(self, batch: list[PathState]) -> list[Future]:
        """Make the batch's directories now and start its other paths on
        the threads; pass the result to :meth:`wait`."""
        todo: list[tuple[int, bytes, PathState]] = []
        for s in batch:
            up, name = check_path(s.path)
            pfd = self._dir(up)
            if s.kind == "dir":
                os.mkdir(name, 0o700, dir_fd=pfd)  # its mode once it is filled (finish)
                self.dirs.append((s.path, s.mode, s.xattrs))
            elif s.kind == "file" or s.kind == "symlink" or s.kind in NODE_KINDS:
                todo.append((pfd, name, s))
            else:
                raise HistoryError(f"the shared history names {s.path!r} as a {s.kind}, which this stepfs cannot "
                                   f"make; upgrade stepfs.")
        return [self._pool.submit(_make_all, todo[i:i + TASK_PATHS], self._umask)
                for i in range(0, len(todo), TASK_PATHS)]

    def wait(self, futures: list[Future]) -> None:
        """Wait for a batch's paths; raise the first failure."""
        wait(futures)
        for f in futures:
            f.result()
        if len(self.fds) > OPEN_DIRS:  # no task holds one now
            self._close_dirs()

    def finish(self) -> None:
        for path, mode, attrs in sorted(self.dirs, key=lambda d: -d[0].count(b"/")):
            fd = self._dir(path)
            os.fchmod(fd, mode)
            xattrs.apply_fd(fd, xattrs.decode(attrs))

    def _close_dirs(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()

    def close(self) -> None:
        self._pool.shutdown(wait=True)  # no task may still use a descriptor closed below
        self._close_dirs()
        os.close(self.root_fd)


def current_umask() -> int:
    """The process's umask, from ``/proc/self/status`` (Linux 4.7+); setting
    it to read it back would change it for every thread meanwhile."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o777  # unknown: assume every bit is dropped, so every file gets its chmod


def _make_all(todo: list[tuple[int, bytes, PathState]], umask: int) -> None:
    for pfd, name, s in todo:
        _make(pfd, name, s, umask)


def _make(pfd: int, name: bytes, s: PathState, umask: int) -> None:
    if s.kind == "file":
        # Made with its mode: a chmod after only when the umask or open()
        # drops some of its bits (most files' modes pass a usual umask).
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, s.mode & 0o777,
                     dir_fd=pfd)
        try:
            _write_data(fd, s.data)
            if s.mode & ~0o777 or s.mode & umask:
                os.fchmod(fd, s.mode)
            if s.xattrs:
                xattrs.apply_fd(fd, xattrs.decode(s.xattrs))
            if s.mtime_ns:
                os.utime(fd, ns=(s.mtime_ns, s.mtime_ns))
        finally:
            os.close(fd)
    elif s.kind == "symlink":
        os.symlink(s.target, name, dir_fd=pfd)
    else:
        os.mknod(name, NODE_KINDS[s.kind] | 0o600, rdev_of(s.kind, s.target), dir_fd=pfd)
        os.chmod(name, s.mode, dir_fd=pfd, follow_symlinks=False)


def _write_data(fd: int, data: bytes) -> None:
    """Write ``data`` into the new empty file ``fd``, leaving every
    all-zero window of :data:`HOLE_WINDOW` bytes a hole (the size is set
    by ``ftruncate`` when the file ends in one)."""
    view = memoryview(data)
    size = len(view)
    pos, ends_in_hole = 0, False
    while pos < size:
        end = min(pos + HOLE_WINDOW, size)
        # startswith compares in place (a memoryview's == unpacks each byte)
        ends_in_hole = end - pos == HOLE_WINDOW and data.startswith(_ZEROS, pos)
        if not ends_in_hole:
            done = pos
            while done < end:
                done += os.pwrite(fd, view[done:end], done)
        pos = end
    if ends_in_hole:
        os.ftruncate(fd, size)
