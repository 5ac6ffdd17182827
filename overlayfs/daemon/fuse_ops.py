"""The FUSE adapter: mfusepy callbacks -> :class:`overlayfs.view.Overlay`.

With the ``libfuse`` package (what the high-level API lacks, behind
version checks), the only module that imports mfusepy.  It translates paths, file
info structs and stat dicts, and maps errors to errno in one table
(:data:`ERRNO`).  No filesystem decision is made here.

Choices (measured or forced, see README "Architecture"):

* libfuse3 through ``FUSE_LIBRARY_NAME=fuse3`` (mfusepy would otherwise pick
  libfuse2 when both exist; libfuse2 drops half-omitted utimens and mangles
  non-UTF-8 names).
* single-threaded loop (``nothreads``): with the GIL a threaded loop was
  slower for metadata work on two cores, and the view is one lock anyway.
  The loop polls for the next request a little before it sleeps
  (``libfuse/spin.py``): where an idle vCPU halts, waking it cost more
  than most handlers, twice per round trip.
* no writeback cache: it would move writes after ``close``, where the
  version-token check lives.
* no ``hard_remove``: with it libfuse answers ESTALE to ``fstat`` of a file
  unlinked while open (the kernel sends no handle); instead libfuse renames
  such a file to ``.fuse_hidden<N>``, which the view keeps out of the
  namespace (``view.HIDDEN_PREFIX``).
* ``use_ino``: inode numbers come from the view (workspace inodes, kept on
  copy-up).
* 60 s attribute and entry timeouts (``timeouts.ENTRY_TIMEOUT``), and as
  long for a name found absent when its appearance can be announced
  (:meth:`StepFS._negative`).  The kernel's caches are what make repeated metadata work (a
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
* ``keep_cache`` for a read-only open of the published version of a file
  (untouched, or staged) whose version token equals that of its previous
  read-only open
  (:meth:`StepFS._keep_pages`); ``noflush`` for every read-only open (its
  close has nothing to check).
* READ and WRITE through libfuse's ``read_buf``/``write_buf``
  (``libfuse/bufs.py``): a READ of 128 KiB or more is spliced from the
  file to ``/dev/fuse`` (``FUSE_CAP_SPLICE_WRITE``), a smaller one read
  into libfuse's reply memory, and a WRITE's data written to the draft
  from libfuse's receive buffer, instead of through a Python ``bytes``
  each way.  Requests are not received by splice (``FUSE_CAP_SPLICE_READ``
  off): that costs every small request a second system call.  The
  mount's readahead window is raised to 2 MiB after INIT, cut into READs
  of at most 512 KiB (``max_read``; ``libfuse/readahead.py``): a
  sequential read then takes a quarter of the READs, each still spliced
  (a 1 MiB READ exceeds libfuse's pipe and is copied, which measured
  slower), and the kernel queues four at a time, so the loop finds the
  next READ waiting instead of sleeping once per READ.
* kernel-cached directory listings while the mount watches, on a libfuse
  whose private layout is verified (:class:`ListingCache`, which works
  around libfuse 3.14's high-level ``opendir``); a warm ``git status`` then sends no READDIR at all.
* FLUSH answered before its publish where the result is already known
  to be 0 and nothing left can fail it (``content.Content.flush`` says
  which closes and why it is safe; ``AfterReply`` wraps libfuse's
  low-level ``flush`` entry, on a libfuse whose private layout is
  verified, to run the rest after the reply): ``close(2)`` of a small
  rewrite of a staged file no longer waits for the closers look and the
  publish.  The caller's next request still waits for them, and on a
  busy machine the woken caller competes with that work for the CPU; so
  a created file's first close, the middle of a burst (``tar -x``), is
  not answered first.
  :data:`REPLY_FIRST_ENV` turns it off.
* A name the kernel holds for a removed or replaced file answers
  ``ESTALE`` once (a GETATTR of it, ``KernelCache.gone``; ``open`` of a
  name that is not there): the VFS then repeats the lookup with
  revalidation.  A LOOKUP always gets the truth (told from a GETATTR by
  :class:`ListingCache`'s ``lookup`` hook).
"""

from __future__ import annotations

import errno
import logging
import os

from stepfs.overlayfs.daemon.libfuse import mfusepy  # sets FUSE_LIBRARY_NAME before mfusepy loads libfuse

from stepfs.store.errors import (  # noqa: E402
    CorruptObject,
    PublishFailed,
    StepfsError,
    StoreBusy,
    StoreFull,
    StoreUnavailable,
)

from stepfs.overlayfs.core import errors as view_errors  # noqa: E402
from stepfs.overlayfs.core.agents import Agents  # noqa: E402
from stepfs.overlayfs.daemon.closers import Writers  # noqa: E402
from stepfs.overlayfs.daemon.libfuse.highlevel import _FUSE
from stepfs.overlayfs.daemon.libfuse.loop import hooked
from stepfs.overlayfs.daemon.libfuse.lowlevel import AfterReply, ListingCache
from stepfs.overlayfs.daemon.libfuse.notify import INC_EPOCH_MINOR, KernelCache
from stepfs.overlayfs.daemon.libfuse.readahead import READ_BYTES
from stepfs.overlayfs.daemon.timeouts import ATTR_TIMEOUT, ENTRY_TIMEOUT, NEGATIVE_TIMEOUT, SHORT_TIMEOUT  # noqa: E402
from stepfs.overlayfs.core.passthrough import HANDLE_BASE  # noqa: E402
from stepfs.overlayfs.core.metatree import is_meta  # noqa: E402
from stepfs.overlayfs.core.view import HIDDEN_PREFIX, Overlay  # noqa: E402
from stepfs.overlayfs.daemon.watch import Watcher  # noqa: E402

log = logging.getLogger("stepfs.fuse")
#: Bound of StepFS._page_tokens (cleared when full: only keep_cache is lost).
PAGE_TOKENS_LIMIT = 100_000
#: libfuse's FUSE_CAP_POSIX_ACL (fuse_common.h): see StepFS.init_with_config.
FUSE_CAP_POSIX_ACL = 1 << 19
#: libfuse's FUSE_CAP_SPLICE_WRITE: READ replies go from a file to /dev/fuse by splice.
FUSE_CAP_SPLICE_WRITE = 1 << 7
#: libfuse's FUSE_CAP_SPLICE_READ: requests received through a pipe (turned off: libfuse/bufs.py).
FUSE_CAP_SPLICE_READ = 1 << 9
#: Set to ``0`` to answer every FLUSH only once its work is done (AfterReply
#: not installed): for measuring what answering first gains and costs.
REPLY_FIRST_ENV = "STEPFS_REPLY_FIRST"
#: Bound of ``StepFS._held`` (cleared when reached: costs lookups, never correctness).
HELD_LIMIT = 200_000

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
    # Another process kept the write lock past the busy timeout: transient,
    # and nothing goes read-only for it.
    StoreBusy: errno.EBUSY,
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


def _either_kind() -> bool:
    """``Rules.covers``' kind question for a name that is absent: asked
    only when a directory pattern matches it, which then counts."""
    return True


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
        # libfuse's live ``struct fuse_conn_info`` (init), while READ
        # replies may be spliced (splice_replies).
        self._conn = None
        # path -> version token of the workspace file whose pages the kernel
        # holds from the last read-only open (see open).
        self._page_tokens: dict[str, str] = {}
        # Kernel-cached directory listings (ListingCache; off until init
        # proves libfuse's layout, and off for good once the mount cannot
        # watch: short_timeouts).
        self.listings = ListingCache()
        # Whether LOOKUPs that find nothing may be cached (init, _negative).
        self.negatives = False
        # FLUSH replies sent before the publish they decided (content.flush);
        # a failure after the reply makes the mount read-only.
        self.replies = AfterReply()
        self.replies.on_failure = lambda exc: self.view.failsafe.trip(f"publishing a closed file failed: {exc}")

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
            fuse = mfusepy._libfuse.fuse_get_context().contents.fuse
            installed = self.listings.install(fuse)
            if installed and os.environ.get(REPLY_FIRST_ENV, "1") != "0":
                self.replies.install(fuse)
            self.listings.config = config
            self.listings.enabled = installed and self.watcher is not None and config.entry_timeout > SHORT_TIMEOUT
            self.kernel_cache.listings_cached = self.listings.enabled
            self.kernel_cache.lookups_told = installed or self.listings.told_by_loop
            # Negative names are cached only where the kernel can expire one
            # alone (FUSE_EXPIRE_ONLY, 7.38) and renew every name
            # (FUSE_NOTIFY_INC_EPOCH, 7.44: a LOOKUP in flight when its name
            # appears; KernelCache._expire_negatives).
            self.negatives = (self.listings.enabled and NEGATIVE_TIMEOUT > 0 and conn is not None
                              and conn.proto_major == 7 and conn.proto_minor >= INC_EPOCH_MINOR)
            self.kernel_cache.negatives_cached = self.negatives
            if self.listings.enabled:
                # Lookups stat names through kept directory descriptors
                # (core/dirhandles.py): only of directories the watcher watches.
                watcher, rules = self.watcher, self.view.unversioned
                self.view.ns.dirs.start(lambda path: watcher.watching(path) and not rules.dir_covered(path),
                                        lambda: rules.generation)
        if conn is not None and conn.capable & FUSE_CAP_POSIX_ACL:
            conn.want |= FUSE_CAP_POSIX_ACL
        if conn is not None and conn.capable & FUSE_CAP_SPLICE_WRITE:
            self._conn = conn  # splice_replies turns READ replies by splice on and off
        if conn is not None:
            # libfuse asks for this by itself because write_buf exists; it
            # costs every request a splice and a read (libfuse/bufs.py).
            conn.want &= ~FUSE_CAP_SPLICE_READ
            # The mount's max_read option (run); libfuse 3.14 refuses an init that differs.
            conn.max_read = READ_BYTES
        if self.kernel_cache is not None:
            self.kernel_cache.attach()
            self.view.renew_names = self.kernel_cache.new_epoch
        self.view.invalidate = self.invalidate
        if self.watcher is not None:
            self.watcher.start()
        if self.on_ready is not None:
            self.on_ready()

    def splice_replies(self, on: bool) -> None:
        """Let libfuse send the next READ replies by splice (``on``) or by
        ``writev``.  libfuse 3.14 splices every reply of two pages or more
        while ``FUSE_CAP_SPLICE_WRITE`` is wanted, one in memory too (a
        ``vmsplice`` into a pipe, then a ``splice``: more system calls than
        one ``writev``), and reads ``conn.want`` at each reply; so the bit
        is set only while READs are answered from a descriptor
        (``_FUSE.read_buf`` calls this when that changes; loop thread)."""
        conn = self._conn
        if conn is not None:
            if on:
                conn.want |= FUSE_CAP_SPLICE_WRITE
            else:
                conn.want &= ~FUSE_CAP_SPLICE_WRITE

    def short_timeouts(self) -> None:
        """Fall back to :data:`SHORT_TIMEOUT` for every later reply (outside
        edits can no longer be seen as they happen; any thread)."""
        self.listings.enabled = False  # the next opendir of each directory drops its cached listing
        self.view.ns.dirs.enabled = False  # kept directory descriptors are only as true as the events
        self.negatives = False
        if self.kernel_cache is not None:
            self.kernel_cache.listings_cached = self.kernel_cache.negatives_cached = False
            self.kernel_cache.expire_negatives()
        config = self._config  # None once the teardown began
        if config is not None:
            config.entry_timeout = SHORT_TIMEOUT
            config.attr_timeout = SHORT_TIMEOUT

    def teardown(self) -> None:
        """The loop has returned; libfuse has torn nothing down yet
        (``libfuse.loop``): from here on no thread calls into libfuse or
        touches its structures.  The gate first, so that a watcher busy
        with invalidations stops at once; then the watcher itself.
        Idempotent (``destroy`` repeats it, for libfuse before 3.12)."""
        self.listings.uninstall()
        self.replies.uninstall()
        self._config = None  # freed by fuse_destroy; short_timeouts may run on the watcher
        self._conn = None
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
        # Read before the view is asked: a forget meanwhile may be about this name.
        forgets = self.kernel_cache.forgets if self.negatives else 0
        try:
            out = self.view.getattr(path, fh.fh if fh is not None else None, agent=self._agent)
        except Exception as exc:
            if fh is None and self.negatives and self.listings.in_lookup and \
                    (exc.errno if isinstance(exc, OSError) else errno_for(exc)) == errno.ENOENT:
                try:
                    self._negative(path, forgets)
                except Exception:  # the answer stays ENOENT, uncached
                    log.exception("caching the absence of %r failed", path)
            raise
        if self._watch is not None and out["st_mode"] & 0o170000 == 0o040000 and not self.view.made_by_step(path):
            self._watch(path)  # before the kernel can cache anything inside it
        if fh is None:
            held = self._held
            if len(held) >= HELD_LIMIT:
                held.clear()
            held.add(path)
        return out

    def _negative(self, path: str, forgets: int) -> None:
        """The LOOKUP being answered finds no ``path``: let the kernel keep
        that for :data:`NEGATIVE_TIMEOUT` when every way the name can
        appear other than through this mount's kernel expires it
        (``KernelCache.forget``: the watcher, rollback, discard; the
        kernel's own create, link, rename and mkdir replace the name).  Not
        for ``.stepfs`` (generated from the store: layers appear with no
        event), nor in an unversioned tree (the watcher does not watch it,
        and a run's bind mount writes there past this mount), nor once the
        mount stops watching (:attr:`ListingCache.enabled`), nor when a
        forget ran while the view was asked (``forgets``: its event may be
        about this very name)."""
        if not self.listings.enabled or is_meta(path) or path.rpartition("/")[2].startswith(HIDDEN_PREFIX):
            return
        parent = path.rsplit("/", 1)[0] or "/"
        rules = self.view.unversioned
        # Unversioned as a file or as a directory (one question: the
        # directory memo is not filled with every absent name).
        if rules.dir_covered(parent) or rules.covers(path, _either_kind):
            return
        config = self._config
        if config is not None and self.kernel_cache.note_negative(
                path, self.listings.lookup_parent, self.listings.lookup_name, NEGATIVE_TIMEOUT, forgets):
            config.negative_timeout = NEGATIVE_TIMEOUT  # this reply only (ListingCache._lookup)

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

    # The agent of a removal matters only to its own open drafts: asked
    # (a /proc read) only when the view holds drafts (Content.removed).
    @_translating
    def rmdir(self, path):
        self.view.rmdir(path, agent=self._agent)

    @_translating
    def unlink(self, path):
        self.view.unlink(path, agent=self._agent)

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
        """``keep_cache`` for a read-only open of the published version of
        a file (untouched in the workspace, or staged) whose version token
        is the one of its previous such open: the pages the kernel holds
        are that file's bytes (any change of the file changes the token; a
        write through the mount goes through a writable open, which
        forgets the entry, another agent's open of a file in use is direct
        I/O, and discard and rollback invalidate the pages themselves).
        Tools read back what they just wrote (``tar -c`` after ``diff -r``,
        git its objects), so staged files count too."""
        tok = self.view.handle_page_token(fi.fh) if not fi.flags & (os.O_ACCMODE | os.O_TRUNC) else None
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

    # libfuse calls read_buf and write_buf, not read and write, once these
    # exist (their callers in libfuse/highlevel.py say why): same work,
    # with the bytes moved by the kernel and libfuse instead of copied
    # through a Python ``bytes``.
    @_translating
    def read_buf(self, path, fi):
        """A new descriptor of what handle ``fi`` reads, for libfuse to
        splice the reply from (``_FUSE.read_buf`` closes it); None for a
        handle whose bytes are in memory (:meth:`readinto`)."""
        return self.view.read_fd(fi.fh)

    @_translating
    def readinto(self, path, buf, offset, fi):
        """:meth:`read` into ``buf`` (its length the size asked): the count."""
        return self.view.readinto(fi.fh, buf, offset)

    @_translating
    def write(self, path, data, offset, fi):
        if fi.fh < HANDLE_BASE:
            self.writers.wrote(fi.fh, self._caller())
        return self.view.write(fi.fh, data, offset)

    # libfuse's WRITE with its data left in libfuse's buffer
    # (``_FUSE.write_buf`` passes a view of it, valid during the call).
    write_buf = write

    @_translating
    def flush(self, path, fi):
        # Every close of any copy of the descriptor sends a FLUSH (forked
        # children, dup, a shell's saved descriptors): only the writer's
        # own last one publishes (closers.py); the others only report the
        # last decision, and the bytes wait for that close or RELEASE.
        # The look at the writer's descriptors is made only when it
        # matters, maybe after the reply (AfterReply, content.flush):
        # everything it needs from the request is taken now.
        fh = fi.fh
        if fh >= HANDLE_BASE:
            return 0  # an unversioned file: nothing to check or publish
        tid = self._caller()
        who = self.writers.closer(fh, tid)  # (now: the closer may exit once answered)
        if isinstance(who, bool):
            publish = who
        else:
            def publish():
                return self.writers.done(who, lambda: self._handle_ino(path, fh, tid), path)
        replies = self.replies
        self.view.flush(fh, publish=publish, later=replies.later if replies.in_flush else None)
        return 0

    def _handle_ino(self, path, fh: int, tid: int) -> int | None:
        """The inode number the kernel has for open handle ``fh`` (as seen
        by the agent of thread ``tid``)."""
        try:
            return self.view.getattr(path, fh, agent=lambda: self.agents.of(tid))["st_ino"]
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
                              quiet=view.commit_idle, ignore=view.unversioned.dir_covered,
                              removed=view.ns.dirs.changed)
        ops._watch = ops.watcher.watch
    long_cache = watch
    # The loop, with the teardown hook (libfuse/loop.py): no libfuse call on
    # any thread once libfuse starts tearing the session down.
    with hooked(ops.teardown, ops.listings):
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
            negative_timeout=0.0,  # raised for one reply at a time: StepFS._negative
            max_read=READ_BYTES,  # READs that fit libfuse's splice pipe (libfuse/readahead.py)
            **extra,
        )
