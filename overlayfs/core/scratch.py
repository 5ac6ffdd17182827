"""Scratch files of one open step: their names, their content and when
they go (FUSE-free).

A scratch file (``.stepfs/scratch/<step>/<n>``) holds a draft's bytes, a
cached copy of a staged file's object, or -- for a big file staged by
reference (``store/refs.py``) -- the staged content itself.  Such a file is
never written again and is removed only once no staged row in the store
names it: a node that leaves the tree is *retired* and its file goes at the
next write of rows between operations (:meth:`ScratchFiles.unlink_retired`).
A daemon start keeps the referenced files and removes the other leftovers.

Lock rule: called only under the view's lock.
"""

from __future__ import annotations

import itertools
import os
from typing import Callable

from stepfs.store import refs

from stepfs.overlayfs.core.upper import Node, Upper


class ScratchFiles:
    """``kept``: names staged rows reference (kept at start, everything
    else in the directory goes); ``upper``: the view's upper layer (a
    retired node back in it keeps its file); ``db``/``objects``: where
    staged content is read from; ``release(path)``: called before a file
    is removed, so open drafts on it can move to a copy first."""

    def __init__(self, store_dir: str, step: int, kept: set[str], upper: Upper, db, objects,
                 release: Callable[[str], None]):
        self.dir = refs.scratch_dir(store_dir, step)
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        # Leftovers of a dead daemon go, except the files staged rows
        # reference (big files staged by reference: their only copy).
        for name in os.listdir(self.dir):
            if name not in kept:
                os.unlink(os.path.join(self.dir, name))
        self._seq = itertools.count(max((int(n) for n in kept if n.isdigit()), default=0) + 1)
        self.upper, self.db, self.objects = upper, db, objects
        self._release = release
        self._retired: list[Node] = []
        #: ``held(oid)``: the bytes of a content not stored yet (a recorded
        #: close-write, ``rows.StagedRows.content_of``), else None.
        self.held: Callable[[str], bytes | None] = lambda oid: None

    def path(self, name: str) -> str:
        return os.path.join(self.dir, name)

    def new(self) -> str:
        """A fresh name (the file is not created here)."""
        return os.path.join(self.dir, str(next(self._seq)))

    def fill(self, fd: int, node: Node) -> None:
        """Write staged file ``node``'s content (its object) into the empty
        file ``fd``, with the node's times."""
        data = self.held(node.oid) if node.oid is not None else None
        if data is not None:
            os.pwrite(fd, data, 0)
        elif node.oid is not None:
            with self.db.read() as conn:
                self.objects.write_to_fd(conn, node.oid, fd)  # CorruptObject: never served
        os.utime(fd, ns=(node.atime_ns, node.mtime_ns))

    def content(self, node: Node) -> bytes:
        """Staged file ``node``'s content (its object, or its bytes not
        stored yet)."""
        if node.oid is None:
            return b""
        data = self.held(node.oid)
        if data is None:
            with self.db.read() as conn:
                data = self.objects.read_all(conn, node.oid)
        return data

    def materialize(self, node: Node) -> None:
        """Give a staged file node a scratch file holding its content."""
        if node.scratch is not None:
            return
        path = self.new()
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            self.fill(fd, node)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        node.scratch = path

    def drop(self, node: Node) -> None:
        """The node leaves the tree, or its cache is no longer wanted.  A
        file it holds by reference is its content: the node keeps it (it
        may be placed again), and the file is removed after the next write
        of staged rows if no node in the tree holds it then (until then the
        store still names it: a crash must find it)."""
        if node.scratch is None:
            return
        if node.ref is not None:
            self._retired.append(node)
            return
        self.unlink(node.scratch)
        node.scratch = None

    def unlink_retired(self) -> None:
        """Remove the retired by-reference files whose node is not in the
        tree.  Call only between operations (inside one, a node may be out
        of the tree on its way to another place: a directory rename or an
        exchange takes nodes out, writes rows, and places them again) and
        when the store's rows show the tree as it is, or were consumed."""
        retired, self._retired = self._retired, []
        if not retired:
            return
        live = {id(n) for n in self.upper.nodes.values()}
        for node in retired:
            if id(node) not in live and node.scratch is not None and node.ref is not None:
                self.unlink(node.scratch)
                node.scratch = None  # its open readers stat it by size

    def unlink(self, path: str) -> None:
        """Remove a scratch file (open drafts on it move to a copy first)."""
        self._release(path)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
