"""Namespace and metadata changes of the view: the upper layer's edits (FUSE-free).

mkdir, rmdir, unlink, symlink, mknod, rename (with ``RENAME_NOREPLACE`` and
``RENAME_EXCHANGE``), link, chmod, chown, utimens and ``user.*`` xattrs change
the upper layer in memory at once and record their staged rows
(:meth:`Changes.persist`; ``rows.py`` says when they reach the store).
Files are copied up for a metadata change as an object, without a scratch
file (:meth:`Changes.node_for_meta`).  The acting agent's drafts, handles
and observations follow its own renames and removals (``content.py``);
other agents' stay where they were and lose at their close.

Hard links made in the mount share one node: edits through either name are
seen through both, and the commit publishes them as hard links.  Workspace
files that were already hard links are copied up separately.

Caveats: mtime-only changes (``touch`` of an unchanged file) are shown in
the mount but not committed.

Lock rule: every public method takes the view's lock (``lock``).
"""

from __future__ import annotations

import itertools
import os
import stat as stat_mod
import time
from typing import Callable

from stepfs.store import publish, tokens
from stepfs.store import xattrs as xattr_codec
from stepfs.store.contained import NODE_KINDS, kind_of, rdev_target

from stepfs.overlayfs.core.agents import DEFAULT
from stepfs.overlayfs.core.committing import Failsafe
from stepfs.overlayfs.core.content import Content
from stepfs.overlayfs.core.errors import (
    Exists, Invalid, IsADirectory, NoAttribute, NotADirectory, NotEmpty, NotSupported, Unsupported,
)
from stepfs.overlayfs.core.links import Links
from stepfs.overlayfs.core.namespace import Namespace, check_new_name
from stepfs.overlayfs.core.rows import StagedRows
from stepfs.overlayfs.core.scratch import ScratchFiles
from stepfs.overlayfs.core.upper import Node, parent_name, rel
from stepfs.overlayfs.core.versions import Versions

# libfuse's high-level API renames a file that is unlinked while open to
# ".fuse_hidden<N>" and unlinks that name at the last release; the view keeps
# such files out of the namespace (never listed, staged or committed).
HIDDEN_PREFIX = ".fuse_hidden"
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
XATTR_CREATE, XATTR_REPLACE = 1, 2
# libfuse3 passes utimensat's UTIME_NOW / UTIME_OMIT through as the
# nanosecond field with zero seconds.
UTIME_NOW = (1 << 30) - 1
UTIME_OMIT = (1 << 30) - 2


def removal_time() -> int:
    """When a path is removed, as a whiteout's ``mtime_ns``: the fine
    ``CLOCK_REALTIME``, never earlier than any ``ctime`` the kernel stamped
    before the removal (since Linux 6.13 a ``ctime`` may be fine-grained, so
    the coarse clock could read earlier than a change it followed and make
    the commit's own earlier publish look like an outside change).  A name
    changed outside after the removal has a ``ctime`` later than this,
    except within the removal's own coarse clock tick (``store.plan``)."""
    return time.time_ns()


class Changes:
    """Edits of the upper layer.  Receives the view's ``lock``, the
    collaborators it changes or reads (``ns``, ``versions``, ``content``,
    ``rows``, ``links``, ``scratch``), the ``failsafe`` whose refusals it applies, the
    workspace ``ws`` (objects for copy-up), ``changed()`` (an auto-step
    policy is told of every staged change) and the first free link group
    number of the step's rows."""

    def __init__(self, *, ws, lock, ns: Namespace, versions: Versions, content: Content, rows: StagedRows,
                 links: Links, scratch: ScratchFiles, failsafe: Failsafe, changed: Callable[[], None],
                 first_link_group: int):
        self.ws, self.lock = ws, lock
        self.ns, self.versions, self.content, self.rows, self.links = ns, versions, content, rows, links
        self.scratch = scratch
        self.failsafe = failsafe
        self._changed = changed
        self._link_groups = itertools.count(first_link_group)

    def persist(self, puts: list[str] = (), removes: list[str] = (), trees: list[str] = (),
                subdirs_kept: bool = False) -> None:
        """Record the rows of ``puts`` (by their current nodes), the deletion
        of the rows of ``removes`` and of everything below ``trees``; they
        reach the store at the next flush (module doc).  ``subdirs_kept``:
        the change removed a non-directory, so no directory's count of
        subdirectories changed."""
        # A directory's link count counts its subdirectories: only a
        # directory or a removal changes it.  Keeping the counts through
        # the changes of files spares a listing of the parent at each
        # GETATTR after them (a tar sets three attributes per file; the
        # kernel asks for the parent's before each unlink of an rm -rf).
        nodes = self.ns.upper.nodes
        if not subdirs_kept and (removes or trees or any(nodes[p].kind in ("dir", "whiteout") for p in puts)):
            self.ns.nlink_cache.clear()
        self._changed()
        pending = self.rows.pending
        for path in trees:
            pending.remove_tree(rel(path))
        for path in removes:
            pending.remove(rel(path))
        for path in puts:
            node = self.ns.upper.nodes[path]
            for name in (node.names if node.link_group is not None else (path,)):
                pending.put(node.row(name))
            node.staged = True
        self.rows.recorded()

    def node_for_meta(self, path: str) -> Node:
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
            fd = self.ns.root.open(rel(path), os.O_RDONLY | os.O_DIRECTORY)
            try:
                attrs = xattr_codec.read_fd(fd)
            finally:
                os.close(fd)
        elif kind in NODE_KINDS:
            node = Node(kind, st.st_mode, base=base, ino=st.st_ino, mtime_ns=st.st_mtime_ns, uid=st.st_uid,
                        gid=st.st_gid, target=rdev_target(kind, st.st_rdev))
        elif kind == "symlink":
            node = Node("symlink", st.st_mode, base=base, ino=st.st_ino, target=self.ns.root.readlink(rel(path)),
                        size=st.st_size, mtime_ns=st.st_mtime_ns, uid=st.st_uid, gid=st.st_gid)
        elif kind == "file":
            fd = self.ns.root.open(rel(path), os.O_RDONLY | os.O_NOFOLLOW)
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
        self.ns.upper.set(path, node)
        digest = node.oid.split(".", 1)[0] if node.oid else ""
        self.content.retoken(path, base, self.versions.node_token(node), lambda: digest)
        return node

    def remove(self, path: str, agent: str | None = None,
               resolved: tuple[Node | None, os.stat_result | None] | None = None) -> None:
        """Make ``path`` (and everything below it) absent in the view.  The
        acting agent's own drafts there are detached (its open descriptors
        keep working, POSIX-style); other agents' drafts lose at their close.
        ``resolved``: what ``ns.resolve(path)`` just answered under this
        hold of the lock (a workspace path's ``lstat`` then serves for its
        base token and its whiteout: three ``lstat`` fewer per unlink)."""
        lower_st = resolved[1] if resolved is not None and resolved[0] is None else None
        if agent is not None:
            # A name of a hard-linked file: the file lives on under another
            # name, and so does the agent's draft of it (writes through an
            # open descriptor reach the remaining names).
            here = self.ns.upper.get(path)
            heir = min((n for n in here.names if n != path), default=None) \
                if here is not None and here.link_group is not None else None
            # Only a directory has drafts below it to look for among all.
            subtree = here.kind == "dir" if here is not None else \
                lower_st is None or stat_mod.S_ISDIR(lower_st.st_mode)
            self.content.removed(agent, path, heir, subtree)
        node = self.ns.upper.get(path)
        if node is None:
            lower = lower_st if lower_st is not None else self.ns.lower_stat(path)
            base = self.ns.lower_token(path, lower)
            if lower is not None:
                self.links.name_gone(lower, path)
        else:
            base = node.base
        removed = node.removed_at(path) if node is not None else None
        kind = node.kind if node is not None else kind_of(lower.st_mode) if lower is not None else None
        below = self.ns.upper.below(path)
        for child in below:
            self._detach(child, self.ns.upper.pop(child))
        self._detach(path, self.ns.upper.pop(path))
        # Nothing above touched the workspace: a workspace path's stat
        # taken above still says whether it needs a whiteout.
        if (lower if node is None else self.ns.lower_stat(path)) is not None:
            whiteout = Node("whiteout", 0, base=base, ino=0, mtime_ns=removal_time())
            whiteout.mark_removed(path, removed)  # hidden since an earlier removal: that one counts
            self.ns.upper.set(path, whiteout)
            self.persist(puts=[path], trees=[path] if below else [], subdirs_kept=kind not in (None, "dir"))
        else:
            self.persist(trees=[path], subdirs_kept=kind not in (None, "dir"))

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
                self.persist(puts=[next(iter(node.names))])  # their link count changed
                self.links.invalidate_names(node)
                return
        self.scratch.drop(node)

    def chmod(self, path: str, mode: int) -> None:
        with self.lock:
            if path in self.content.hidden:
                return
            self.failsafe.check_writable(path)
            node = self.node_for_meta(path)
            node.mode = stat_mod.S_IFMT(node.mode) | stat_mod.S_IMODE(mode)
            node.ctime_ns = time.time_ns()
            self.persist(puts=[path])
            self.content.sync_draft_meta(path, node)
            self.links.invalidate_names(node, except_path=path)

    def chown(self, path: str, uid: int, gid: int) -> None:
        with self.lock:
            self.failsafe.check_writable(path)
            node = self.node_for_meta(path)
            if uid != -1:
                node.uid = uid
            if gid != -1:
                node.gid = gid
            node.ctime_ns = time.time_ns()
            self.persist(puts=[path])
            self.content.sync_draft_meta(path, node)
            self.links.invalidate_names(node, except_path=path)

    @staticmethod
    def _xattr_name(name: str) -> bytes:
        raw = os.fsencode(name)
        if not raw.startswith(xattr_codec.PREFIX):
            raise NotSupported(name)
        return raw

    def setxattr(self, path: str, name: str, value: bytes, options: int = 0) -> None:
        with self.lock:
            self.failsafe.check_writable(path)
            raw = self._xattr_name(name)
            node = self.node_for_meta(path)
            if node.kind not in ("file", "dir"):
                raise Unsupported(path)  # Linux allows user.* only on files and directories
            if options & XATTR_CREATE and raw in node.xattrs:
                raise Exists(name)
            if options & XATTR_REPLACE and raw not in node.xattrs:
                raise NoAttribute(name)
            node.xattrs[raw] = bytes(value)
            node.ctime_ns = time.time_ns()
            self.persist(puts=[path])
            self.content.sync_draft_meta(path, node)

    def removexattr(self, path: str, name: str) -> None:
        with self.lock:
            self.failsafe.check_writable(path)
            raw = self._xattr_name(name)
            if raw not in self.ns.xattrs_of(path):
                raise NoAttribute(name)
            node = self.node_for_meta(path)
            del node.xattrs[raw]
            node.ctime_ns = time.time_ns()
            self.persist(puts=[path])
            self.content.sync_draft_meta(path, node)

    def utimens(self, path: str, times: tuple[int, int] | None) -> None:
        """``times`` in ns; libfuse3 passes UTIME_NOW / UTIME_OMIT through as
        the nanosecond field with zero seconds."""
        with self.lock:
            if path in self.content.hidden:
                return
            self.failsafe.check_writable(path)
            node = self.node_for_meta(path)
            now = time.time_ns()
            atime, mtime = times if times is not None else (UTIME_NOW, UTIME_NOW)
            new_a = node.atime_ns if atime == UTIME_OMIT else now if atime == UTIME_NOW else atime
            new_m = node.mtime_ns if mtime == UTIME_OMIT else now if mtime == UTIME_NOW else mtime
            # Open drafts of the path carry the times their handles report.
            for d in self.content.drafts_at(path):
                # A memory draft through the memfd it holds: the same file,
                # without two path walks through /proc/self/fd.
                f = d.mem if d.mem >= 0 else d.scratch
                st = os.stat(f)
                os.utime(f, ns=(st.st_atime_ns if atime == UTIME_OMIT else new_a,
                                        st.st_mtime_ns if mtime == UTIME_OMIT else new_m))
            node.atime_ns, node.mtime_ns, node.ctime_ns = new_a, new_m, now
            self.persist(puts=[path])
            self.links.invalidate_names(node, except_path=path)

    def _check_create(self, path: str) -> None:
        """What every new name needs: a legal name, a writable mount, an
        existing parent directory, and nothing there yet."""
        check_new_name(path)
        self.failsafe.check_writable(path)
        self.ns.require_dir(parent_name(path)[0])
        if self.ns.exists(path):
            raise Exists(path)

    def _add_new(self, path: str, node: Node, owner: tuple[int, int] | None, agent: str) -> None:
        """Stage a node made for a new name (directory, symlink, FIFO)."""
        node.uid, node.gid = owner if owner is not None else (os.getuid(), os.getgid())
        self.ns.inherit_group(path, node)
        self.versions.bump(node)
        self.ns.upper.set(path, node)
        self.persist(puts=[path])
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
            self.failsafe.check_writable(path)
            if path == "/":
                raise Invalid(path)
            node, st = self.ns.resolve(path)
            if self.ns.kind(node, st) != "dir":
                raise NotADirectory(path)
            if not self.ns.is_empty_dir(path):
                raise NotEmpty(path)
            self.remove(path, agent, (node, st))
            self.ns.entries_changed(path)

    def unlink(self, path: str, agent: str = DEFAULT) -> None:
        with self.lock:
            if self.content.hidden.pop(path, None) is not None:
                return
            self.failsafe.check_writable(path)
            node, st = self.ns.resolve(path)
            if self.ns.kind(node, st) == "dir":
                raise IsADirectory(path)
            self.remove(path, agent, (node, st))
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
                fh = self.content.create(path, mode, os.O_WRONLY | os.O_EXCL, owner=owner, agent=agent)
                try:
                    self.content.flush(fh)
                finally:
                    self.content.release(fh)
                return
            kind = kind_of(mode)
            if kind not in NODE_KINDS:
                raise Unsupported(path)
            self._check_create(path)
            node = Node(kind, NODE_KINDS[kind] | stat_mod.S_IMODE(mode), base=self.ns.base_for(path),
                        ino=self.ns.new_ino(), target=rdev_target(kind, dev))
            self._add_new(path, node, owner, agent)

    def rename(self, old: str, new: str, flags: int = 0, agent: str = DEFAULT) -> None:
        with self.lock, self.rows.one_change():
            if parent_name(new)[1].startswith(HIDDEN_PREFIX):
                return self._hide(old, new, agent)
            self.failsafe.check_writable(old)
            self.failsafe.check_writable(new)
            check_new_name(new)
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
                fresh = self.content.fresh_under(agent, old)
                self.content.unkey(agent, new)
                self._rename_dir(old, new)
            else:
                if dst_kind == "dir":
                    raise IsADirectory(new)
                if src_kind == "special":
                    raise Unsupported(old)  # sockets and devices stay where they are
                fresh = self.content.fresh_under(agent, old, subtree=False)
                self._rename_leaf(old, new, agent)
            self.content.moved(agent, old, new, fresh, subtree=src_kind == "dir")
            self.ns.entries_changed(old, new)

    def _hide(self, old: str, new: str, agent: str) -> None:
        """An unlink of an open file (libfuse's hidden rename): the path is
        removed as by ``unlink``; open descriptors keep working under the
        hidden name, which reports ``st_nlink`` 0 -- or, for a hard-linked
        file, the names it still has."""
        node, st = self.ns.resolve(old)
        attrs = self.ns.stat_node(node) if node is not None else self.ns.stat_lower(old, st)
        d = self.content.draft_of(agent, old)
        self.unlink(old, agent)
        # libfuse subtracts one from the st_nlink of a hidden name it is given
        # (a positive one): the names left, plus one.
        attrs["st_nlink"] = len(node.names) + 1 if node is not None and node.link_group is not None else 0
        self.content.hide(old, new, d, attrs)

    def _take_leaf(self, path: str) -> Node:
        """The published node of a file or symlink, copied up if needed.
        (Drafts are not published by a rename: they follow it and publish
        at their own close.)"""
        node = self.ns.upper.get(path)
        if node is None:
            return self.node_for_meta(path)
        return node

    def _rename_leaf(self, old: str, new: str, agent: str) -> None:
        node = self._take_leaf(old)
        new_base = self.ns.base_for(new)
        if self.ns.exists(new):
            # Replacing a file the acting agent has open detaches its draft,
            # exactly as its own unlink would: its descriptors keep working
            # and their close succeeds (POSIX); other agents' drafts lose.
            self.remove(new, agent)
        else:
            self.content.unkey(agent, new, subtree=False)  # a file goes there: nothing can be below it
        self.ns.upper.pop(old)
        if node.link_group is not None:
            node.names.discard(old)
            node.name_bases.pop(old, None)
            node.names.add(new)
            node.name_bases[new] = new_base
        old_lower = self.ns.lower_stat(old) is not None
        if old_lower:
            whiteout = Node("whiteout", 0, base=node.base, ino=0, mtime_ns=removal_time())
            whiteout.mark_removed(old, node.removed_at(old))
            self.ns.upper.set(old, whiteout)
        node.base = new_base
        node.ctime_ns = time.time_ns()
        self.versions.bump(node)
        self.ns.upper.set(new, node)
        self.persist(puts=[new] + ([old] if old_lower else []), removes=[] if old_lower else [old])

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
                todo.extend(suffix + "/" + n for n, _k, _i in self.ns.listing(path)[2:])
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
            self.ns.upper.set(path, node)
            puts.append(path)
        return puts

    def _rename_dir(self, old: str, new: str) -> None:
        """Move a directory: every path below it is staged at its new place;
        the old place becomes a whiteout."""
        subtree = self._capture(old)
        if self.ns.exists(new):
            self.remove(new)
        self.remove(old)
        self.persist(puts=self._place(new, subtree))

    def _exchange(self, a: str, b: str, agent: str) -> None:
        """RENAME_EXCHANGE: swap two existing paths (of any kinds)."""
        if b.startswith(a + "/") or a.startswith(b + "/"):
            raise Invalid(b)
        sub_a, sub_b = self._capture(a), self._capture(b)
        self.remove(a)
        self.remove(b)
        self.persist(puts=self._place(b, sub_a) + self._place(a, sub_b))
        self.content.exchanged(agent, a, b)

    def link(self, path: str, existing: str, agent: str = DEFAULT) -> None:
        """A hard link ``path`` to ``existing`` (anything but a directory).
        Both names share one node: edits through either are seen through both, and the
        commit publishes them as hard links.  Workspace files that were
        already hard links are copied up separately (the workspace link is not
        followed into the upper layer)."""
        with self.lock:
            check_new_name(path)
            self.failsafe.check_writable(path)
            self.failsafe.check_writable(existing)
            self.ns.require_dir(parent_name(path)[0])
            node, st = self.ns.resolve(existing)
            if self.ns.kind(node, st) not in publish.LEAF_KINDS:
                raise Unsupported(existing)  # a directory (the kernel refuses those first)
            if self.ns.exists(path):
                raise Exists(path)
            node = self.node_for_meta(existing)
            if node.link_group is None:
                node.link_group = next(self._link_groups)
                node.names = {existing}
                node.name_bases = {existing: node.base}
            node.name_bases[path] = self.ns.base_for(path)
            node.names.add(path)
            node.ctime_ns = time.time_ns()
            self.ns.upper.set(path, node)
            self.persist(puts=[path])
            self.ns.entries_changed(path)
            self.links.invalidate_names(node, except_path=path)
            self.versions.observe(agent, path, self.versions.node_token(node))
