"""The overlay view of one mount: workspace below, open step above (FUSE-free).

This is the whole filesystem logic; ``fuse_ops.py`` only translates calls
and errors.  Lookup precedence for a path ``p``:

1. an upper node at ``p`` wins (a whiteout means "absent");
2. otherwise, if an ancestor of ``p`` is a whiteout, a non-directory, or an
   opaque directory in the upper layer, ``p`` is absent;
3. otherwise the workspace decides (``store.contained.Root``: no symlink
   followed, nothing outside the workspace, never ``.stepfs``).

Copy-up: the first open for writing (or truncate) of a workspace file copies
it into a scratch file (sparse-aware, O(size of that file)); writes go to
the scratch file; the close after writing (``flush``) stores the content as an
object and writes the staged row -- or, for a file of at least
``store.refs.MIN_SIZE`` bytes, hands the scratch file itself over as the
staged content (staged by reference; the commit imports the bytes, see
``store/refs.py``).  Such a file is never written again (``Draft.frozen``,
``Content.thaw``) and is removed only once no staged row in the store
names it (``scratch.py``); a daemon start keeps the
referenced files and removes the other scratch leftovers.  Mounting reads
only the open step's staged rows: O(1) in the size of the workspace.

Staged rows: namespace and metadata changes change the upper layer in
memory at once; their rows reach the store in batches (``rows.py`` says
when, and what a crash loses).

Threading: every public method takes ``self.lock`` (one re-entrant lock) for
its whole duration, except a commit (``committing.py``), which releases it once
the layer is published and the view's bookkeeping is done, while the store
completes the layer (:attr:`Overlay.settled` is clear meanwhile: writes of
staged rows and reads of history wait for it, still under the lock).  The
FUSE loop, the control thread (commits), the auto-step thread and the
row-flush timer are the only callers.  Nothing here blocks on another
process.

Caveats: mtime-only changes (``touch`` of an unchanged file) are shown in the
mount but not committed; ownership changes are not staged yet.
"""

from __future__ import annotations

import itertools
import logging
import os
import stat as stat_mod
import threading
import time

from store import publish, refs, staging, tokens
from store.errors import StepfsError
from store.workspace import Workspace

from .agents import DEFAULT
from store import xattrs as xattr_codec
from store.contained import NODE_KINDS, kind_of, rdev_target

from .committing import Commits, Failsafe, ViewCommit
from .content import Content
from .errors import (
    Exists, Invalid, IsADirectory, NameTooLong, NoAttribute, NotADirectory, NotEmpty, NotFound, NotSupported,
    ReadOnly, Reserved, Unsupported, ViewError,
)
from .links import Links
from .namespace import Namespace
from .metatree import ROOT as META_ROOT, MetaTree, is_meta
from .rows import StagedRows
from .status import status_text
from .scratch import ScratchFiles
from .upper import Node, Upper, parent_name, rel, view_path
from .versions import Versions

log = logging.getLogger("stepfs.view")

# libfuse's high-level API renames a file that is unlinked while open to
# ".fuse_hidden<N>" and unlinks that name at the last release; the view keeps
# such files out of the namespace (never listed, staged or committed).
HIDDEN_PREFIX = ".fuse_hidden"
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2


class Overlay:
    """The merged view of ``ws`` for the open step of ``mountpoint``."""

    def __init__(self, ws: Workspace, mountpoint: str, agent: str = "", require_read: bool = False,
                 row_delay: float | None = 0.0):
        """``row_delay``: seconds before recorded staged rows are written by a
        timer (the daemon passes :data:`ROW_DELAY`); 0, the default, writes
        each change at once; None leaves them to the other flush points
        (tests that decide when the store is written)."""
        self.ws = ws
        self.root = ws.root
        self.mountpoint = mountpoint
        self.agent = agent
        self.default_agent = DEFAULT
        self.row_delay = row_delay
        self.lock = threading.RLock()
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
        self.meta = MetaTree(ws, mountpoint, self._await_settled, self.status_text)
        # STEPFS_GUARD=0 turns the version-token checks off: only for the
        # benchmark that measures what they cost.  Never for real use.
        self.content = Content(
            ws=ws, step=self.step, mountpoint=mountpoint, lock=self.lock, ns=self.ns, versions=self.versions,
            scratch=self.scratch, rows=self.rows, links=self.links, meta=self.meta,
            check_writable=self._check_writable, check_new_name=self._check_new_name,
            await_settled=self._await_settled, changed=self._changed,
            guard=os.environ.get("STEPFS_GUARD", "1") != "0", require_read=require_read)
        # The same objects under the names the adapter, the watcher, the
        # auto-step policy and the tests read.
        self.settled, self.commit_idle = self.commits.settled, self.commits.commit_idle
        self.own_publishes = self.commits.own_publishes
        self.handles, self.drafts, self.observed = self.content.handles, self.content.drafts, self.versions.observed
        self.precaptured, self.last_errors = self.content.precaptured, self.content.last_errors
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
            self.upper.set(path, node)
        self._link_groups = itertools.count(max(groups, default=0) + 1)

    # -- open files and tokens (content.py, versions.py) ----------------------

    def open(self, path: str, flags: int, agent: str = DEFAULT) -> int:
        return self.content.open(path, flags, agent)

    def create(self, path: str, mode: int, flags: int = os.O_RDWR, owner: tuple[int, int] | None = None,
               agent: str = DEFAULT) -> int:
        return self.content.create(path, mode, flags, owner, agent)

    def read(self, fh: int, size: int, offset: int) -> bytes:
        return self.content.read(fh, size, offset)

    def write(self, fh: int, data: bytes, offset: int) -> int:
        return self.content.write(fh, data, offset)

    def truncate(self, path: str, length: int, fh: int | None = None, agent: str = DEFAULT) -> None:
        self.content.truncate(path, length, fh, agent)

    def fallocate(self, fh: int, mode: int, offset: int, length: int) -> None:
        self.content.fallocate(fh, mode, offset, length)

    def flush(self, fh: int) -> None:
        self.content.flush(fh)

    def fsync(self, fh: int, datasync: bool) -> None:
        self.content.fsync(fh, datasync)

    def release(self, fh: int) -> None:
        self.content.release(fh)

    def handle_direct_io(self, fh: int) -> bool:
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

    def _check_writable(self, path: str) -> None:
        if is_meta(path):
            raise ReadOnly(path)
        if self.readonly_reason is not None:
            raise ReadOnly(self.readonly_reason)

    # -- persistence (write-through of staged rows) ------------------------------

    def _persist(self, puts: list[str] = (), removes: list[str] = (), trees: list[str] = ()) -> None:
        """Record the rows of ``puts`` (by their current nodes), the deletion
        of the rows of ``removes`` and of everything below ``trees``; they
        reach the store at the next flush (module doc)."""
        self.ns.nlink_cache.clear()
        if self.on_change is not None:
            self.on_change()
        pending = self.rows.pending
        for path in trees:
            pending.remove_tree(rel(path))
        for path in removes:
            pending.remove(rel(path))
        for path in puts:
            node = self.upper.nodes[path]
            for name in (node.names if node.link_group is not None else (path,)):
                pending.put(node.row(name))
            node.staged = True
        self.rows.recorded()

    def sync_rows(self, between: bool = True) -> None:
        """Write every recorded staged row now (``rows.StagedRows.sync``)."""
        self.rows.sync(between)

    def _imported(self, oids: dict[str, str]) -> None:
        """The store took the by-reference files ``oids`` (scratch name ->
        object id) as objects: their nodes name the objects now, and their
        files are ordinary caches (no row references them any more)."""
        if not oids:
            return
        for node in self.upper.nodes.values():
            if node.ref is not None and node.ref in oids:
                node.oid, node.ref, node.ref_sum = oids[node.ref], None, None

    def _node_for_meta(self, path: str) -> Node:
        """An upper node for a metadata change of ``path`` (copied up without
        a scratch file: files are stored as an object once)."""
        node, st = self.ns.resolve(path)
        if node is not None:
            return node
        kind = self.ns.kind(None, st)
        base = self.ns.lower_token(path)
        attrs: dict[bytes, bytes] = {}
        self.links.name_gone(st, path)  # from now on this name is a file of its own
        if kind == "dir":
            node = Node("dir", st.st_mode, base=base, ino=st.st_ino, uid=st.st_uid, gid=st.st_gid,
                        mtime_ns=max(st.st_mtime_ns, self.ns.dir_times.pop(path, 0)))
            fd = self.root.open(rel(path), os.O_RDONLY | os.O_DIRECTORY)
            try:
                attrs = xattr_codec.read_fd(fd)
            finally:
                os.close(fd)
        elif kind in NODE_KINDS:
            node = Node(kind, st.st_mode, base=base, ino=st.st_ino, mtime_ns=st.st_mtime_ns, uid=st.st_uid,
                        gid=st.st_gid, target=rdev_target(kind, st.st_rdev))
        elif kind == "symlink":
            node = Node("symlink", st.st_mode, base=base, ino=st.st_ino, target=self.root.readlink(rel(path)),
                        size=st.st_size, mtime_ns=st.st_mtime_ns, uid=st.st_uid, gid=st.st_gid)
        elif kind == "file":
            fd = self.root.open(rel(path), os.O_RDONLY | os.O_NOFOLLOW)
            try:
                st = os.fstat(fd)
                with self.ws.db.write() as conn:
                    oid, size = self.ws.objects.put_fd(conn, fd)
                attrs = xattr_codec.read_fd(fd)
            finally:
                os.close(fd)
            node = Node("file", st.st_mode, base=tokens.from_stat(st), ino=st.st_ino, size=size, oid=oid,
                        mtime_ns=st.st_mtime_ns, uid=st.st_uid, gid=st.st_gid)
        else:
            raise Unsupported(path)
        node.xattrs = attrs
        node.atime_ns = st.st_atime_ns
        node.ctime_ns = max(st.st_ctime_ns, node.mtime_ns)
        self.versions.bump(node)
        self.upper.set(path, node)
        digest = node.oid.split(".", 1)[0] if node.oid else ""
        self.content.retoken(path, base, self.versions.node_token(node), lambda: digest)
        return node

    def _remove(self, path: str, agent: str | None = None) -> None:
        """Make ``path`` (and everything below it) absent in the view.  The
        acting agent's own drafts there are detached (its open descriptors
        keep working, POSIX-style); other agents' drafts lose at their close."""
        if agent is not None:
            prefix = path + "/"
            # A name of a hard-linked file: the file lives on under another
            # name, and so does the agent's draft of it (writes through an
            # open descriptor reach the remaining names).
            here = self.upper.get(path)
            heir = min((n for n in here.names if n != path), default=None) \
                if here is not None and here.link_group is not None else None
            for (a, p), d in list(self.content.drafts.items()):
                if a == agent and p == path and heir is not None and (a, heir) not in self.content.drafts:
                    del self.content.drafts[(a, p)]
                    self.content.reindex_draft(d, heir)
                    self.content.drafts[(a, heir)] = d
                elif a == agent and (p == path or p.startswith(prefix)):
                    d.detached = True
                    if d.opens == 0:
                        self.content.discard_draft(d)
                    else:
                        del self.content.drafts[(a, p)]
        node = self.upper.get(path)
        base = node.base if node is not None else self.ns.lower_token(path)
        if node is None:
            lower = self.ns.lower_stat(path)
            if lower is not None:
                self.links.name_gone(lower, path)
        below = self.upper.below(path)
        for child in below:
            self._detach(child, self.upper.pop(child))
        self._detach(path, self.upper.pop(path))
        if self.ns.lower_stat(path) is not None:
            self.upper.set(path, Node("whiteout", 0, base=base, ino=0))
            self._persist(puts=[path], trees=[path] if below else [])
        else:
            self._persist(trees=[path])

    def _detach(self, path: str, node: Node | None) -> None:
        """A name leaves the tree; the node goes with its last name (open
        readers keep its scratch through their fds)."""
        if node is None:
            return
        if node.link_group is not None:
            node.names.discard(path)
            node.name_bases.pop(path, None)
            if node.names:
                node.ctime_ns = time.time_ns()
                self._persist(puts=[next(iter(node.names))])  # their link count changed
                self.links.invalidate_names(node)
                return
        self.scratch.drop(node)

    # -- attributes ---------------------------------------------------------

    def getattr(self, path: str, fh: int | None = None, agent=DEFAULT) -> dict:
        """Attributes as the calling agent sees them.  ``agent`` may be a
        callable: it is only asked when the path has open drafts, keeping
        the hot path free of /proc reads."""
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
        opened beneath the root without following symlinks (``Root.open``)
        for this call only, instead of resolving its whole path again
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
            dfd = -1
            if not self.ns.children_covered(path):
                try:
                    dfd = self.root.open(rel(path), os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW)
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
                if dfd >= 0:
                    os.close(dfd)
        return out

    def handle_workspace_token(self, fh: int) -> str | None:
        """The version token of a read-only handle on the workspace file
        itself (None for drafts, staged nodes, ``.stepfs`` files and
        direct I/O): the FUSE adapter lets the kernel keep the pages of such
        a file across opens while this token stays the same."""
        h = self.content.handles.get(fh)
        if h is None or h.writable or h.direct or h.draft is not None or h.node is not None or h.data is not None:
            return None
        return h.token or None

    def chmod(self, path: str, mode: int) -> None:
        with self.lock:
            if path in self.content.hidden:
                return
            self._check_writable(path)
            node = self._node_for_meta(path)
            node.mode = stat_mod.S_IFMT(node.mode) | stat_mod.S_IMODE(mode)
            node.ctime_ns = time.time_ns()
            self._persist(puts=[path])
            self.content.sync_draft_meta(path, node)
            self.links.invalidate_names(node, except_path=path)

    def chown(self, path: str, uid: int, gid: int) -> None:
        with self.lock:
            self._check_writable(path)
            node = self._node_for_meta(path)
            if uid != -1:
                node.uid = uid
            if gid != -1:
                node.gid = gid
            node.ctime_ns = time.time_ns()
            self._persist(puts=[path])
            self.content.sync_draft_meta(path, node)
            self.links.invalidate_names(node, except_path=path)

    # -- extended attributes (user.*; see store/xattrs.py) -----------------

    @staticmethod
    def _xattr_name(name: str) -> bytes:
        raw = os.fsencode(name)
        if not raw.startswith(xattr_codec.PREFIX):
            raise NotSupported(name)
        return raw

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

    XATTR_CREATE, XATTR_REPLACE = 1, 2

    def setxattr(self, path: str, name: str, value: bytes, options: int = 0) -> None:
        with self.lock:
            self._check_writable(path)
            raw = self._xattr_name(name)
            node = self._node_for_meta(path)
            if node.kind not in ("file", "dir"):
                raise Unsupported(path)  # Linux allows user.* only on files and directories
            if options & self.XATTR_CREATE and raw in node.xattrs:
                raise Exists(name)
            if options & self.XATTR_REPLACE and raw not in node.xattrs:
                raise NoAttribute(name)
            node.xattrs[raw] = bytes(value)
            node.ctime_ns = time.time_ns()
            self._persist(puts=[path])
            self.content.sync_draft_meta(path, node)

    def removexattr(self, path: str, name: str) -> None:
        with self.lock:
            self._check_writable(path)
            raw = self._xattr_name(name)
            if raw not in self.ns.xattrs_of(path):
                raise NoAttribute(name)
            node = self._node_for_meta(path)
            del node.xattrs[raw]
            node.ctime_ns = time.time_ns()
            self._persist(puts=[path])
            self.content.sync_draft_meta(path, node)

    UTIME_NOW = (1 << 30) - 1
    UTIME_OMIT = (1 << 30) - 2

    def utimens(self, path: str, times: tuple[int, int] | None) -> None:
        """``times`` in ns; libfuse3 passes UTIME_NOW / UTIME_OMIT through as
        the nanosecond field with zero seconds."""
        with self.lock:
            if path in self.content.hidden:
                return
            self._check_writable(path)
            node = self._node_for_meta(path)
            now = time.time_ns()
            atime, mtime = times if times is not None else (self.UTIME_NOW, self.UTIME_NOW)
            new_a = node.atime_ns if atime == self.UTIME_OMIT else now if atime == self.UTIME_NOW else atime
            new_m = node.mtime_ns if mtime == self.UTIME_OMIT else now if mtime == self.UTIME_NOW else mtime
            # Open drafts of the path carry the times their handles report.
            for d in self.content.drafts_at(path):
                st = os.stat(d.scratch)
                os.utime(d.scratch, ns=(st.st_atime_ns if atime == self.UTIME_OMIT else new_a,
                                        st.st_mtime_ns if mtime == self.UTIME_OMIT else new_m))
            node.atime_ns, node.mtime_ns, node.ctime_ns = new_a, new_m, now
            self._persist(puts=[path])
            self.links.invalidate_names(node, except_path=path)

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

    def _check_new_name(self, path: str) -> None:
        """Called before ``_check_writable`` so that creating ``/.stepfs``
        itself is Reserved (EEXIST) while anything below it is ReadOnly."""
        if path == META_ROOT:
            raise Reserved(path)
        if len(os.fsencode(parent_name(path)[1])) > 255:
            raise NameTooLong(path)

    def _check_create(self, path: str) -> None:
        """What every new name needs: a legal name, a writable mount, an
        existing parent directory, and nothing there yet."""
        self._check_new_name(path)
        self._check_writable(path)
        self.ns.require_dir(parent_name(path)[0])
        if self.ns.exists(path):
            raise Exists(path)

    def _add_new(self, path: str, node: Node, owner: tuple[int, int] | None, agent: str) -> None:
        """Stage a node made for a new name (directory, symlink, FIFO)."""
        node.uid, node.gid = owner if owner is not None else (os.getuid(), os.getgid())
        self.ns.inherit_group(path, node)
        self.versions.bump(node)
        self.upper.set(path, node)
        self._persist(puts=[path])
        self.ns.entries_changed(path)
        self.versions.observe(agent, path, self.versions.node_token(node))

    def mkdir(self, path: str, mode: int, owner: tuple[int, int] | None = None, agent: str = DEFAULT) -> None:
        with self.lock:
            self._check_create(path)
            # Opaque: whatever the workspace has (or will get) at this path
            # was not what this agent saw; its new directory starts empty.
            node = Node("dir", stat_mod.S_IFDIR | stat_mod.S_IMODE(mode), base=self.ns.base_for(path),
                        ino=self.ns.new_ino(), opaque=True)
            self._add_new(path, node, owner, agent)

    def rmdir(self, path: str, agent: str = DEFAULT) -> None:
        with self.lock:
            self._check_writable(path)
            if path == "/":
                raise Invalid(path)
            node, st = self.ns.resolve(path)
            if self.ns.kind(node, st) != "dir":
                raise NotADirectory(path)
            if not self.ns.is_empty_dir(path):
                raise NotEmpty(path)
            self._remove(path, agent)
            self.ns.entries_changed(path)

    # -- names ------------------------------------------------------------------

    def unlink(self, path: str, agent: str = DEFAULT) -> None:
        with self.lock:
            if self.content.hidden.pop(path, None) is not None:
                return
            self._check_writable(path)
            node, st = self.ns.resolve(path)
            if self.ns.kind(node, st) == "dir":
                raise IsADirectory(path)
            self._remove(path, agent)
            self.ns.entries_changed(path)

    def symlink(self, path: str, target: str, owner: tuple[int, int] | None = None,
                agent: str = DEFAULT) -> None:
        with self.lock:
            self._check_create(path)
            data = os.fsencode(target)
            node = Node("symlink", stat_mod.S_IFLNK | 0o777, base=self.ns.base_for(path), ino=self.ns.new_ino(),
                        target=data, size=len(data))
            self._add_new(path, node, owner, agent)

    def mknod(self, path: str, mode: int, dev: int = 0, owner: tuple[int, int] | None = None,
              agent: str = DEFAULT) -> None:
        """FIFOs, device nodes and sockets (staged and committed like any
        path; the kernel lets only CAP_MKNOD make a device), and regular files."""
        with self.lock:
            if stat_mod.S_ISREG(mode):
                fh = self.create(path, mode, os.O_WRONLY | os.O_EXCL, owner=owner, agent=agent)
                try:
                    self.flush(fh)
                finally:
                    self.release(fh)
                return
            kind = kind_of(mode)
            if kind not in NODE_KINDS:
                raise Unsupported(path)
            self._check_create(path)
            node = Node(kind, NODE_KINDS[kind] | stat_mod.S_IMODE(mode), base=self.ns.base_for(path),
                        ino=self.ns.new_ino(), target=rdev_target(kind, dev))
            self._add_new(path, node, owner, agent)

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

    def rename(self, old: str, new: str, flags: int = 0, agent: str = DEFAULT) -> None:
        with self.lock, self.rows.one_change():
            if parent_name(new)[1].startswith(HIDDEN_PREFIX):
                return self._hide(old, new, agent)
            self._check_writable(old)
            self._check_writable(new)
            self._check_new_name(new)
            if flags & ~(RENAME_NOREPLACE | RENAME_EXCHANGE) or flags == RENAME_NOREPLACE | RENAME_EXCHANGE:
                raise Invalid(f"rename flags {flags:#x}")
            src, src_st = self.ns.resolve(old)
            if flags & RENAME_EXCHANGE:
                self.ns.resolve(new)  # both must exist
                if old != new:
                    self._exchange(old, new, agent)
                    self.ns.entries_changed(old, new)
                return
            src_kind = self.ns.kind(src, src_st)
            self.ns.require_dir(parent_name(new)[0])
            dst_kind = None
            if self.ns.exists(new):
                if flags & RENAME_NOREPLACE:
                    raise Exists(new)  # even onto itself, as renameat2(2) does
                if old == new:
                    return
                if old.startswith(new + "/"):
                    raise NotEmpty(new)  # onto its own ancestor (the kernel's order of checks)
                dnode, dst_st = self.ns.resolve(new)
                if dnode is not None and dnode is src:
                    return  # two names of one hard-linked file: POSIX says do nothing
                if dnode is None and src is None and (dst_st.st_dev, dst_st.st_ino) == (src_st.st_dev, src_st.st_ino):
                    return  # the same, for a workspace file
                dst_kind = self.ns.kind(dnode, dst_st)
            if src_kind == "dir":
                if new.startswith(old + "/"):
                    raise Invalid(new)
                if dst_kind is not None and dst_kind != "dir":
                    raise NotADirectory(new)
                if dst_kind == "dir" and not self.ns.is_empty_dir(new):
                    raise NotEmpty(new)
                fresh = self._fresh_under(agent, old)
                self._unkey(agent, new)
                self._rename_dir(old, new)
            else:
                if dst_kind == "dir":
                    raise IsADirectory(new)
                if src_kind == "special":
                    raise Unsupported(old)  # sockets and devices stay where they are
                fresh = self._fresh_under(agent, old)
                self._rename_leaf(old, new, agent)
            self._moved(agent, old, new, fresh)
            self.ns.entries_changed(old, new)

    def _hide(self, old: str, new: str, agent: str) -> None:
        """An unlink of an open file (libfuse's hidden rename): the path is
        removed as by ``unlink``; open descriptors keep working under the
        hidden name, which reports ``st_nlink`` 0 -- or, for a hard-linked
        file, the names it still has."""
        node, st = self.ns.resolve(old)
        attrs = self.ns.stat_node(node) if node is not None else self.ns.stat_lower(old, st)
        d = self.content.drafts.get((agent, old))
        self.unlink(old, agent)
        # libfuse subtracts one from the st_nlink of a hidden name it is given
        # (a positive one): the names left, plus one.
        attrs["st_nlink"] = len(node.names) + 1 if node is not None and node.link_group is not None else 0
        self.content.hidden[new] = (d, attrs)
        for h in self.content.handles.values():
            if h.path == old:
                h.path = new

    def _unkey(self, agent: str, path: str) -> None:
        """Forget the acting agent's drafts at or below a path that is absent
        in the view (someone else removed their files) before a rename puts
        new files there: a later open must not share those dead copies.
        Their own descriptors keep them, and they lose at their close."""
        prefix = path + "/"
        for (a, p), d in list(self.content.drafts.items()):
            if a == agent and (p == path or p.startswith(prefix)):
                if d.opens:
                    del self.content.drafts[(a, p)]
                else:
                    self.content.discard_draft(d)

    def _fresh_under(self, agent: str, old: str) -> tuple[set[int], set[str]]:
        """Before a rename: which of the acting agent's drafts and handles
        (by id) and observations at or below ``old`` still match the
        published version."""
        prefix = old + "/"
        fresh = {id(d) for (a, p), d in self.content.drafts.items()
                 if a == agent and (p == old or p.startswith(prefix)) and not d.stale and self.versions.still(d.base, p)}
        fresh |= {id(h) for h in self.content.handles.values()
                  if h.agent == agent and h.token and (h.path == old or h.path.startswith(prefix))
                  and self.versions.still(h.token, h.path)}
        seen = {p for p, tok in self.versions.observed.get(agent, {}).items()
                if (p == old or p.startswith(prefix)) and self.versions.still(tok, p)}
        return fresh, seen

    def _moved(self, agent: str, old: str, new: str, fresh: tuple[set[int], set[str]]) -> None:
        """The acting agent's drafts, handles and observations follow a
        rename; other agents' stay at the old path and lose at their close.
        Only what was current before the move (``fresh``, from
        :meth:`_fresh_under`) is re-based on the moved version: an outdated
        draft, handle or observation stays outdated, or a rename would turn
        a stale writer into a winner that overwrites another agent's bytes."""
        fresh_ids, fresh_seen = fresh  # ids of fresh drafts and handles; fresh observed paths
        prefix = old + "/"
        for (a, path), d in list(self.content.drafts.items()):
            if a == agent and (path == old or path.startswith(prefix)):
                del self.content.drafts[(a, path)]
                self.content.reindex_draft(d, new + path[len(old):])
                if id(d) in fresh_ids:
                    d.base = self.versions.current_token(d.path)[0]
                self.content.drafts[(a, d.path)] = d
        for h in self.content.handles.values():
            if h.agent == agent and (h.path == old or h.path.startswith(prefix)):
                h.path = new + h.path[len(old):]
                if id(h) in fresh_ids:
                    h.token = self.versions.current_token(h.path)[0]
        seen = self.versions.observed.get(agent, {})
        outdated = {}
        for path in [p for p in seen if p == old or p.startswith(prefix)]:
            tok = seen.pop(path)
            if path not in fresh_seen:
                outdated[new + path[len(old):]] = tok  # never equal to a moved node's new token
        self.versions.observe(agent, new, self.versions.current_token(new)[0])
        seen = self.versions.observed[agent]
        seen.update(outdated)

    def _take_leaf(self, path: str) -> Node:
        """The published node of a file or symlink, copied up if needed.
        (Drafts are not published by a rename: they follow it and publish
        at their own close.)"""
        node = self.upper.get(path)
        if node is None:
            return self._node_for_meta(path)
        return node

    def _rename_leaf(self, old: str, new: str, agent: str) -> None:
        node = self._take_leaf(old)
        new_base = self.ns.base_for(new)
        if self.ns.exists(new):
            # Replacing a file the acting agent has open detaches its draft,
            # exactly as its own unlink would: its descriptors keep working
            # and their close succeeds (POSIX); other agents' drafts lose.
            self._remove(new, agent)
        else:
            self._unkey(agent, new)
        self.upper.pop(old)
        if node.link_group is not None:
            node.names.discard(old)
            node.name_bases.pop(old, None)
            node.names.add(new)
            node.name_bases[new] = new_base
        old_lower = self.ns.lower_stat(old) is not None
        if old_lower:
            self.upper.set(old, Node("whiteout", 0, base=node.base, ino=0))
        node.base = new_base
        node.ctime_ns = time.time_ns()
        self.versions.bump(node)
        self.upper.set(new, node)
        self._persist(puts=[new] + ([old] if old_lower else []), removes=[] if old_lower else [old])

    def _capture(self, top: str) -> list[tuple[str, Node]]:
        """The merged subtree at ``top`` as ``(suffix, node)`` pairs, files
        copied up as objects: what a move needs to restage it elsewhere
        (O(size of the subtree))."""
        subtree: list[tuple[str, Node]] = []
        todo = [""]
        while todo:
            suffix = todo.pop()
            path = top + suffix
            node, st = self.ns.resolve(path)
            if self.ns.kind(node, st) == "dir":
                moved = Node("dir", (node.mode if node else st.st_mode), base="", ino=(node.ino if node else st.st_ino),
                             opaque=True, mtime_ns=(node.mtime_ns if node else st.st_mtime_ns),
                             uid=(node.uid if node else st.st_uid), gid=(node.gid if node else st.st_gid))
                moved.xattrs = dict(node.xattrs) if node else self.ns.xattrs_of(path)
                subtree.append((suffix, moved))
                todo.extend(suffix + "/" + n for n, _k, _i in self.readdir(path)[2:])
            else:
                subtree.append((suffix, self._take_leaf(path)))
        return subtree

    def _place(self, dest: str, subtree: list[tuple[str, Node]]) -> list[str]:
        puts = []
        for suffix, node in subtree:
            path = dest + suffix
            node.base = self.ns.base_for(path)
            if node.link_group is not None:
                node.names.add(path)
                node.name_bases[path] = node.base
            node.ctime_ns = time.time_ns()
            self.versions.bump(node)
            self.upper.set(path, node)
            puts.append(path)
        return puts

    def _rename_dir(self, old: str, new: str) -> None:
        """Move a directory: every path below it is staged at its new place;
        the old place becomes a whiteout."""
        subtree = self._capture(old)
        if self.ns.exists(new):
            self._remove(new)
        self._remove(old)
        self._persist(puts=self._place(new, subtree))

    def _exchange(self, a: str, b: str, agent: str) -> None:
        """RENAME_EXCHANGE: swap two existing paths (of any kinds)."""
        if b.startswith(a + "/") or a.startswith(b + "/"):
            raise Invalid(b)
        sub_a, sub_b = self._capture(a), self._capture(b)
        self._remove(a)
        self._remove(b)
        self._persist(puts=self._place(b, sub_a) + self._place(a, sub_b))
        swap = {a: b, b: a}
        moved = [self.content.drafts.pop(key) for key in list(self.content.drafts) if key[0] == agent and key[1] in swap]
        for d in moved:
            self.content.reindex_draft(d, swap[d.path])
        for d in moved:
            d.base = self.versions.current_token(d.path)[0]
            self.content.drafts[(d.agent, d.path)] = d
        for h in self.content.handles.values():
            if h.agent == agent and h.path in swap:
                h.path = swap[h.path]
        self.versions.observe(agent, a, self.versions.current_token(a)[0])
        self.versions.observe(agent, b, self.versions.current_token(b)[0])

    def link(self, path: str, existing: str, agent: str = DEFAULT) -> None:
        """A hard link ``path`` to ``existing`` (anything but a directory).
        Both names share one node: edits through either are seen through both, and the
        commit publishes them as hard links.  Workspace files that were
        already hard links are copied up separately (the workspace link is not
        followed into the upper layer)."""
        with self.lock:
            self._check_new_name(path)
            self._check_writable(path)
            self._check_writable(existing)
            self.ns.require_dir(parent_name(path)[0])
            node, st = self.ns.resolve(existing)
            if self.ns.kind(node, st) not in publish.LEAF_KINDS:
                raise Unsupported(existing)  # a directory (the kernel refuses those first)
            if self.ns.exists(path):
                raise Exists(path)
            node = self._node_for_meta(existing)
            if node.link_group is None:
                node.link_group = next(self._link_groups)
                node.names = {existing}
                node.name_bases = {existing: node.base}
            node.name_bases[path] = self.ns.base_for(path)
            node.names.add(path)
            node.ctime_ns = time.time_ns()
            self.upper.set(path, node)
            self._persist(puts=[path])
            self.ns.entries_changed(path)
            self.links.invalidate_names(node, except_path=path)
            self.versions.observe(agent, path, self.versions.node_token(node))

    # -- the step ---------------------------------------------------------------

    def staged_paths(self) -> list[tuple[str, str]]:
        """``[(op, path)]`` with op A (added), M (modified) or D (deleted)."""
        with self.lock:
            out = []
            for path, node in sorted(self.upper.nodes.items()):
                if not node.staged:
                    continue
                if node.kind == "whiteout":
                    op = "D"
                elif node.base == tokens.ABSENT:
                    op = "A"
                else:
                    op = "M"
                out.append((op, path))
            return out

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
        return ViewCommit(self.commits, self._before_commit, self._after_commit, self.content.precaptured,
                          message=message, meta=meta, allow_empty=allow_empty, overwrite=overwrite)

    def _before_commit(self) -> tuple[list[str], list[str]]:
        """Under the lock, before the store plans: write the recorded rows
        (the commit reads them from the store) and give files staged by
        reference their objects.  Returns the unclosed nodes over staged
        rows and the staged paths."""
        self.sync_rows()
        if any(n.ref is not None for n in self.upper.nodes.values()):
            # Files staged by reference become objects first (the commit
            # would import them too, but the nodes must learn the oids).
            self._imported(publish.import_refs(self.ws, self.step))
        return self._unstaged_over_rows(), [p for p, n in self.upper.nodes.items() if n.staged]

    def _unstaged_over_rows(self) -> list[str]:
        """Paths of created-but-unclosed nodes that replaced a staged row (a
        file created where this step had staged a deletion): the commit
        publishes that row, under the unclosed node."""
        pending = [p for p, n in self.upper.nodes.items() if not n.staged]
        if not pending:
            return []
        with self.ws.db.read() as conn:
            rows = {view_path(r.path) for r in staging.load(conn, self.step)}
        return [p for p in pending if p in rows]

    def _after_commit(self, covered) -> None:
        """The workspace now holds every staged node: drop them, and carry
        tokens over so nobody's observation goes stale by our own commit.
        ``covered``: unclosed nodes whose path the commit changed underneath
        them; their base becomes the new workspace state, or their own
        commit would later be refused as a conflict with ours."""
        for path in covered:
            node = self.upper.get(path)
            if node is not None and not node.staged:
                node.base = self.ns.lower_token(path)
        self.scratch.unlink_retired()  # the commit consumed every staged row
        self.ns.nlink_cache.clear()
        self.ns.dir_times.clear()
        self.links.gone.clear()
        renamed: dict[str, tuple[str, str]] = {}  # path -> (old token, new token)
        for path in list(self.upper.nodes):
            node = self.upper.nodes[path]
            if not node.staged:
                continue  # created but not yet closed: not part of the layer
            old = self.versions.node_token(node)
            self.upper.pop(path)
            self.scratch.drop(node)
            new, st, _digest = self.versions.current_token(path)
            if st is not None and node.oid and tokens.is_racy(st, time.time_ns()):
                new = tokens.with_hash(new, node.oid.split(".", 1)[0])
            if st is not None and node.kind != "whiteout" and st.st_ino != node.ino:
                self.ns.ino_alias[(st.st_dev, st.st_ino)] = node.ino
            if st is not None and node.link_group is not None:
                self.links.shown_name(st, path)  # the kernel holds this name's attributes from the node
            renamed[path] = (old, new)
        for seen in self.versions.observed.values():
            for path, (old, new) in renamed.items():
                if seen.get(path) == old:
                    seen[path] = new
        for d in self.content.drafts.values():
            if d.path in renamed and d.base == renamed[d.path][0]:
                d.base = renamed[d.path][1]
                d.node_base = renamed[d.path][1].partition(tokens.HASH_SEP)[0]
        for h in self.content.handles.values():
            if h.path in renamed and h.token == renamed[h.path][0]:
                h.token = renamed[h.path][1]

    def discard(self, paths: list[str]) -> list[str]:
        """Drop staged paths (and everything below them) from the open step:
        the workspace shows through again.  Staged file bytes are kept as
        ``discarded`` conflict rows (``store.staging.discard``).  Drafts in
        use keep working and lose at their close (their version is gone)."""
        with self.lock:
            self._await_settled(writing=True)
            dropped: list[str] = []
            with self.ws.db.write() as conn:
                self.rows.write(conn)  # staging.discard reads the rows it drops
                oids = refs.import_refs(self.ws, conn, self.step)  # discarded bytes are kept as objects
                for path in paths:
                    dropped += [view_path(p) for p in staging.discard(conn, self.step, rel(path),
                                                                      mount=self.mountpoint)]
            self._imported(oids)
            self.rows.written()
            for path in dropped:
                node = self.upper.pop(path)
                if node is not None:
                    self.scratch.drop(node)
            self.forget(paths)
            return dropped

    def forget(self, paths: list[str]) -> None:
        """Drop what the view holds for ``paths`` (and below) after the
        workspace changed under it (a rollback): idle drafts and unstaged
        nodes go, so the workspace shows through.  Staged nodes stay: they
        are this mount's own changes, and committing them checks their base
        token against the new workspace state.  Drafts in use stay too, and
        their close fails with ESTALE (the path changed since they opened)."""
        with self.lock:
            self.ns.nlink_cache.clear()
            if self.links.held():
                # The link counts shown for names the kernel may hold change
                # (covered names show again, or the workspace's own changed).
                self.links.renew()
            targets = set()
            for path in paths:
                targets.add(path)
                targets.update(self.upper.below(path))
            for p in targets:
                node = self.upper.get(p)
                if node is None or node.staged or p in self.content.open_drafts:
                    continue
                self.upper.pop(p)
                self.scratch.drop(node)
            self.links.recount(self.ns.covered, self.ns.lower_stat)
            prefixes = tuple(p.rstrip("/") + "/" for p in paths)
            for d in list(self.content.drafts.values()):
                if d.opens == 0 and (d.path in targets or d.path.startswith(prefixes)):
                    self.content.discard_draft(d)

    def close(self) -> None:
        """Unmount: decide every open handle, then write the recorded rows
        (once a commit still completing has ended: the store closes next)."""
        self.settled.wait()
        with self.lock:
            self.content.close()
            self.rows.stop()
            try:
                self.sync_rows()
            except Exception:
                log.exception("writing %d staged rows at unmount failed; they are lost", len(self.rows.pending))
            if not self.rows.pending:
                self.scratch.unlink_retired()

    def status_text(self) -> str:
        """``MOUNT/.stepfs/status``: what an agent needs to know about itself."""
        return status_text(self.mountpoint, self.ws.path, self.step, self.readonly_reason, self.content.last_errors,
                           self.staged_paths())
