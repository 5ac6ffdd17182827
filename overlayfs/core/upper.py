"""The upper layer of a mount: staged nodes in memory (FUSE-free).

:class:`Upper` maps view paths (``"/a/b"``, surrogate-escaped ``str`` as
FUSE hands them over) to :class:`Node` objects, and keeps a parent -> names
index so a directory listing costs what that directory holds.  A node is one
of: a file (its published content as an object id; drafts being written
live in ``drafts.Draft``), a directory (``opaque`` hides the workspace directory
of the same path), a symlink, a FIFO, a device node (its number in
``target``, as in the store), a socket, or a whiteout (the path is deleted).

Invariants:

* A node with ``staged`` true has a row in the store's ``staged`` table equal
  to :meth:`Node.row`, or that row is waiting in the view's
  :class:`rows.PendingRows` (written at the next flush).
* ``base`` is the workspace token of the path when this step first touched
  it; a commit checks it again.
* Lock rule: an ``Upper`` is only touched under the owning view's lock.
"""

from __future__ import annotations

import os
import stat as stat_mod
import time


from stepfs.store import xattrs as xattr_codec
from stepfs.store.contained import NODE_KINDS
from stepfs.store.staging import StagedRow


#: File type bits of each node kind (a whiteout has none).
_TYPE_BITS = {"file": stat_mod.S_IFREG, "dir": stat_mod.S_IFDIR, "symlink": stat_mod.S_IFLNK, **NODE_KINDS}


def rel(path: str) -> bytes:
    """View path -> store path (``"/a/b"`` -> ``b"a/b"``)."""
    return os.fsencode(path.lstrip("/"))


def view_path(p: bytes) -> str:
    return "/" + os.fsdecode(p)


def parent_name(path: str) -> tuple[str, str]:
    head, _, name = path.rpartition("/")
    return head or "/", name


class Node:
    """A staged path.  Times are integer nanoseconds."""

    __slots__ = (
        "kind", "mode", "size", "mtime_ns", "atime_ns", "ctime_ns", "oid", "target", "opaque",
        "base", "scratch", "ref", "ref_sum", "ino", "uid", "gid", "staged", "gen", "xattrs", "link_group", "names",
        "name_bases", "removed",
    )

    def __init__(self, kind: str, mode: int = 0, *, base: str, ino: int, size: int = 0, oid: str | None = None,
                 target: bytes | None = None, opaque: bool = False, mtime_ns: int | None = None,
                 uid: int = 0, gid: int = 0):
        now = mtime_ns if mtime_ns is not None else time.time_ns()
        self.kind = kind
        self.mode = mode
        self.size = size
        self.mtime_ns = now
        self.atime_ns = now
        self.ctime_ns = now
        self.oid = oid
        self.target = target
        self.opaque = opaque
        self.base = base
        # An immutable cache of the published content (files only): replaced,
        # never rewritten, on each publish, so open readers keep a snapshot.
        self.scratch: str | None = None
        # Staged by reference (store/refs.py): ``scratch`` is then the content
        # itself, ``ref`` its name in the staged row and ``ref_sum`` its sum;
        # ``oid`` is None.  Such a file is never written again, and removed
        # only once no staged row in the store names it (view.py).
        self.ref: str | None = None
        self.ref_sum: str | None = None
        self.ino = ino
        self.uid = uid
        self.gid = gid
        self.staged = False  # a row exists in the store
        self.gen = 0  # bumped on every change; part of the version token
        self.xattrs: dict[bytes, bytes] = {}  # user.* only
        # Hard links made in the mount: one Node under several paths.
        # ``names`` is kept only for such nodes (link_group is not None).
        self.link_group: int | None = None
        self.names: set[str] = set()
        self.name_bases: dict[str, str] = {}  # workspace token per name (commit check)
        # A name this node took over from a whiteout: when the step first
        # removed what the workspace has there (``store.plan`` spares what
        # was made below it outside since).  None for most nodes.
        self.removed: dict[str, int] | None = None

    def removed_at(self, path: str) -> int | None:
        """When the step first removed workspace path ``path``, if this node
        stands there in its place (a whiteout: its own time)."""
        if self.kind == "whiteout":
            return self.mtime_ns
        return self.removed.get(path) if self.removed else None

    def mark_removed(self, path: str, when: int | None) -> None:
        """``path`` was removed at ``when`` before this node took it (the
        earliest removal holds: the workspace's content stayed hidden)."""
        if when is None:
            return
        if self.kind == "whiteout":
            self.mtime_ns = min(self.mtime_ns, when)
            return
        if self.removed is None:
            self.removed = {}
        self.removed[path] = min(self.removed.get(path, when), when)

    def row(self, path: str, store_path: bytes | None = None) -> StagedRow:
        """The staged row of this node under ``path`` (``store_path``: its
        ``rel(path)``, when the caller has it already)."""
        # Positional, in StagedRow's field order: keywords cost as much
        # again, and every small close builds one.
        return StagedRow(
            rel(path) if store_path is None else store_path, self.kind, self.mode, self.oid, self.target,
            self.size, self.mtime_ns, self.opaque, self.name_bases.get(path, self.base),
            self.uid, self.gid, xattr_codec.encode(self.xattrs) if self.xattrs else None, self.link_group,
            self.ref, self.ref_sum,
            self.removed.get(path) if self.removed and self.kind != "whiteout" else None,
        )

    @classmethod
    def from_row(cls, row: StagedRow, ino: int) -> "Node":
        node = cls(row.kind, row.mode, base=row.base, ino=ino, size=row.size, oid=row.oid,
                   target=row.target, opaque=row.opaque, mtime_ns=row.mtime_ns or None,
                   uid=os.getuid() if row.uid is None else row.uid, gid=os.getgid() if row.gid is None else row.gid)
        node.xattrs = xattr_codec.decode(row.xattrs)
        node.link_group = row.link_group
        node.ref, node.ref_sum = row.scratch, row.scratch_sum
        node.staged = True
        return node

    @property
    def nlink(self) -> int:
        return len(self.names) if self.link_group is not None else 1

    @property
    def type_bits(self) -> int:
        return _TYPE_BITS.get(self.kind, 0)


class Upper:
    """Path -> Node, plus a children index.  Not thread-safe (see module doc).

    ``children[d]`` holds the names below ``d`` that are nodes *or lead to
    nodes*: a staged ``/d/e/f`` under unchanged workspace directories puts
    ``e`` into ``children["/d"]`` although ``/d/e`` has no node, so that
    :meth:`below` finds every node of a subtree.  Invariant: a path is in
    its parent's set exactly while it is a node or has an entry in
    ``children`` itself.
    """

    def __init__(self) -> None:
        self.nodes: dict[str, Node] = {}
        self.children: dict[str, set[str]] = {}

    def get(self, path: str) -> Node | None:
        return self.nodes.get(path)

    def set(self, path: str, node: Node) -> None:
        old = self.nodes.get(path)
        if old is None:
            self._link(path)
        elif old is not node:
            node.mark_removed(path, old.removed_at(path))  # a whiteout (or what replaced one) taken over
        self.nodes[path] = node

    def pop(self, path: str) -> Node | None:
        node = self.nodes.pop(path, None)
        if node is not None:
            self._unlink(path)
        return node

    def _link(self, path: str) -> None:
        """Enter ``path`` and its ancestors into the index (O(depth))."""
        while path != "/":
            parent, name = parent_name(path)
            names = self.children.setdefault(parent, set())
            if name in names:
                return
            names.add(name)
            path = parent

    def _unlink(self, path: str) -> None:
        """Drop ``path``, then each ancestor that no longer leads to a node."""
        while path != "/" and path not in self.nodes and path not in self.children:
            parent, name = parent_name(path)
            names = self.children.get(parent)
            if names is None:
                return
            names.discard(name)
            if names:
                return
            del self.children[parent]
            path = parent

    def below(self, path: str) -> list[str]:
        """Every node path strictly below ``path`` (parents before children)."""
        out, todo = [], [path]
        while todo:
            d = todo.pop()
            for name in self.children.get(d, ()):
                child = (d if d != "/" else "") + "/" + name
                if child in self.nodes:
                    out.append(child)
                todo.append(child)
        return out

    def child_names(self, path: str) -> set[str]:
        """Names below ``path`` that are nodes or lead to nodes (callers
        skip the names that are not in :attr:`nodes`)."""
        return self.children.get(path, set())

    def __len__(self) -> int:
        return len(self.nodes)
