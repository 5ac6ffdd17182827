"""The overlay view of one mount: workspace below, open step above (FUSE-free).

This is the whole filesystem logic; ``fuse_ops.py`` only translates calls
and errors.  :class:`Overlay` is a facade: it owns the lock and builds the
collaborators, each of which gets what it works on explicitly:

* ``namespace.py``  lookup precedence, listings, the attributes shown;
* ``changes.py``    namespace and metadata edits of the upper layer;
* ``content.py``    drafts and handles (``drafts.py``: the records), with
  the close's compare-and-swap in ``cas.py``;
* ``versions.py``   version tokens and the agents' observations;
* ``rows.py``       staged rows and when they reach the store;
* ``scratch.py``    the step's scratch files;
* ``links.py``      link counts of multi-link workspace files and the names
  the kernel may hold;
* ``committing.py`` a commit in the store's two phases, and the failsafe;
* ``stepnodes.py``  what a commit, discard or rollback does to the nodes;
* ``metatree.py``   the read-only ``.stepfs`` tree; ``status.py`` its status.

Copy-up: the first open for writing (or truncate) of a workspace file copies
it into a scratch file (sparse-aware, O(size of that file)); the close
after writing stores it as an object -- or, for a big file, hands the
scratch file over as the staged content (``store/refs.py``).  Mounting
reads only the open step's staged rows: O(1) in the size of the workspace.

Threading: every public method takes ``self.lock`` (one re-entrant lock) for
its whole duration, except a commit (``committing.py``), which releases it once
the layer is published and the view's bookkeeping is done, while the store
completes the layer (:attr:`Overlay.settled` is clear meanwhile: writes of
staged rows and reads of history wait for it, still under the lock), and the
row timer's transaction, written with the lock released (``rows.py``).  The
FUSE loop, the control thread (commits), the auto-step thread and the
row-flush timer are the only callers.  Nothing here blocks on another
process.

Caveats: mtime-only changes (``touch`` of an unchanged file) are shown in the
mount but not committed; ownership changes are not staged yet.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from typing import Callable

from stepfs.store import staging
from stepfs.store.errors import StepfsError
from stepfs.store.tokens import ABSENT
from stepfs.store.workspace import Workspace

from stepfs.store import xattrs as xattr_codec

from stepfs.overlayfs.core.agents import DEFAULT
from stepfs.overlayfs.core.crossing import move_to_unversioned
from stepfs.overlayfs.core.committing import Commits, Failsafe, ViewCommit
from stepfs.overlayfs.core.changes import HIDDEN_PREFIX, RENAME_EXCHANGE, RENAME_NOREPLACE, UTIME_NOW, UTIME_OMIT, Changes
from stepfs.overlayfs.core.content import Content
from stepfs.overlayfs.core.errors import Invalid, NameTooLong, NoAttribute, NotFound, ViewError
from stepfs.overlayfs.core.links import Links
from stepfs.overlayfs.core.namespace import Namespace, check_new_name
from stepfs.overlayfs.core.passthrough import HANDLE_BASE, Passthrough
from stepfs.overlayfs.core.unversioned import Rules, ignore_reader
from stepfs.overlayfs.core.metatree import ROOT as META_ROOT, MetaTree, is_meta
from stepfs.overlayfs.core.rows import StagedRows
from stepfs.overlayfs.core.runs import Runs
from stepfs.overlayfs.core.status import status_text
from stepfs.overlayfs.core.stepnodes import StepNodes
from stepfs.overlayfs.core.scratch import ScratchFiles
from stepfs.overlayfs.core.upper import Node, Upper, rel, view_path
from stepfs.overlayfs.core.versions import Versions

log = logging.getLogger("stepfs.view")

__all__ = ["HIDDEN_PREFIX", "RENAME_EXCHANGE", "RENAME_NOREPLACE", "Overlay"]


class Overlay:
    """The merged view of ``ws`` for the open step of ``mountpoint``."""

    UTIME_NOW, UTIME_OMIT = UTIME_NOW, UTIME_OMIT  # as utimens takes them

    def __init__(self, ws: Workspace, mountpoint: str, agent: str = "", require_read: bool = False,
                 row_delay: float | None = 0.0, excludes: list[str] = (), default_excludes: bool = True):
        """``row_delay``: seconds before recorded staged rows are written by a
        timer (the daemon passes :data:`ROW_DELAY`); 0, the default, writes
        each change at once; None leaves them to the other flush points
        (tests that decide when the store is written).  ``excludes`` and
        ``default_excludes``: the unversioned paths (``unversioned.py``)."""
        self.ws = ws
        self.root = ws.root
        self.mountpoint = mountpoint
        self.agent = agent
        self.default_agent = DEFAULT
        self.row_delay = row_delay
        self.lock = threading.RLock()
        #: Commands started here by 'stepfs run' / 'stepfs confine', and their confinement.
        self.runs = Runs()
        #: Warnings for ``MOUNT/.stepfs/status`` (the store over the size
        #: the user set: ``overlayfs/daemon/retention.py``).
        self.warnings: list[str] = []
        # Set by an auto-step policy (overlayfs/autostep.py): told of every
        # staged change, under the lock; must not block.
        self.on_change = None
        # Set by the FUSE adapter: drop the kernel's caches of a path.
        self.invalidate = lambda path: None
        # Set by the FUSE adapter: make the kernel look every name up again
        # before it uses the attributes it holds (KernelCache.new_epoch).
        self.renew_names = lambda: None
        with ws.db.write() as conn:
            self.step = staging.open_step(conn, mountpoint, agent)
        with ws.db.read() as conn:
            rows = staging.load(conn, self.step)
        # Failsafe: a store that cannot write makes this view read-only.
        self.failsafe = Failsafe(mountpoint)
        ws.db.on_failure.append(self._store_failed)
        self.commits = Commits(ws, self.step, agent, mountpoint, self.lock, self.failsafe)
        self._await_settled = self.commits.await_settled
        # The collaborators (each module says what it holds).  Late-bound
        # lambdas: the adapter and tests replace the callbacks above later.
        self.links = Links(lambda: self.renew_names(), lambda path: self.invalidate(path))
        self.upper = Upper()
        self.ns = Namespace(self.root, self.upper, self.links)
        self.versions = Versions(self.ns)
        self.scratch = ScratchFiles(ws.store_dir, self.step, {row.scratch for row in rows if row.scratch is not None},
                                    self.upper, ws.db, ws.objects, lambda path: self.content.release_scratch(path))
        self.rows = StagedRows(ws.db, ws.objects, self.step, self.lock, self._await_settled,
                               self.scratch.unlink_retired, row_delay)
        self.scratch.held = self.rows.content_of
        self.meta = MetaTree(ws, mountpoint, self._await_settled, self.status_text, self.getattr)
        # STEPFS_GUARD=0 turns the version-token checks off: only for the
        # benchmark that measures what they cost.  Never for real use.
        self.content = Content(
            ws=ws, step=self.step, mountpoint=mountpoint, lock=self.lock, ns=self.ns, versions=self.versions,
            scratch=self.scratch, rows=self.rows, links=self.links, meta=self.meta,
            check_writable=self.failsafe.check_writable, check_new_name=check_new_name,
            await_settled=self._await_settled, changed=self._changed,
            guard=os.environ.get("STEPFS_GUARD", "1") != "0", require_read=require_read)
        self.step_nodes = StepNodes(ws=ws, step=self.step, mountpoint=mountpoint, lock=self.lock, ns=self.ns,
                                    versions=self.versions, content=self.content, rows=self.rows,
                                    scratch=self.scratch, links=self.links, await_settled=self._await_settled)
        # The same objects under the names the adapter, the watcher, the
        # auto-step policy and the tests read.
        self.settled, self.commit_idle = self.commits.settled, self.commits.commit_idle
        self.own_publishes = self.commits.own_publishes
        self.handles, self.drafts, self.observed = self.content.handles, self.content.drafts, self.versions.observed
        self.precaptured, self.last_errors = self.content.cas.precaptured, self.content.last_errors
        self.scratch_dir, self.dir_times, self.lower_shown = self.scratch.dir, self.ns.dir_times, self.links.shown
        groups: dict[int, Node] = {}
        for row in rows:
            path = view_path(row.path)
            if row.link_group is not None and row.link_group in groups:
                node = groups[row.link_group]  # another name of the same file
            else:
                node = Node.from_row(row, self.ns.new_ino())
                if node.ref is not None:
                    node.scratch = self.scratch.path(node.ref)
                self.versions.bump(node)
                if row.link_group is not None:
                    groups[row.link_group] = node
            if node.link_group is not None:
                node.names.add(path)
                node.name_bases[path] = row.base
            node.mark_removed(path, row.removed_ns)
            self.upper.set(path, node)
        self.changes = Changes(ws=ws, lock=self.lock, ns=self.ns, versions=self.versions, content=self.content,
                               rows=self.rows, links=self.links, scratch=self.scratch, failsafe=self.failsafe,
                               changed=self._changed,
                               first_link_group=max(groups, default=0) + 1)
        # Unversioned paths: decided by the rules, served by the passthrough.
        self.passthrough = Passthrough(self.root)
        self.unversioned = Rules(excludes, default_excludes,
                                 read_ignore=ignore_reader(self.lock, self.versions, self.content))

    # -- unversioned paths (unversioned.py, passthrough.py) ----------------------

    def _unv(self, path: str, is_dir) -> bool:
        """Whether ``path`` goes to the passthrough: unversioned by the rules,
        and the workspace holds the directory it is in (the top of an
        unversioned tree in a directory that exists only in the open step,
        or a name the open step already holds, is staged like any other)."""
        rules = self.unversioned
        parent = path.rpartition("/")[0] or "/"
        # A staged path outside an unversioned tree stays versioned
        # whatever the patterns say of it (the answer below), so no pattern
        # is matched: a tar sets three attributes of each file it writes,
        # and the directory patterns' match cost as much as the rest of
        # this check.
        rules.refresh()  # (what covers does first: due at most every RELOAD_INTERVAL)
        with self.lock:
            if path in self.upper.nodes and (parent == "/" or not rules.dir_covered(parent)):
                return False
        if not rules.covers(path, is_dir):
            return False
        if parent != "/" and rules.dir_covered(parent):
            # Inside an unversioned tree: the workspace decides, unless the
            # open step holds the tree (staged before it was unversioned,
            # or made in a directory only the step has).
            return not self.upper.nodes or not self.ns.children_covered(parent)
        with self.lock:
            if path in self.upper.nodes or self.ns.children_covered(parent):
                return False
        return self.passthrough.parent_exists(path)

    def _kind_is_dir(self, path: str):
        """A callable: whether ``path`` is a directory in the view (asked only
        when a pattern's answer depends on it)."""
        def is_dir() -> bool:
            try:
                return self.getattr(path)["st_mode"] & 0o170000 == 0o040000
            except (ViewError, OSError):
                return False
        return is_dir

    def unversioned_state(self) -> dict:
        """The rules and the unversioned trees that exist now (status)."""
        out = self.unversioned.describe()
        out["trees"] = [p for p in out["trees"] if self.passthrough.exists(p)]
        return out

    # -- namespace and metadata changes (changes.py) ---------------------------

    # Each edit goes to the passthrough when its path is unversioned (_unv).

    def chmod(self, path: str, mode: int) -> None:
        if self._unv(path, self.passthrough_is_dir(path)):
            return self.passthrough.chmod(path, mode)
        self.changes.chmod(path, mode)

    def chown(self, path: str, uid: int, gid: int) -> None:
        if self._unv(path, self.passthrough_is_dir(path)):
            return self.passthrough.chown(path, uid, gid)
        self.changes.chown(path, uid, gid)

    def setxattr(self, path: str, name: str, value: bytes, options: int = 0) -> None:
        if self._unv(path, self.passthrough_is_dir(path)):
            return self.passthrough.setxattr(path, name, value, options)
        self.changes.setxattr(path, name, value, options)

    def removexattr(self, path: str, name: str) -> None:
        if self._unv(path, self.passthrough_is_dir(path)):
            return self.passthrough.removexattr(path, name)
        self.changes.removexattr(path, name)

    def utimens(self, path: str, times: tuple[int, int] | None) -> None:
        if self._unv(path, self.passthrough_is_dir(path)):
            return self.passthrough.utimens(path, times)
        self.changes.utimens(path, times)

    def mkdir(self, path: str, mode: int, owner: tuple[int, int] | None = None, agent: str = DEFAULT) -> None:
        if self._unv(path, True):
            return self.passthrough.mkdir(path, mode, owner)
        self.changes.mkdir(path, mode, owner, agent)

    def rmdir(self, path: str, agent: str | Callable[[], str] = DEFAULT) -> None:
        """``agent`` (here and in :meth:`unlink`) may be a callable, asked
        only when the view holds drafts (``Content.removed``)."""
        if self._unv(path, True):
            return self.passthrough.rmdir(path)
        self.changes.rmdir(path, agent)

    def unlink(self, path: str, agent: str | Callable[[], str] = DEFAULT) -> None:
        if self._unv(path, False):
            return self.passthrough.unlink(path)
        self.changes.unlink(path, agent)

    def symlink(self, path: str, target: str, owner: tuple[int, int] | None = None, agent: str = DEFAULT) -> None:
        if self._unv(path, False):
            return self.passthrough.symlink(path, target, owner)
        self.changes.symlink(path, target, owner, agent)

    def mknod(self, path: str, mode: int, dev: int = 0, owner: tuple[int, int] | None = None,
              agent: str = DEFAULT) -> None:
        if self._unv(path, False):
            return self.passthrough.mknod(path, mode, dev, owner)
        self.changes.mknod(path, mode, dev, owner, agent)

    def rename(self, old: str, new: str, flags: int = 0, agent: str = DEFAULT) -> None:
        is_dir = self._kind_is_dir(old)
        a, b = self._unv(old, is_dir), self._unv(new, is_dir)
        if a and b:
            return self.passthrough.rename(old, new, flags)
        if b:
            # A tree made next to its unversioned place and renamed in
            # (crossing.py); the other way is EXDEV: mv copies, then removes.
            return move_to_unversioned(self, old, new, flags, agent)
        if a:
            raise OSError(errno.EXDEV, "a rename from an unversioned path to a versioned one", new)
        self.changes.rename(old, new, flags, agent)

    def link(self, path: str, existing: str, agent: str = DEFAULT) -> None:
        a, b = self._unv(path, False), self._unv(existing, False)
        if a and b:
            return self.passthrough.link(path, existing)
        if a or b:
            raise OSError(errno.EXDEV, "a link between versioned and unversioned paths", path)
        self.changes.link(path, existing, agent)

    def passthrough_is_dir(self, path: str):
        """Whether the workspace has a directory at ``path`` (asked only when
        the rules' answer depends on it)."""
        return lambda: self.passthrough.is_dir(path)

    # -- open files and tokens (content.py, versions.py) ----------------------

    # A handle number from HANDLE_BASE up is the passthrough's.

    def open(self, path: str, flags: int, agent: str = DEFAULT) -> int:
        if self._unv(path, False):
            return self.passthrough.open(path, flags)
        return self.content.open(path, flags, agent)

    def create(self, path: str, mode: int, flags: int = os.O_RDWR, owner: tuple[int, int] | None = None,
               agent: str = DEFAULT) -> int:
        if self._unv(path, False):
            return self.passthrough.create(path, mode, flags, owner)
        return self.content.create(path, mode, flags, owner, agent)

    def read(self, fh: int, size: int, offset: int) -> bytes:
        if fh >= HANDLE_BASE:
            return self.passthrough.read(fh, size, offset)
        return self.content.read(fh, size, offset)

    def read_fd(self, fh: int) -> int | None:
        """A descriptor the caller owns of what ``fh`` reads (``Content.read_fd``)."""
        if fh >= HANDLE_BASE:
            return os.dup(fh - HANDLE_BASE)
        return self.content.read_fd(fh)

    def readinto(self, fh: int, buf: memoryview, offset: int) -> int:
        if fh >= HANDLE_BASE:
            return self.passthrough.readinto(fh, buf, offset)
        return self.content.readinto(fh, buf, offset)

    def write(self, fh: int, data, offset: int) -> int:
        """Write ``data`` (any byte buffer, used during the call only) at ``offset``."""
        if fh >= HANDLE_BASE:
            return self.passthrough.write(fh, data, offset)
        return self.content.write(fh, data, offset)

    def truncate(self, path: str, length: int, fh: int | None = None, agent: str = DEFAULT) -> None:
        if fh is not None and fh >= HANDLE_BASE:
            return self.passthrough.ftruncate(fh, length)
        if fh is None and self._unv(path, False):
            return self.passthrough.truncate(path, length)
        self.content.truncate(path, length, fh, agent)

    def fallocate(self, fh: int, mode: int, offset: int, length: int) -> None:
        if fh >= HANDLE_BASE:
            return self.passthrough.fallocate(fh, mode, offset, length)
        self.content.fallocate(fh, mode, offset, length)

    def flush(self, fh: int, publish=True, later=None) -> None:
        """``content.Content.flush`` (``later``: work after the reply)."""
        if fh >= HANDLE_BASE:
            return  # nothing to check or publish: the bytes are in the workspace file already
        self.content.flush(fh, publish, later)

    def fsync(self, fh: int, datasync: bool) -> None:
        if fh >= HANDLE_BASE:
            return self.passthrough.fsync(fh, datasync)
        self.content.fsync(fh, datasync)

    def release(self, fh: int) -> None:
        if fh >= HANDLE_BASE:
            return self.passthrough.release(fh)
        self.content.release(fh)

    def handle_direct_io(self, fh: int) -> bool:
        if fh >= HANDLE_BASE:
            return False  # one workspace file: the page cache is as true as for any local file
        return self.content.handle_direct_io(fh)

    def record_token(self, path: str) -> str:
        return self.versions.record_token(path)

    def current_token(self, path: str):
        return self.versions.current_token(path)

    def still(self, recorded: str, path: str) -> bool:
        return self.versions.still(recorded, path)

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def _store_failed(self, err: Exception) -> None:
        """``Database.on_failure`` listener (any thread, maybe under the lock)."""
        self._go_readonly(str(err))

    def _go_readonly(self, reason: str) -> None:
        """Once the store could not keep a write, or a commit failed past
        its commit point, refuse every change (EROFS) rather than accept
        writes that cannot be kept; reads keep working."""
        self.failsafe.trip(reason)

    @property
    def readonly_reason(self) -> str | None:
        return self.failsafe.reason

    # -- persistence (write-through of staged rows) ------------------------------

    def sync_rows(self, between: bool = True) -> None:
        """Write every recorded staged row now (``rows.StagedRows.sync``)."""
        self.rows.sync(between)

    # -- attributes ---------------------------------------------------------

    def made_by_step(self, path: str) -> bool:
        """Whether directory ``path`` was made by the open step where the
        workspace had nothing (an opaque node whose base is absent): the
        workspace has no directory behind it to watch, so the adapter
        spares the watcher's failing open at each GETATTR of it, which
        ``tar -x`` asks before every file it creates there; one that
        appears later (an outside mkdir, this step's commit) is watched
        from its parent's event (``Watcher._adopt``)."""
        node = self.upper.nodes.get(path)
        return node is not None and node.opaque and node.base == ABSENT and node.kind == "dir"

    def getattr(self, path: str, fh: int | None = None, agent=DEFAULT) -> dict:
        """Attributes as the calling agent sees them.  ``agent`` may be a
        callable: it is only asked when the path has open drafts, keeping
        the hot path free of /proc reads."""
        if fh is not None and fh >= HANDLE_BASE:
            return self.ns.stat_lower(path, self.passthrough.fstat(fh))
        with self.lock:
            if fh is not None:
                out = self.content.stat_handle(fh)
                if out is not None:
                    return out
            if path.startswith(META_ROOT) and is_meta(path):
                return self.meta.getattr(path)
            if path in self.content.open_drafts or (self.content.hidden and path in self.content.hidden):
                out = self.content.stat_open(path, agent)
                if out is not None:
                    return out
            try:
                node, st = self.ns.resolve(path)
            except NotFound:
                if len(os.fsencode(path.rpartition("/")[2])) > 255:
                    raise NameTooLong(path) from None  # a lookup of a name no directory can hold
                raise
            if node is None:
                return self.ns.stat_lower(path, st)
            out = self.ns.stat_node(node)
            if node.kind == "dir":
                out["st_nlink"] = self.ns.dir_nlink(path)
            return out

    def getattr_listed(self, path: str, names: list[str], agent=DEFAULT) -> list[dict | None]:
        """``getattr(path + "/" + name)`` for each of ``names`` (entries of
        the directory ``path``, never ``.``/``..``), None where it would
        fail: the attributes a READDIRPLUS reply carries.

        The same answers with less work per name, under one hold of the
        lock: a name whose path only the workspace decides (no upper node
        at it or covering it, no open draft, no hidden name) is stat'ed
        with one ``fstatat`` relative to a descriptor of the directory,
        opened beneath the root without following symlinks (``Root.open``),
        the one the namespace keeps (``dirhandles``) or one for this call
        only, instead of resolving its whole path again
        (``openat2`` + ``fstat`` + ``close`` per name).  The name is one
        component, not ``..``, stat'ed without following it: nothing
        outside the directory is reached (a name that is not one plain
        component, or ``.stepfs`` at the root, is not taken this way).
        Any other name, or every name
        when the directory has no workspace descriptor (an upper-only or
        covered directory), goes through :meth:`getattr` (``agent`` as
        there: a callable asked only for a path with open drafts)."""
        prefix = path if path != "/" else ""
        out: list[dict | None] = []
        with self.lock:
            nodes = self.upper.nodes
            hidden = self.content.hidden
            open_drafts = self.content.open_drafts
            dfd, opened = -1, False
            if not self.ns.children_covered(path):
                dfd = self.ns.dirs.fd(path) if path != "/" else -1  # kept: not closed here
                if dfd < 0:
                    try:
                        dfd = self.root.open(rel(path), os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW)
                        opened = True
                    except OSError:
                        dfd = -1
            try:
                for name in names:
                    child = prefix + "/" + name
                    if (dfd < 0 or child in nodes or child in open_drafts or (hidden and child in hidden)
                            or "/" in name or name == ".." or (not prefix and is_meta(child))):
                        try:
                            out.append(self.getattr(child, agent=agent))
                        except (ViewError, StepfsError, OSError):
                            out.append(None)  # as getattr's error would: a plain entry
                        continue
                    try:
                        st = os.stat(os.fsencode(name), dir_fd=dfd, follow_symlinks=False)
                    except OSError:
                        out.append(None)  # gone since the listing: the kernel looks it up
                        continue
                    out.append(self.ns.stat_lower(child, st))
            finally:
                if opened:
                    os.close(dfd)
        return out

    def handle_page_token(self, fh: int) -> str | None:
        """The version token of a read-only handle on the published version
        of a file, the workspace file itself or a staged file (None for
        drafts, ``.stepfs`` files and direct I/O): the FUSE adapter lets
        the kernel keep the pages of such a file across opens while this
        token stays the same (a staged file's token changes with every
        publish of it, and with its renames)."""
        h = self.content.handles.get(fh)
        if h is None or h.writable or h.direct or h.draft is not None or h.data is not None:
            return None
        return h.token or None

    # -- extended attributes (user.*; see store/xattrs.py) -----------------

    def getxattr(self, path: str, name: str) -> bytes:
        with self.lock:
            if is_meta(path):
                raise NoAttribute(name)
            raw = os.fsencode(name)
            value = self.ns.xattrs_of(path).get(raw) if raw.startswith(xattr_codec.PREFIX) else None
            if value is None:
                raise NoAttribute(name)
            return value

    def listxattr(self, path: str) -> list[str]:
        with self.lock:
            if is_meta(path):
                return []
            return [os.fsdecode(n) for n in sorted(self.ns.xattrs_of(path))]

    def statfs(self, path: str) -> dict:
        sv = os.statvfs(self.root.fd)
        return {key: getattr(sv, key) for key in (
            "f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files", "f_ffree", "f_favail",
            "f_flag", "f_namemax")}

    # -- directories ----------------------------------------------------------

    def readdir(self, path: str) -> list[tuple[str, int, int]]:
        """``[(name, S_IFMT bits, inode)]`` including ``.`` and ``..``.

        Inode numbers matter: glibc's readdir skips entries whose d_ino is 0.
        """
        with self.lock:
            if is_meta(path):
                return self.meta.readdir(path)
            return self.ns.listing(path)

    # -- names ------------------------------------------------------------------

    def readlink(self, path: str) -> str:
        with self.lock:
            if is_meta(path):
                return self.meta.readlink(path)
            node, st = self.ns.resolve(path)
            if self.ns.kind(node, st) != "symlink":
                raise Invalid(path)
            if node is not None:
                return os.fsdecode(node.target)
            return os.fsdecode(self.root.readlink(rel(path)))

    # -- the step ---------------------------------------------------------------

    def staged_paths(self) -> list[tuple[str, str]]:
        """``[(op, path)]`` with op A (added), M (modified) or D (deleted)."""
        return self.step_nodes.staged()

    def discard(self, paths: list[str]) -> list[str]:
        """Drop staged paths (and everything below them) from the open step."""
        return self.step_nodes.discard(paths)

    def forget(self, paths: list[str]) -> None:
        """Drop what the view holds for ``paths`` after a rollback changed them."""
        self.ns.dirs.stale()  # a rollback may replace whole directories
        self.step_nodes.forget(paths)

    def commit(self, message: str = "", meta: dict | None = None, allow_empty: bool = False,
               overwrite: set[bytes] = frozenset()) -> int:
        """Commit the open step as the next layer (see ``store.publish``).
        Returns once the layer is committed (durably), or raises.  Drafts
        still open for writing stay open and publish at their next close,
        against the new workspace state."""
        with self.begin_commit(message, meta, allow_empty, overwrite) as c:
            number = c.publish()
            c.complete()
            return number

    def begin_commit(self, message: str = "", meta: dict | None = None, allow_empty: bool = False,
                     overwrite: set[bytes] = frozenset()) -> ViewCommit:
        """The commit in two phases, for a caller that answers between them
        (the daemon): see ``committing.py``."""
        return ViewCommit(self.commits, self._before_commit, self._after_commit,
                          self.content.cas.precaptured,
                          message=message, meta=meta, allow_empty=allow_empty, overwrite=overwrite,
                          ready=self.content.cas.ready)

    # The commit writes the workspace between these two (under the view's
    # lock, which every lookup takes): kept directory descriptors may name
    # directories it replaced, whether it succeeded or failed half-way.
    def _before_commit(self):
        out = self.step_nodes.before_commit()
        self.ns.dirs.stale()  # last: only the store's writes follow, until _after_commit or the lock's release
        return out

    def _after_commit(self, covered: list[str]) -> None:
        self.ns.dirs.stale()
        self.step_nodes.after_commit(covered)

    def close(self) -> None:
        """Unmount: decide every open handle, then write the recorded rows
        (once a commit still completing has ended: the store closes next)."""
        self.settled.wait()
        with self.lock:
            self.ns.dirs.close()
            self.content.close()
            self.rows.stop()
            try:
                self.sync_rows()
            except Exception:
                log.exception("writing %d staged rows at unmount failed; they are lost", len(self.rows.pending))
            if not self.rows.pending:
                self.scratch.unlink_retired()
            # Their writes name the spare directory by a handle of the store,
            # closed next: none may still be running then.
            ready = self.content.cas.ready
            ready.give_back(ready.detach())

    def status_text(self, listable=None) -> str:
        """``MOUNT/.stepfs/status``: what an agent needs to know about itself.
        ``listable(path)``: whether the reader may see that staged path
        (``MetaTree._listable``; None: every path)."""
        from stepfs.store import layers as store_layers

        with self.ws.db.read() as conn:
            head = store_layers.head(conn)
        staged = self.staged_paths()
        if listable is not None:
            staged = [(op, path) for op, path in staged if listable(path)]
        return status_text(self.mountpoint, self.ws.path, head, self.readonly_reason, self.content.last_errors,
                           staged, warnings=self.warnings, runs=self.runs.status_lines(),
                           unversioned=self.unversioned_state())
