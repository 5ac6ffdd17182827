"""Outside edits of the workspace, seen through inotify (FUSE-free).

The kernel may cache a mount's names and attributes for
:data:`stepfs.overlayfs.daemon.timeouts.ENTRY_TIMEOUT` seconds; an editor outside the mount
(DESIGN.md semantic 3) changes the workspace without telling FUSE.  This
module watches, with inotify, every workspace directory the mount has shown
to the kernel, and turns each event into "forget these paths" for the
kernel's caches.

Which directories: a directory is watched when the mount answers a
``getattr`` for it (:meth:`Watcher.watch`).  The kernel looks a directory up
(a ``getattr``) before it can look up or cache anything inside it, so every
cached name lies in a watched directory.  Watches are added lazily, never by
a scan: mounting stays O(1) in the size of the workspace.  A directory that
appears in a watched one (an outside ``mkdir`` or ``mv``, or our own commit
creating a directory staged in the upper layer) is watched at once when the
kernel knows it, together with its known subdirectories, because the kernel
may have cached their upper-layer versions under long timeouts without ever
asking again.

Events -> actions (:func:`interpret`, pure, unit-tested):

* a change of a name (content, attributes, creation) -> the kernel forgets
  the attributes and pages of the name (and, for namespace changes, its
  directory's attributes);
* a name removed or renamed away (or renamed over) -> also **gone**: the
  kernel keeps a looked-up name bound to its inode until the entry timeout,
  and libfuse3's high-level API cannot drop that entry (only by node id,
  which it keeps to itself).  The FUSE adapter answers the next
  ``getattr`` of a gone path with ``ESTALE`` once, which makes the VFS retry
  the whole lookup with revalidation (``LOOKUP_REVAL``): the kernel asks
  again and drops (or rebinds) the name;
* a directory removed or renamed away -> its watches (and those below it)
  are removed: a watch follows its inode, so it would report the moved
  directory's events under the old name.

Fallbacks: an event queue overflow (``IN_Q_OVERFLOW``, events lost) makes
the kernel forget every watched directory and its current entries, and
the mount return to short timeouts; running out of watches
(``ENOSPC`` from ``inotify_add_watch``, see
``/proc/sys/fs/inotify/max_user_watches``) returns the mount to short
timeouts too (existing watches keep working, so names cached under long
timeouts stay covered).  Each is logged once.

Threading: :meth:`Watcher.watch` runs on the FUSE loop thread; events are
read and acted on by the watcher's own thread, which never takes the view's
lock and is the only caller of the invalidation callback here (the kernel
may have to wait for the FUSE loop to finish a request; the loop never
waits for this thread).  ``self._lock`` guards the two watch tables and is
never held across a callback.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import select
import struct
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterable

log = logging.getLogger("stepfs.watch")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.inotify_init1.argtypes = [ctypes.c_int]
_libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
_libc.inotify_rm_watch.argtypes = [ctypes.c_int, ctypes.c_int]

IN_MODIFY = 0x00000002
IN_ATTRIB = 0x00000004
IN_CLOSE_WRITE = 0x00000008
IN_MOVED_FROM = 0x00000040
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_DELETE = 0x00000200
IN_DELETE_SELF = 0x00000400
IN_MOVE_SELF = 0x00000800
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000
IN_ONLYDIR = 0x01000000
IN_EXCL_UNLINK = 0x04000000
IN_ISDIR = 0x40000000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC

#: What a watched directory reports: every change of an entry's content,
#: attributes or name, and its own removal.  (No IN_ACCESS/IN_OPEN: the
#: daemon's own reads of workspace files would wake the watcher.)
MASK = (IN_MODIFY | IN_ATTRIB | IN_CLOSE_WRITE | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE
        | IN_DELETE_SELF | IN_MOVE_SELF | IN_ONLYDIR | IN_EXCL_UNLINK)
# (No IN_DONT_FOLLOW: the path is /proc/self/fd/N, a magic link to the
# directory already opened beneath the workspace, which must be followed.)
_NAMESPACE = IN_CREATE | IN_DELETE | IN_MOVED_FROM | IN_MOVED_TO
_HEADER = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len (then the name)
#: Gone paths are kept until used; past this many (outside tools churning
#: through temp files in watched directories) the oldest are dropped.
GONE_LIMIT = 100_000
STORE_NAME = ".stepfs"


def parse(buf: bytes) -> list[tuple[int, int, bytes]]:
    """``[(wd, mask, name)]`` from what ``read(2)`` returned on an inotify fd
    (names without their NUL padding)."""
    out = []
    pos = 0
    while pos + _HEADER.size <= len(buf):
        wd, mask, _cookie, length = _HEADER.unpack_from(buf, pos)
        pos += _HEADER.size
        name = buf[pos:pos + length].rstrip(b"\0")
        pos += length
        out.append((wd, mask, name))
    return out


def child(parent: str, name: bytes) -> str:
    """The view path of ``name`` (bytes from the kernel) in ``parent``."""
    return ("" if parent == "/" else parent) + "/" + os.fsdecode(name)


@dataclass
class Changes:
    """What a batch of events asks for (see the module docstring)."""

    invalidate: set[str] = field(default_factory=set)  # forget attributes and pages
    gone: set[str] = field(default_factory=set)  # bound to a removed inode: ESTALE once
    replaced: set[str] = field(default_factory=set)  # renamed over: gone if the kernel knows it
    new_dirs: set[str] = field(default_factory=set)  # appeared: watch it (and below) if known
    lost_dirs: set[str] = field(default_factory=set)  # removed or moved away: drop its watches
    dead_wds: set[int] = field(default_factory=set)  # the kernel dropped these watches
    overflow: bool = False


def interpret(events: Iterable[tuple[int, int, bytes]], dir_of: Callable[[int], str | None]) -> Changes:
    """Map inotify events to :class:`Changes`; ``dir_of(wd)`` is the view
    path of a watched directory (None: no longer watched, event ignored)."""
    out = Changes()
    for wd, mask, name in events:
        if mask & IN_Q_OVERFLOW:
            out.overflow = True
            continue
        if mask & IN_IGNORED:
            out.dead_wds.add(wd)
            continue
        parent = dir_of(wd)
        if parent is None:
            continue
        if not name:  # the watched directory itself
            if mask & (IN_DELETE_SELF | IN_MOVE_SELF):
                if parent != "/":
                    out.lost_dirs.add(parent)
            else:
                out.invalidate.add(parent)
            continue
        if parent == "/" and name == STORE_NAME.encode():
            continue  # the store: never part of the view
        path = child(parent, name)
        out.invalidate.add(path)
        if mask & _NAMESPACE:
            out.invalidate.add(parent)  # its mtime, size and link count changed
        if mask & (IN_DELETE | IN_MOVED_FROM):
            out.gone.add(path)
            if mask & IN_ISDIR:
                out.lost_dirs.add(path)
        elif mask & IN_MOVED_TO:
            out.replaced.add(path)
            if mask & IN_ISDIR:
                out.new_dirs.add(path)
        elif mask & IN_CREATE and mask & IN_ISDIR:
            out.new_dirs.add(path)
    return out


def _under(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


class Watcher:
    """inotify watches on the workspace directories one mount has shown.

    ``root``: the workspace's :class:`store.contained.Root` (directories are
    opened beneath it, never through a symlink, and watched through
    ``/proc/self/fd``).  ``kernel``: a :class:`overlayfs.daemon.libfuse.notify.KernelCache`
    (``forget(path) -> bool`` makes the kernel forget a view path's
    attributes and pages, True when it knew the path; ``gone`` is the set of
    gone paths the FUSE adapter consumes).  ``fallback()``: return the mount
    to short timeouts (called once, from any thread).
    """

    def __init__(self, root, kernel, fallback: Callable[[], None], own: set[str] | None = None,
                 quiet: threading.Event | None = None, ignore: Callable[[str], bool] | None = None,
                 removed: Callable[[set[str]], None] | None = None):
        self.root = root
        # Told of each batch's names removed, renamed away or replaced (a
        # kept directory descriptor there or below is stale: core/dirhandles.py).
        self._removed = removed
        # Unversioned directories are never watched (unversioned.Rules):
        # inotify on a tree an installer fills costs as much as the
        # installer's own work, and what changes there is not versioned.
        self._ignore = ignore
        # Set except while the mount commits: events are handled once it is
        # (waiting holds no lock, so the commit never waits for this thread).
        self._quiet = quiet
        # Paths the mount's own last commit replaced: their names stay bound
        # to the same view inodes, so their events only invalidate.
        self._own: set[str] = own if own is not None else set()
        self._invalidate = kernel.forget
        self._renew_names = kernel.new_epoch
        self.gone: set[str] = kernel.gone
        self._fallback = fallback
        self._lock = threading.Lock()
        self._wd_of: dict[str, int] = {}
        self._dir_of: dict[int, str] = {}
        self.degraded: str | None = None  # why the mount went back to short timeouts
        self._fd = -1
        self._wake_r = self._wake_w = -1
        self._thread: threading.Thread | None = None

    # -- lifecycle ------------------------------------------------------------

    def start(self) -> None:
        fd = _libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            self._degrade(f"inotify is unavailable ({os.strerror(err)})")
            return
        self._fd = fd
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self.watch("/")
        self._thread = threading.Thread(target=self._run, name="stepfs-watch", daemon=True)
        self._thread.start()

    def stop(self, wait: float = 10.0) -> None:
        """Stop the thread and close every descriptor (idempotent).  A
        thread still busy after ``wait`` seconds (an invalidation the kernel
        holds until the unmount) keeps its descriptors: closing them under
        it could hand their numbers to another file."""
        if self._thread is not None:
            os.write(self._wake_w, b"x")
            self._thread.join(wait)
            if self._thread.is_alive():
                log.warning("the watcher thread did not stop within %.0f s; its descriptors stay open", wait)
                return
            self._thread = None
        for fd in (self._fd, self._wake_r, self._wake_w):
            if fd >= 0:
                os.close(fd)
        self._fd = self._wake_r = self._wake_w = -1
        with self._lock:
            self._wd_of.clear()
            self._dir_of.clear()

    @property
    def active(self) -> bool:
        return self._fd >= 0 and self.degraded is None

    def watching(self, path: str) -> bool:
        return path in self._wd_of

    # -- watches ----------------------------------------------------------------

    def watch(self, path: str) -> None:
        """Watch the workspace directory behind view path ``path`` (a no-op
        when watched already, when out of watches, or when the workspace has
        no directory there: an upper-layer-only directory, the ``.stepfs``
        tree)."""
        if path in self._wd_of or self._fd < 0 or self.degraded:
            return
        if self._ignore is not None and self._ignore(path):
            return
        try:
            dfd = self.root.open(path, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            return
        try:
            wd, err = self._add_watch(f"/proc/self/fd/{dfd}".encode())
        finally:
            os.close(dfd)
        if wd < 0:
            if err in (errno.ENOSPC, errno.ENOMEM):
                self._degrade("the inotify watch limit is reached (fs.inotify.max_user_watches)")
            elif err != errno.ENOENT:
                log.warning("cannot watch %r: %s", path, os.strerror(err))
            return
        with self._lock:
            old = self._dir_of.get(wd)  # the same directory under an older name
            if old is not None and old != path:
                self._wd_of.pop(old, None)
            self._dir_of[wd] = path
            self._wd_of[path] = wd

    def _add_watch(self, path: bytes) -> tuple[int, int]:
        """``(wd or -1, errno)`` of ``inotify_add_watch``."""
        wd = _libc.inotify_add_watch(self._fd, path, MASK)
        return wd, (ctypes.get_errno() if wd < 0 else 0)

    def _unwatch_below(self, top: str) -> None:
        with self._lock:
            doomed = [(p, wd) for p, wd in self._wd_of.items() if _under(p, top)]
            for p, wd in doomed:
                del self._wd_of[p]
                self._dir_of.pop(wd, None)
        for _p, wd in doomed:
            _libc.inotify_rm_watch(self._fd, wd)  # EINVAL when already gone: fine

    def _degrade(self, reason: str) -> None:
        if self.degraded is None:
            self.degraded = reason
            log.warning("%s: this mount falls back to short attribute and entry timeouts", reason)
            self._fallback()

    # -- events -----------------------------------------------------------------

    def _run(self) -> None:
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        while True:
            ready = {fd for fd, _ev in poller.poll()}
            if self._wake_r in ready:
                return
            if self._quiet is not None:
                self._quiet.wait()
            events = []
            while True:
                try:
                    buf = os.read(self._fd, 64 * 1024)
                except BlockingIOError:
                    break
                except InterruptedError:
                    continue
                events += parse(buf)
            try:
                self.apply(interpret(events, self._dir_of.get))
            except Exception:  # one bad batch must not end the watching
                log.exception("handling %d workspace events failed", len(events))

    def apply(self, ch: Changes) -> None:
        """Act on one batch (watcher thread).  Gone paths are recorded before
        the kernel is told to forget them, so its next question finds them."""
        for wd in ch.dead_wds:
            with self._lock:
                path = self._dir_of.pop(wd, None)
                if path is not None and self._wd_of.get(path) == wd:
                    del self._wd_of[path]
        # A directory removed or renamed away from outside: the kernel keeps
        # the names it held below it (a directory made again at that path
        # is the same node to libfuse, so the kernel's revalidation of the
        # path keeps them all).  Every name is looked up again before its
        # next use; this mount's own commit removed nothing the kernel holds
        # (decided before the loop below consumes the own names).
        renew = any(p not in self._own for p in ch.lost_dirs)
        if self._removed is not None and (ch.gone or ch.replaced or ch.lost_dirs):
            self._removed(ch.gone | ch.replaced | ch.lost_dirs)
        for top in ch.lost_dirs:
            self._unwatch_below(top)
        if len(self.gone) + len(ch.gone) + len(ch.replaced) > GONE_LIMIT:
            self.gone.clear()
        for path in ch.gone | ch.replaced:
            if path in self._own:
                self._own.discard(path)  # our commit's rename: same view inode
            else:
                self.gone.add(path)
        for path in sorted(ch.invalidate):
            known = self._invalidate(path)
            if path in ch.replaced and not known:
                self.gone.discard(path)  # the kernel holds no entry to drop
        if renew:
            self._renew_names()
        for path in sorted(ch.new_dirs):
            self._adopt(path)
        if ch.overflow:
            self._overflowed()

    def _adopt(self, top: str) -> None:
        """Watch a directory that appeared at ``top``, and every directory
        below it that the kernel knows, forgetting what it cached of them."""
        todo = [top]
        while todo:
            path = todo.pop()
            if not self._invalidate(path):
                continue  # the kernel caches nothing there or below
            if self._ignore is not None and self._ignore(path):
                continue  # unversioned: not watched, and not walked (it may hold an installer's 20,000 files)
            self.watch(path)
            for name, kind, _ino in self._list(path):
                sub = child(path, name)
                if kind == 0o040000:
                    todo.append(sub)
                else:
                    self._invalidate(sub)

    def _list(self, path: str) -> list[tuple[bytes, int, int]]:
        try:
            return self.root.listdir(path)
        except OSError:
            return []

    def _overflowed(self) -> None:
        """Events were lost: forget every watched directory and what is in
        it now, and go back to short timeouts (names removed meanwhile stay
        cached at most until their entry timeout)."""
        self._degrade("the inotify event queue overflowed")
        with self._lock:
            dirs = sorted(self._wd_of)
        for path in dirs:
            self._invalidate(path)
            for name, _kind, _ino in self._list(path):
                self._invalidate(child(path, name))
