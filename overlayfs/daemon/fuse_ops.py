"""The FUSE adapter: mfusepy callbacks -> :class:`overlayfs.view.Overlay`.

With ``fuse_main.py`` (the loop), the only module that imports mfusepy.  It translates paths, file
info structs and stat dicts, and maps errors to errno in one table
(:data:`ERRNO`).  No filesystem decision is made here.

Choices (measured or forced, see README "Architecture"):

* libfuse3 through ``FUSE_LIBRARY_NAME=fuse3`` (mfusepy would otherwise pick
  libfuse2 when both exist; libfuse2 drops half-omitted utimens and mangles
  non-UTF-8 names).
* single-threaded loop (``nothreads``): with the GIL a threaded loop was
  slower for metadata work on two cores, and the view is one lock anyway.
* no writeback cache: it would move writes after ``close``, where the
  version-token check lives.
* no ``hard_remove``: with it libfuse answers ESTALE to ``fstat`` of a file
  unlinked while open (the kernel sends no handle); instead libfuse renames
  such a file to ``.fuse_hidden<N>``, which the view keeps out of the
  namespace (``view.HIDDEN_PREFIX``).
* ``use_ino``: inode numbers come from the view (workspace inodes, kept on
  copy-up).
* 60 s attribute and entry timeouts (``timeouts.ENTRY_TIMEOUT``), no negative
  caching.  The kernel's caches are what make repeated metadata work (a
  second ``git status``) cheap; what makes them safe is that nothing changes
  the view unannounced: changes through the mount go through the kernel
  (a change through one name of a workspace hard link that shows in its
  other names renews every name: :meth:`KernelCache.new_epoch`),
  rollback and discard call :meth:`KernelCache.invalidate`, and outside
  edits of the workspace are seen by the inotify :class:`Watcher`
  (``overlayfs/daemon/watch.py``), which invalidates the changed names at once.
  The trade-off: a change whose event was lost stays hidden until the
  timeout, so the timeout is long enough to span the gap between an
  agent's commands (the measured gain) and no longer.  A mount that cannot
  watch (no inotify, ``ENOSPC`` from the watch limit, a queue overflow)
  drops to :data:`SHORT_TIMEOUT` (1 s) for every later reply, by editing
  libfuse's live ``struct fuse_config`` (:meth:`StepFS.short_timeouts`).
* ``keep_cache`` for a read-only open of an untouched workspace file whose
  version token equals that of its previous read-only open
  (:meth:`StepFS._keep_pages`); ``noflush`` for every read-only open (its
  close has nothing to check).
* kernel-cached directory listings while the mount watches
  (:class:`ListingCache`, which works around libfuse 3.14's high-level
  ``opendir``); a warm ``git status`` then sends no READDIR at all.
* A name the kernel holds for a removed or replaced file answers
  ``ESTALE`` once (a GETATTR of it, ``KernelCache.gone``; ``open`` of a
  name that is not there): the VFS then repeats the lookup with
  revalidation.  A LOOKUP always gets the truth (told from a GETATTR by
  :class:`ListingCache`'s ``lookup`` hook).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import struct
import threading

os.environ.setdefault("FUSE_LIBRARY_NAME", "fuse3")

import mfusepy  # noqa: E402  (needs the environment variable above)

from stepfs.store.errors import CorruptObject, PublishFailed, StepfsError, StoreFull, StoreUnavailable  # noqa: E402

from stepfs.overlayfs.core import errors as view_errors  # noqa: E402
from stepfs.overlayfs.core.agents import Agents  # noqa: E402
from stepfs.overlayfs.daemon.closers import Writers  # noqa: E402
from stepfs.overlayfs.daemon.fuse_main import hooked  # noqa: E402
from stepfs.overlayfs.daemon.timeouts import ATTR_TIMEOUT, ENTRY_TIMEOUT, NEGATIVE_TIMEOUT, SHORT_TIMEOUT  # noqa: E402
from stepfs.overlayfs.core.metatree import ROOT as META_ROOT, is_meta  # noqa: E402
from stepfs.overlayfs.core.passthrough import HANDLE_BASE  # noqa: E402
from stepfs.overlayfs.core.view import Overlay  # noqa: E402
from stepfs.overlayfs.daemon.watch import Watcher  # noqa: E402

log = logging.getLogger("stepfs.fuse")
#: Bound of StepFS._page_tokens (cleared when full: only keep_cache is lost).
PAGE_TOKENS_LIMIT = 100_000
#: ``struct fuse_out_header`` of FUSE_NOTIFY_INC_EPOCH (len, code 8, unique 0).
_INC_EPOCH = struct.pack("<IiQ", 16, 8, 0)
#: libfuse's FUSE_CAP_POSIX_ACL (fuse_common.h): see StepFS.init_with_config.
FUSE_CAP_POSIX_ACL = 1 << 19

#: View error class -> errno.  Looked up along the class's MRO, so a more
#: specific class (NameTooLong) wins over its base (Invalid).
ERRNO: dict[type, int] = {
    view_errors.NotFound: errno.ENOENT,
    view_errors.Exists: errno.EEXIST,
    view_errors.NotEmpty: errno.ENOTEMPTY,
    view_errors.NotADirectory: errno.ENOTDIR,
    view_errors.IsADirectory: errno.EISDIR,
    view_errors.ReadOnly: errno.EROFS,
    view_errors.NameTooLong: errno.ENAMETOOLONG,
    view_errors.Invalid: errno.EINVAL,
    # EPERM, not ENOTSUP, for an unsupported operation such as link():
    # tools (cp -a, git) fall back to a copy on EPERM.
    view_errors.Unsupported: errno.EPERM,
    view_errors.BadHandle: errno.EBADF,
    # Creating '.stepfs' at the root: the name exists (hidden) already.
    view_errors.Reserved: errno.EEXIST,
    # The version-token refusals (DESIGN.md semantics 3 and 4).
    view_errors.Stale: errno.ESTALE,
    # --require-read: permission to write is earned by reading first.
    view_errors.NotObserved: errno.EACCES,
    view_errors.NoAttribute: errno.ENODATA,
    view_errors.NotSupported: errno.EOPNOTSUPP,
    # Stored bytes that no longer hash to their key are never served.
    CorruptObject: errno.EIO,
    # SQLITE_FULL: the writer learns the disk is full, as on a local fs.
    StoreFull: errno.ENOSPC,
    StoreUnavailable: errno.EIO,
    PublishFailed: errno.EIO,
}


def errno_for(exc: BaseException) -> int | None:
    for cls in type(exc).__mro__:
        if cls in ERRNO:
            return ERRNO[cls]
    return None


def _translating(method):
    """Wrap an operation: view errors -> FuseOSError(errno), never a bare EIO
    without a log line."""

    def wrapper(self, *args):
        try:
            return method(self, *args)
        except mfusepy.FuseOSError:
            raise
        except (view_errors.ViewError, StepfsError) as exc:
            code = errno_for(exc)
            if code is None or code == errno.EIO:
                log.error("%s%r failed: %s", method.__name__, args[:1], exc)
            raise mfusepy.FuseOSError(code or errno.EIO) from None
        except OSError as exc:
            raise mfusepy.FuseOSError(exc.errno or errno.EIO) from None
        except Exception:
            log.exception("%s%r failed unexpectedly", method.__name__, args[:1])
            raise mfusepy.FuseOSError(errno.EIO) from None

    wrapper.__name__ = method.__name__
    return wrapper


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
    the session down (``fuse_main.py``): it also waits for the calls in
    flight, so none runs on any thread once teardown starts.

    Names (dentries) cannot be invalidated this way (libfuse3 3.14 offers
    that only by node id, which the high-level API keeps to itself), so a
    name whose file was removed or replaced is put in :attr:`gone` before
    its attributes are dropped: the next GETATTR of it (the kernel's
    question once the attributes are gone) answers ``ESTALE`` once, and the
    VFS retries the lookup with revalidation, which drops or rebinds the
    name (a kind change, file -> directory, included).  ``gone`` is a plain
    set: added to by the control and watcher threads, consumed by the loop.

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

    def attach(self) -> None:
        """Record the running ``struct fuse *`` (from inside a callback)."""
        lib = mfusepy._libfuse
        self._fuse = lib.fuse_get_context().contents.fuse
        self._dev_fd = lib.fuse_session_fd(lib.fuse_get_session(self._fuse))

    def detach(self, wait: float = 10.0) -> bool:
        """The session is ending: close the gate (later calls do nothing),
        then wait at most ``wait`` seconds for the libfuse calls in flight;
        False when one is still running (the kernel holds it until the
        unmount aborts the connection: it has walked the node table
        already, and only waits in its write).  On the loop thread: after
        the loop returned (``fuse_main``), and again from ``destroy``."""
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

    def forget(self, path: str) -> bool:
        """Invalidate one view path; True when the kernel had it cached."""
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
        return sum(1 for path in paths if self.forget(path))



#: ``struct fuse_lowlevel_ops`` of libfuse 3.x (fuse_lowlevel.h), in order;
#: the high-level API's table (``fuse_path_ops``) leaves ``write`` and
#: ``retrieve_reply`` NULL, which :class:`ListingCache` uses as a fingerprint.
_LL_OPS = ("init", "destroy", "lookup", "forget", "getattr", "setattr", "readlink", "mknod", "mkdir", "unlink",
           "rmdir", "symlink", "rename", "link", "open", "read", "write", "flush", "release", "fsync", "opendir",
           "readdir", "releasedir", "fsyncdir", "statfs", "setxattr", "getxattr", "listxattr", "removexattr",
           "access", "create", "getlk", "setlk", "bmap", "ioctl", "poll", "write_buf", "retrieve_reply",
           "forget_multi", "flock", "fallocate", "readdirplus", "copy_file_range", "lseek")
#: Offset of ``op`` in libfuse 3.12-3.15's private ``struct fuse_session``
#: (lib/fuse_i.h: ``char *mountpoint; volatile int exited; int fd; struct
#: fuse_custom_io *io; struct mount_opts *mo; int debug; int deny_others;``).
_SE_OP_OFFSET = 40
_SE_FD_OFFSET = 12
_FI_P = ctypes.POINTER(mfusepy.fuse_file_info)
_LL_OPENDIR = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_uint64, _FI_P)
_LL_READDIR = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int64, _FI_P)
_LL_LOOKUP = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_char_p)


def _libfuse_text() -> list[tuple[int, int]]:
    """Address ranges of libfuse3's executable code in this process."""
    out = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and "x" in fields[1] and "libfuse3.so" in fields[5]:
                lo, hi = fields[0].split("-")
                out.append((int(lo, 16), int(hi, 16)))
    return out


class ListingCache:
    """Lets the kernel cache directory listings (``FOPEN_CACHE_DIR`` with
    ``FOPEN_KEEP_CACHE`` on an opendir reply), which libfuse 3.14's
    high-level API cannot ask for: its ``fuse_lib_opendir`` hands the
    filesystem a private ``fuse_file_info`` and replies with its own, copying
    only ``fh`` (3.16 copies ``cache_readdir`` and ``keep_cache`` too).

    So the session's low-level ``opendir`` entry is wrapped: the wrapper
    sets both flags on the reply's ``fuse_file_info``, then calls libfuse's
    own ``opendir`` (which leaves them alone).  The wrapper sees a node id,
    not a path; the directories that must not be cached (``MOUNT/.stepfs``
    and below: generated from the store, they change with no event) are
    learned by node id at their first uncached read, through wrapped
    ``readdir``/``readdirplus`` entries (:attr:`dir_node` names the node
    while ``_FUSE.readdir_fuse_3`` runs).  Caching on that first open is
    harmless: it is filled by fresh reads, and every later open of the node
    goes without ``keep_cache``, which drops it.  Node ids name one node
    until libfuse reuses them after 2**32 others, so :attr:`uncached` is
    never pruned (it holds the ``.stepfs`` directories visited).

    The table is private to libfuse, so it is patched only when its layout
    is proven: libfuse 3.12-3.15 (the versions with this ``struct
    fuse_session`` prefix), the session's ``fd`` field equal to
    ``fuse_session_fd()``, every handler of the high-level table inside
    libfuse's code and exactly ``write`` and ``retrieve_reply`` NULL.
    Otherwise nothing is patched and listings are simply not cached.  The
    loop is single-threaded (``nothreads``), so plain attributes suffice.

    What keeps a cached listing true (the kernel drops it when the
    directory's mtime or change counter moved, or its pages are
    invalidated): changes through the mount bump the directory's counter in
    the kernel; outside edits reach :class:`KernelCache.invalidate` of the
    parent directory through the watcher; rollback and discard invalidate
    every ancestor of what they changed (``daemon.py``).  A change whose
    event was lost stays hidden no longer than a name would: at the start
    of a listing the kernel refreshes the directory's expired attributes
    (libfuse asks for ``auto_inval_data``) and drops the cached listing when
    its mtime moved.  Nothing is cached once the mount cannot watch (:attr:`enabled` cleared by
    :meth:`StepFS.short_timeouts`): an opendir without ``keep_cache`` drops
    the directory's cached listing."""

    def __init__(self) -> None:
        self.enabled = False  # set by StepFS once installed and watching
        self.dir_node = 0  # node id of the directory whose readdir is in flight
        self.uncached: set[int] = set()  # node ids of .stepfs directories
        # A LOOKUP is being answered (the high-level API asks getattr for
        # both LOOKUP and GETATTR): see StepFS.getattr's gone paths.
        self.in_lookup = False
        self.installed = False
        self._slots: list[tuple[ctypes.c_void_p, int]] = []
        self._orig: dict[str, object] = {}
        # C callbacks, kept alive as long as the session.
        self._hooks = {"opendir": _LL_OPENDIR(self._opendir), "readdir": _LL_READDIR(self._reading("readdir")),
                       "readdirplus": _LL_READDIR(self._reading("readdirplus")), "lookup": _LL_LOOKUP(self._lookup)}

    # The wrappers are C callbacks: whatever happens, libfuse's own handler
    # must run, or the request would never be answered.
    def _opendir(self, req, ino, llfi):
        try:
            if self.enabled and ino not in self.uncached:
                fi = llfi.contents
                fi.cache_readdir = 1
                fi.keep_cache = 1
        finally:
            self._orig["opendir"](req, ino, llfi)

    def _lookup(self, req, parent, name):
        self.in_lookup = True
        try:
            self._orig["lookup"](req, parent, name)
        finally:
            self.in_lookup = False

    def _reading(self, op: str):
        """The wrapper of libfuse's ``readdir`` or ``readdirplus``: names
        the directory (:attr:`dir_node`) while libfuse's handler runs."""
        def wrapper(req, ino, size, off, llfi):
            self.dir_node = ino
            try:
                self._orig[op](req, ino, size, off, llfi)
            finally:
                self.dir_node = 0
        return wrapper

    def install(self, fuse: int) -> bool:
        """Wrap the session's low-level ``opendir``, ``readdir`` and
        ``readdirplus`` (from ``init``, on the loop thread, before any of
        them can arrive); returns whether listings can now be cached."""
        if not (mfusepy.fuse_version_major == 3 and 12 <= mfusepy.fuse_version_minor <= 15):
            return False
        lib = mfusepy._libfuse
        se = lib.fuse_get_session(fuse)
        if not se:
            return False
        if ctypes.c_int.from_address(se + _SE_FD_OFFSET).value != lib.fuse_session_fd(se):
            log.info("libfuse's session layout is not the known one: directory listings are not cached")
            return False
        ops = (ctypes.c_void_p * len(_LL_OPS)).from_address(se + _SE_OP_OFFSET)
        text = _libfuse_text()
        for i, name in enumerate(_LL_OPS):
            addr = ops[i] or 0
            if name in ("getlk", "setlk"):
                continue  # NULL unless the filesystem has a lock handler
            if (addr == 0) != (name in ("write", "retrieve_reply")) or (
                    addr and not any(lo <= addr < hi for lo, hi in text)):
                log.info("libfuse's low-level table is not the known one: directory listings are not cached")
                return False
        size = ctypes.sizeof(ctypes.c_void_p)
        for name, hook in self._hooks.items():
            i = _LL_OPS.index(name)
            self._orig[name] = type(hook)(ops[i])
            slot = ctypes.c_void_p.from_address(se + _SE_OP_OFFSET + i * size)
            self._slots.append((slot, ops[i]))
            slot.value = ctypes.cast(hook, ctypes.c_void_p).value
        self.installed = True
        return True

    def uninstall(self) -> None:
        """Put libfuse's own handlers back (from ``destroy``)."""
        self.enabled = self.in_lookup = self.installed = False
        for slot, addr in self._slots:
            slot.value = addr
        self._slots.clear()


def _owner() -> tuple[int, int]:
    uid, gid, _pid = mfusepy.fuse_get_context()
    return uid, gid


def _caller() -> tuple[int, frozenset[int]]:
    """The uid and groups (primary and supplementary) of the process making
    the current request: what ``.stepfs/status`` may show it."""
    uid, gid, pid = mfusepy.fuse_get_context()
    groups = {gid}
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Groups:"):
                    groups.update(int(g) for g in line.split()[1:])
                    break
    except (OSError, ValueError):
        pass  # the process is gone: its primary group only
    return uid, frozenset(groups)


class StepFS(mfusepy.Operations):
    """Callbacks for mfusepy (``raw_fi=True``: file ops get ``fuse_file_info``)."""

    use_ns = True

    def __init__(self, view: Overlay, on_ready=None, kernel_cache: KernelCache | None = None,
                 watcher: Watcher | None = None):
        self.view = view
        view.meta.caller = _caller  # status lists only what the reader may list
        self.on_ready = on_ready
        self.agents = Agents(view.default_agent)
        # Who wrote through each handle: decides which FLUSH publishes (closers.py).
        self.writers = Writers(view.mountpoint)
        self.kernel_cache = kernel_cache
        # Hot-path shortcuts: the gone set (empty almost always) and the
        # watcher's "watch this directory" (None: nothing to watch).
        self._gone = kernel_cache.gone if kernel_cache is not None else set()
        self.watcher = watcher
        self._watch = watcher.watch if watcher is not None else None
        # Paths whose attributes the kernel was given (a lookup or a getattr
        # by name): a READDIRPLUS listing sends these without attributes
        # rather than stat them again (git status lists directories after
        # stat'ing every file).  A stale member only costs one lookup.
        self._held: set[str] = set()
        self._config = None
        # path -> version token of the workspace file whose pages the kernel
        # holds from the last read-only open (see open).
        self._page_tokens: dict[str, str] = {}
        # Kernel-cached directory listings (ListingCache; off until init
        # proves libfuse's layout, and off for good once the mount cannot
        # watch: short_timeouts).
        self.listings = ListingCache()

    def invalidate(self, path: str) -> None:
        """Drop the kernel's cached attributes and pages of another name of
        a hard-linked file, from inside a request.  libfuse's high-level API
        gives every name its own kernel inode, so a change through one name
        must be announced for the others.  Safe on the loop thread because
        opens of linked files are direct_io: no page of theirs is locked by
        a read waiting for this loop (see KernelCache for the general rule)."""
        if self.kernel_cache is not None:
            self.kernel_cache.invalidate([path])

    def _caller(self) -> int:
        """The calling thread's id (the FUSE request's pid; 0: unknown)."""
        return mfusepy.fuse_get_context()[2]

    def _agent(self) -> str:
        """The calling process's agent (pid from the FUSE request)."""
        return self.agents.of(mfusepy.fuse_get_context()[2])

    def init_with_config(self, conn, config):
        """libfuse's ``init``: ``config`` is the live ``struct fuse_config``
        (its timeouts are read at every reply), kept for :meth:`short_timeouts`.

        ``FUSE_CAP_POSIX_ACL`` is asked for because without it the kernel
        caches no POSIX ACL of a FUSE file and sends every
        ``getxattr(system.posix_acl_*)`` here: ``ls -l`` asks that of every
        file it lists, half of a warm ``ls -lR``'s requests.  With it the
        kernel asks once per inode and keeps the answer, which is always
        "none" (the view holds ``user.*`` attributes only, and refuses to
        set others), so nothing cached can go stale; access checks stay
        the kernel's mode checks (``default_permissions``, which the flag
        implies anyway)."""
        self._config = config
        # The hooks go in whenever libfuse's layout is proven (lookup's is
        # used by getattr); listings are cached only while outside edits
        # are seen (watcher).
        if self.kernel_cache is not None and config is not None:
            installed = self.listings.install(mfusepy._libfuse.fuse_get_context().contents.fuse)
            self.listings.enabled = installed and self.watcher is not None and config.entry_timeout > SHORT_TIMEOUT
            self.kernel_cache.listings_cached = self.listings.enabled
        if conn is not None and conn.capable & FUSE_CAP_POSIX_ACL:
            conn.want |= FUSE_CAP_POSIX_ACL
        if self.kernel_cache is not None:
            self.kernel_cache.attach()
            self.view.renew_names = self.kernel_cache.new_epoch
        self.view.invalidate = self.invalidate
        if self.watcher is not None:
            self.watcher.start()
        if self.on_ready is not None:
            self.on_ready()

    def short_timeouts(self) -> None:
        """Fall back to :data:`SHORT_TIMEOUT` for every later reply (outside
        edits can no longer be seen as they happen; any thread)."""
        self.listings.enabled = False  # the next opendir of each directory drops its cached listing
        if self.kernel_cache is not None:
            self.kernel_cache.listings_cached = False
        config = self._config  # None once the teardown began
        if config is not None:
            config.entry_timeout = SHORT_TIMEOUT
            config.attr_timeout = SHORT_TIMEOUT

    def teardown(self) -> None:
        """The loop has returned; libfuse has torn nothing down yet
        (``fuse_main``): from here on no thread calls into libfuse or
        touches its structures.  The gate first, so that a watcher busy
        with invalidations stops at once; then the watcher itself.
        Idempotent (``destroy`` repeats it, for libfuse before 3.12)."""
        self.listings.uninstall()
        self._config = None  # freed by fuse_destroy; short_timeouts may run on the watcher
        if self.kernel_cache is not None:
            self.kernel_cache.detach()
        if self.watcher is not None:
            self.watcher.stop()

    def destroy(self, path):
        self.teardown()
        self.view.close()

    @_translating
    def getattr(self, path, fh=None):
        if fh is None and self._gone and path in self._gone:
            # The kernel still binds this name to a file that was removed or
            # replaced: make it look the name up again (KernelCache).  Only
            # in a GETATTR: a LOOKUP gets the truth.  A LOOKUP that
            # revalidates a held name compares the answer's kind itself,
            # and a fresh one (the parent was just dropped, or the kernel
            # never held the name) would fail its system call for good: the
            # VFS retries an ESTALE once per call, and mkdir not at all
            # (issue 18 item 6).
            # Nor for a name the mount itself serves from its upper layer
            # (created or written through it): the kernel's binding is to
            # that, whatever the workspace's file did, and an event about
            # it may arrive after the name was recreated through the mount.
            self._gone.discard(path)
            if not self.listings.in_lookup and self.view.upper.get(path) is None:
                raise mfusepy.FuseOSError(errno.ESTALE)
        out = self.view.getattr(path, fh.fh if fh is not None else None, agent=self._agent)
        if self._watch is not None and out["st_mode"] & 0o170000 == 0o040000:
            self._watch(path)  # before the kernel can cache anything inside it
        if fh is None:
            held = self._held
            if len(held) >= HELD_LIMIT:
                held.clear()
            held.add(path)
        return out

    def listed_attrs(self, path: str, names: list[str]) -> list[dict | None]:
        """:meth:`getattr` of each name in directory ``path`` (None where it
        fails), for a READDIRPLUS reply: the view answers them in one call
        (``Overlay.getattr_listed``), and each answer keeps getattr's
        invariants here (a directory is watched before the kernel holds it;
        the name is held).  The caller leaves out names in :attr:`_gone`
        (they must reach getattr, for their ESTALE) and ``.stepfs``."""
        try:
            attrs = self.view.getattr_listed(path, names, agent=self._agent)
        except Exception:
            log.exception("attributes for the listing of %r failed; the kernel looks its names up", path)
            return [None] * len(names)
        prefix = path if path.endswith("/") else path + "/"
        watch = self._watch
        held = self._held
        if len(held) + len(names) >= HELD_LIMIT:
            held.clear()
        for name, a in zip(names, attrs):
            if a is not None:
                full = prefix + name
                if watch is not None and a["st_mode"] & 0o170000 == 0o040000:
                    watch(full)  # before the kernel can cache anything inside it
                held.add(full)
        return attrs

    @_translating
    def readdir(self, path, fh):
        return [(name, {"st_mode": kind, "st_ino": ino}, 0) for name, kind, ino in self.view.readdir(path)]

    @_translating
    def readdir_entries(self, path):
        """``[(name, S_IFMT bits, inode)]`` for ``_FUSE.readdir_fuse_3``."""
        return self.view.readdir(path)

    @_translating
    def readlink(self, path):
        return self.view.readlink(path)

    @_translating
    def mkdir(self, path, mode):
        self.view.mkdir(path, mode, owner=_owner(), agent=self._agent())

    @_translating
    def rmdir(self, path):
        self.view.rmdir(path, agent=self._agent())

    @_translating
    def unlink(self, path):
        self.view.unlink(path, agent=self._agent())

    @_translating
    def symlink(self, target, source):
        self.view.symlink(target, source, owner=_owner(), agent=self._agent())

    @_translating
    def rename(self, old, new, flags=0):
        self.view.rename(old, new, flags, agent=self._agent())

    @_translating
    def link(self, target, source):
        self.view.link(target, source, agent=self._agent())

    @_translating
    def chmod(self, path, mode):
        self.view.chmod(path, mode)

    @_translating
    def chown(self, path, uid, gid):
        self.view.chown(path, uid, gid)

    @_translating
    def utimens(self, path, times=None):
        self.view.utimens(path, times)

    @_translating
    def truncate(self, path, length, fh=None):
        self._page_tokens.pop(path, None)
        if fh is not None and fh.fh < HANDLE_BASE:
            self.writers.wrote(fh.fh, self._caller())
        self.view.truncate(path, length, fh.fh if fh is not None else None, agent=self._agent())

    @_translating
    def open(self, path, fi):
        try:
            fi.fh = self.view.open(path, fi.flags, agent=self._agent())
            if fi.flags & os.O_TRUNC and fi.fh < HANDLE_BASE:  # (unversioned handles publish nothing)
                self.writers.wrote(fi.fh, self._caller())  # truncating is writing
        except view_errors.NotFound:
            # The kernel sends OPEN only for a name it holds as existing: its
            # entry is stale (removed outside the mount).  ESTALE makes the
            # VFS look the name up again; open(O_CREAT) then creates it.
            raise mfusepy.FuseOSError(errno.ESTALE) from None
        # Generated .stepfs files and named agents' handles bypass the page
        # cache (see content.py: the cache is shared by all agents).
        fi.direct_io = 1 if self.view.handle_direct_io(fi.fh) else 0
        # A read-only handle has nothing to decide at close (content.flush
        # returns at once for it; POSIX locks are the kernel's own here), so
        # the kernel is told not to send FLUSH for it: one request less per
        # close(2) of every file read.
        if fi.flags & (os.O_ACCMODE | os.O_TRUNC) == os.O_RDONLY or fi.fh >= HANDLE_BASE:
            fi.noflush = 1  # (an unversioned file's close has nothing to decide either)
        self._keep_pages(path, fi)
        return 0

    def _keep_pages(self, path: str, fi) -> None:
        """``keep_cache`` for a read-only open of an untouched workspace
        file whose version token is the one of its previous such open: the
        pages the kernel holds are that file's bytes (any change of the
        file changes the token; a write through the mount goes through a
        writable open, which forgets the entry, and discard and rollback
        invalidate the pages themselves)."""
        tok = self.view.handle_workspace_token(fi.fh) if not fi.flags & (os.O_ACCMODE | os.O_TRUNC) else None
        if tok is None:
            self._page_tokens.pop(path, None)
            return
        if self._page_tokens.get(path) == tok:
            fi.keep_cache = 1
        else:
            if len(self._page_tokens) >= PAGE_TOKENS_LIMIT:
                self._page_tokens.clear()
            self._page_tokens[path] = tok

    @_translating
    def create(self, path, mode, fi):
        self._page_tokens.pop(path, None)
        fi.fh = self.view.create(path, mode, fi.flags, owner=_owner(), agent=self._agent())
        if fi.fh < HANDLE_BASE:
            self.writers.wrote(fi.fh, self._caller())  # a created file is a change even if nothing is written
        else:
            fi.noflush = 1  # an unversioned file: its close has nothing to check or publish
        fi.direct_io = 1 if self.view.handle_direct_io(fi.fh) else 0
        return 0

    @_translating
    def read(self, path, size, offset, fi):
        return self.view.read(fi.fh, size, offset)

    @_translating
    def write(self, path, data, offset, fi):
        if fi.fh < HANDLE_BASE:
            self.writers.wrote(fi.fh, self._caller())
        return self.view.write(fi.fh, data, offset)

    @_translating
    def flush(self, path, fi):
        # Every close of any copy of the descriptor sends a FLUSH (forked
        # children, dup, a shell's saved descriptors): only the writer's
        # own last one publishes (closers.py); the others only report the
        # last decision, and the bytes wait for that close or RELEASE.
        fh = fi.fh
        if fh >= HANDLE_BASE:
            return 0  # an unversioned file: nothing to check or publish
        writers_close = self.writers.is_writers_close(fh, self._caller(), lambda: self._handle_ino(path, fh), path)
        self.view.flush(fh, publish=writers_close)
        return 0

    def _handle_ino(self, path, fh: int) -> int | None:
        """The inode number the kernel has for open handle ``fh``."""
        try:
            return self.view.getattr(path, fh, agent=self._agent)["st_ino"]
        except Exception:
            return None

    @_translating
    def fsync(self, path, datasync, fi):
        self.view.fsync(fi.fh, bool(datasync))
        return 0

    @_translating
    def fsyncdir(self, path, datasync, fh):
        # rename + fsync(directory) is how programs make a name durable.
        self.view.sync_rows()
        return 0

    @_translating
    def release(self, path, fi):
        self.writers.forget(fi.fh)
        self.view.release(fi.fh)
        return 0

    @_translating
    def statfs(self, path):
        return self.view.statfs(path)

    @_translating
    def fallocate(self, path, mode, offset, size, fi):
        if fi.fh < HANDLE_BASE:
            self.writers.wrote(fi.fh, self._caller())
        self.view.fallocate(fi.fh, mode, offset, size)
        return 0

    @_translating
    def mknod(self, path, mode, dev):
        self.view.mknod(path, mode, dev, owner=_owner(), agent=self._agent())

    @_translating
    def getxattr(self, path, name, position=0):
        return self.view.getxattr(path, name)

    @_translating
    def listxattr(self, path):
        return self.view.listxattr(path)

    @_translating
    def setxattr(self, path, name, value, options, position=0):
        self.view.setxattr(path, name, value, options)
        return 0

    @_translating
    def removexattr(self, path, name):
        self.view.removexattr(path, name)
        return 0


_STAT_SIZE = ctypes.sizeof(mfusepy.c_stat)
_STAT_KEYS = {"st_mode", "st_ino", "st_nlink", "st_size", "st_uid", "st_gid", "st_atime", "st_mtime", "st_ctime",
              "st_blocks", "st_blksize"}
#: ... and with the device number (every workspace file's attributes carry it).
_STAT_KEYS_RDEV = _STAT_KEYS | {"st_rdev"}
#: The name of ``MOUNT/.stepfs`` in the root's listing.
META_NAME = META_ROOT[1:]
#: Bound of ``StepFS._held`` (cleared when reached: costs lookups, never correctness).
HELD_LIMIT = 200_000
#: libfuse3's ``FUSE_READDIR_PLUS`` (readdir flags) and ``FUSE_FILL_DIR_PLUS`` (filler flags).
FUSE_READDIR_PLUS = 1
FUSE_FILL_DIR_PLUS = 2
#: ``offsetof(struct fuse_direntplus, dirent.name)``: a READDIRPLUS entry
#: takes this plus its name's length, rounded up to 8 bytes.
_DIRENTPLUS_NAME_OFFSET = 128 + 24
#: Bytes of entries put in one READDIRPLUS reply: the kernel asks with a
#: buffer of at least one page (fs/fuse/readdir.c); a smaller reply is
#: fine, the kernel asks again from the last offset.
_RDPLUS_BUDGET = 4096


#: ``struct stat`` of Linux x86-64 and arm64-compatible layouts as one
#: ``struct`` pack: dev, ino, nlink, mode, uid, gid, (pad), rdev, size,
#: blksize, blocks, then atime, mtime and ctime as (sec, nsec), then the
#: reserved tail.  Used only when mfusepy's ``c_stat`` has exactly these
#: offsets (:data:`_STAT_PACKED`); one ``pack_into`` costs about a third
#: of setting the fields one by one through ctypes (0.4 against 1.4 µs,
#: once per lookup and per listed entry).
_STAT_LAYOUT = struct.Struct("=QQQIIIiQqqqqqqqqq")
_STAT_OFFSETS = (("st_dev", 0), ("st_ino", 8), ("st_nlink", 16), ("st_mode", 24), ("st_uid", 28), ("st_gid", 32),
                 ("st_rdev", 40), ("st_size", 48), ("st_blksize", 56), ("st_blocks", 64), ("st_atimespec", 72),
                 ("st_mtimespec", 88), ("st_ctimespec", 104))
_STAT_PACKED = (_STAT_LAYOUT.size <= _STAT_SIZE
                and all(hasattr(mfusepy.c_stat, name) and getattr(mfusepy.c_stat, name).offset == off
                        for name, off in _STAT_OFFSETS))
#: The zeroed bytes after the packed fields (``reserved``).
_STAT_TAIL = _STAT_SIZE - _STAT_LAYOUT.size
#: The layout with the tail as pad bytes, which ``pack_into`` writes as zeros.
_STAT_FULL = struct.Struct(_STAT_LAYOUT.format + f"{max(_STAT_TAIL, 0)}x")


def _fill_stat(st, a: dict) -> None:
    """Set the ``c_stat`` ``st`` from the attribute dict ``a`` (every field
    not in ``a`` zero).  mfusepy's set_st_attrs looks every key up by name
    (about twice the cost); the view's attribute dicts have the eleven
    :data:`_STAT_KEYS`, and st_rdev (tests/test_mount_warm.py keeps it so).

    Which of the two key sets ``a`` has is told by its length and the
    ``KeyError`` of a missing key (comparing the key sets cost a third of
    this function); the reserved tail is zeroed by the pack's pad bytes."""
    n = len(a)
    try:
        if n == 12 and "st_rdev" in a:
            rdev = a["st_rdev"]
        elif n == 11:
            rdev = 0
        else:
            raise KeyError
        if _STAT_PACKED:
            asec, ansec = divmod(a["st_atime"], 1_000_000_000)
            msec, mnsec = divmod(a["st_mtime"], 1_000_000_000)
            csec, cnsec = divmod(a["st_ctime"], 1_000_000_000)
            try:
                _STAT_FULL.pack_into(st, 0, 0, a["st_ino"], a["st_nlink"], a["st_mode"], a["st_uid"], a["st_gid"], 0,
                                     rdev, a["st_size"], a["st_blksize"], a["st_blocks"], asec, ansec, msec, mnsec,
                                     csec, cnsec)
            except struct.error:
                pass  # a value out of its field's range: ctypes below truncates it as it always did
            else:
                return
        mode, ino, nlink, size = a["st_mode"], a["st_ino"], a["st_nlink"], a["st_size"]
        uid, gid, blocks, blksize = a["st_uid"], a["st_gid"], a["st_blocks"], a["st_blksize"]
        atime, mtime, ctime = a["st_atime"], a["st_mtime"], a["st_ctime"]
    except KeyError:  # another key set
        ctypes.memset(ctypes.byref(st), 0, _STAT_SIZE)
        mfusepy.set_st_attrs(st, a, use_ns=True)
        return
    ctypes.memset(ctypes.byref(st), 0, _STAT_SIZE)
    st.st_rdev = rdev
    st.st_mode = mode
    st.st_ino = ino
    st.st_nlink = nlink
    st.st_size = size
    st.st_uid = uid
    st.st_gid = gid
    st.st_blocks = blocks
    st.st_blksize = blksize
    ts = st.st_atimespec
    ts.tv_sec, ts.tv_nsec = divmod(atime, 1_000_000_000)
    ts = st.st_mtimespec
    ts.tv_sec, ts.tv_nsec = divmod(mtime, 1_000_000_000)
    ts = st.st_ctimespec
    ts.tv_sec, ts.tv_nsec = divmod(ctime, 1_000_000_000)


class _FUSE(mfusepy.FUSE):
    """mfusepy's FUSE with rename flags passed through (mfusepy 3.1 drops
    them, which would turn RENAME_NOREPLACE into a silent overwrite), and
    ``getxattr`` answering the names the view never holds without going
    through it (``ls -l`` asks every file for two of them).

    Its ``readdir`` also tells :class:`ListingCache` which directories are
    generated (``MOUNT/.stepfs``) and must not be cached."""

    #: ``(path, offset, entries)``: the rest of a READDIRPLUS listing that
    #: did not fit its reply (see _readdir_plus; loop thread only).
    _rdplus_resume = None

    def rename_fuse_3(self, old, new, flags):
        return self.operations.rename(old.decode(self.encoding, self.errors),
                                      new.decode(self.encoding, self.errors), flags)

    def readdir_fuse_3(self, path, buf, filler, offset, fip, flags):
        # mfusepy builds a dict per entry and sets its fields by name; a
        # listing of a large directory is thousands of these.
        st = mfusepy.c_stat()
        enc, errs = self.encoding, self.errors
        path = path.decode(enc, errs)
        if is_meta(path):  # generated from the store: never cached (ListingCache)
            listings = self.operations.listings
            if listings.dir_node:
                listings.uncached.add(listings.dir_node)
        elif flags & FUSE_READDIR_PLUS:
            return self._readdir_plus(path, buf, filler, st, offset)
        elif offset:
            return self._readdir_on(path, buf, filler, st, offset)
        for name, kind, ino in self.operations.readdir_entries(path):
            st.st_mode = kind
            st.st_ino = ino
            if filler(buf, name.encode(enc, errs), st, 0, 0) != 0:
                break
        return 0

    def _listing(self, path: str, offset: int) -> list:
        """The listing a request at ``offset`` continues: the one kept by
        the previous request of ``path`` if it stopped at ``offset``, else
        read anew.  Entry ``i`` has offset ``i + 1`` in every mode (libfuse
        numbers the list it keeps itself the same way)."""
        resume = self._rdplus_resume
        self._rdplus_resume = None
        if offset and resume is not None and resume[0] == path and resume[1] == offset:
            return resume[2]
        return self.operations.readdir_entries(path)

    def _readdir_on(self, path, buf, filler, st, offset):
        """A plain READDIR at a nonzero offset: libfuse asks the filesystem
        only when it keeps no list of its own, i.e. after a READDIRPLUS
        listing in offset mode (the kernel continues a listing begun with
        attributes without them).  So it continues in offset mode, from the
        listing that READDIRPLUS kept: typically the request after the
        last entry, whose empty reply ends the listing, without reading
        the directory again."""
        enc, errs = self.encoding, self.errors
        entries = self._listing(path, offset)
        i = offset
        n = len(entries)
        while i < n:
            name, kind, ino = entries[i]
            st.st_mode = kind
            st.st_ino = ino
            i += 1
            if filler(buf, name.encode(enc, errs), st, i, 0) != 0:
                self._rdplus_resume = (path, i - 1, entries)  # that entry did not fit: the next request's
                return 0
        self._rdplus_resume = (path, n, entries)
        return 0

    def _readdir_plus(self, path, buf, filler, st, offset):
        """A READDIRPLUS listing: every entry but ``.``/``..`` carries the
        attributes :meth:`StepFS.getattr` answers for its path, with
        ``FUSE_FILL_DIR_PLUS``, so the kernel needs no LOOKUP per entry.

        libfuse 3.14 uses such attributes only in its offset mode (a
        nonzero offset to the filler; with offset 0 it stores the entry
        and replies without attributes), where each request fills one
        reply buffer and the next one resumes at the offset of the last
        entry sent: entry ``i`` of the listing has offset ``i + 1``.  Its
        ``fill_dir_plus`` looks an entry up (nlookup+1) BEFORE it checks
        that the entry fits, and a lookup the kernel never receives is
        never forgotten; so entries are counted against
        :data:`_RDPLUS_BUDGET` here and the filler never sees one that
        does not fit.  The listing is kept for the next request of the same
        directory at the next offset (:meth:`_listing`; one at a time:
        interleaved listings of two directories list again), also after
        its last entry, for the request whose empty reply ends it.

        The attributes of one reply's entries come from one
        ``StepFS.listed_attrs`` call, which keeps ``getattr``'s invariants:
        a directory is watched before the kernel holds it, a name of a
        multi-link workspace file is recorded (``links.Links.shown_name``).
        A name in the kernel-cache ``gone`` set, or whose attributes fail,
        is listed as a plain entry: the kernel then looks it up as before
        (a LOOKUP, which gets the truth and ends the gone mark).  ``MOUNT/.stepfs`` in the root's
        listing too, and a name the kernel was already given attributes
        for (``StepFS._held``): a plain entry leaves the kernel's binding
        as it is, and costs at most a lookup if the kernel dropped it
        since."""
        enc, errs = self.encoding, self.errors
        ops = self.operations
        gone = ops._gone
        held = ops._held
        entries = self._listing(path, offset)
        prefix = path if path.endswith("/") else path + "/"
        budget = _RDPLUS_BUDGET
        i = offset
        n = len(entries)
        batch = []  # (bname, kind, ino, name or None: plain)
        ask = []
        # The one name of a listing that is .stepfs (``path`` itself never
        # is: readdir_fuse_3 lists those plainly).
        meta = META_NAME if path == "/" else None
        while i < n:
            name, kind, ino = entries[i]
            bname = name.encode(enc, errs)
            need = (_DIRENTPLUS_NAME_OFFSET + len(bname) + 7) & ~7
            if need > budget:
                break
            budget -= need
            i += 1
            if name != "." and name != ".." and name != meta:
                full = prefix + name
                if full not in held and not (gone and full in gone):
                    ask.append(name)
                    batch.append((bname, kind, ino, name))
                    continue
            batch.append((bname, kind, ino, None))
        self._rdplus_resume = (path, i, entries)
        attrs = dict(zip(ask, ops.listed_attrs(path, ask))) if ask else {}
        plain = mfusepy.c_stat()  # only its type and inode are ever set: no zeroing per entry
        off = offset
        for bname, kind, ino, name in batch:
            a = attrs.get(name) if name is not None else None
            if a is None:
                plain.st_mode = kind
                plain.st_ino = ino
                out, fill = plain, 0
            else:
                _fill_stat(st, a)
                out, fill = st, FUSE_FILL_DIR_PLUS
            off += 1
            if filler(buf, bname, out, off, fill) != 0:
                self._rdplus_resume = (path, off - 1, entries)
                break  # not expected: the budget keeps every entry within the buffer
        return 0

    def fgetattr(self, path, buf, fip):
        a = self.operations.getattr(None if path is None else path.decode(self.encoding, self.errors),
                                    fip.contents if fip else None)
        _fill_stat(buf.contents, a)
        return 0

    # mfusepy's getattr_fuse_3 only calls fgetattr: registered directly, one
    # Python frame less for every LOOKUP and GETATTR.
    getattr_fuse_3 = fgetattr

    def getxattr(self, path, name, value, size, *args):
        # Only user.* attributes exist in the view (store/xattrs.py); ls -l
        # asks every file for security.selinux and system.posix_acl_access.
        if not name.startswith(b"user."):
            return -errno.ENODATA
        return super().getxattr(path, name, value, size, *args)


def _escape_option(value: str) -> str:
    return value.replace("\\", "\\\\").replace(",", "\\,")


def run(view: Overlay, mountpoint: str, on_ready=None, debug: bool = False,
        kernel_cache: KernelCache | None = None, allow_other: bool = False, watch: bool = True) -> None:
    """Mount and serve until unmounted (blocks).  ``allow_other``: users
    other than the mounter may enter; default_permissions makes the kernel
    check their access against the modes the view reports.  ``watch``: see
    outside edits through inotify and cache for :data:`ENTRY_TIMEOUT`;
    otherwise (or when inotify fails) cache for :data:`SHORT_TIMEOUT` only."""
    extra = {"allow_other": True} if allow_other else {}
    if kernel_cache is None:
        kernel_cache = KernelCache()
    ops = StepFS(view, on_ready, kernel_cache)
    if watch:
        ops.watcher = Watcher(view.root, kernel_cache, ops.short_timeouts, own=view.own_publishes,
                              quiet=view.commit_idle, ignore=view.unversioned.dir_covered)
        ops._watch = ops.watcher.watch
    long_cache = watch
    # The loop, with the teardown hook (fuse_main.py): no libfuse call on
    # any thread once libfuse starts tearing the session down.
    with hooked(ops.teardown):
        _FUSE(
            ops,
            mountpoint,
            raw_fi=True,
            foreground=True,
            nothreads=True,
            debug=debug,
            fsname=_escape_option("stepfs:" + view.ws.path),
            subtype="stepfs",
            default_permissions=True,
            use_ino=True,
            attr_timeout=ATTR_TIMEOUT if long_cache else SHORT_TIMEOUT,
            entry_timeout=ENTRY_TIMEOUT if long_cache else SHORT_TIMEOUT,
            negative_timeout=NEGATIVE_TIMEOUT,
            **extra,
        )
