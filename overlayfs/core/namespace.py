"""The merged namespace of one mount: lookup and attributes (FUSE-free).

Lookup precedence for a path ``p``:

1. an upper node at ``p`` wins (a whiteout means "absent");
2. otherwise, if an ancestor of ``p`` is a whiteout, a non-directory, or an
   opaque directory in the upper layer, ``p`` is absent;
3. otherwise the workspace decides (``store.contained.Root``: no symlink
   followed, nothing outside the workspace, never ``.stepfs``).

:class:`Namespace` answers what a path is, lists directories and builds
the attributes shown for workspace files and upper nodes; it changes
nothing but its caches and the directory times it is told of.

Lock rule: called only under the view's lock.
"""

from __future__ import annotations

import errno
import itertools
import os
import stat as stat_mod
import time

import xxhash

from stepfs.store import tokens
from stepfs.store import xattrs as xattr_codec
from stepfs.store.contained import DEVICE_KINDS, Root, kind_of, rdev_of

from stepfs.overlayfs.core.dirhandles import DirHandles
from stepfs.overlayfs.core.errors import NameTooLong, NotADirectory, NotFound, Reserved
from stepfs.overlayfs.core.links import Links
from stepfs.overlayfs.core.listings import Listings
from stepfs.overlayfs.core.metatree import ROOT as META_ROOT
from stepfs.overlayfs.core.upper import Node, Upper, parent_name, rel


# Inode numbers for paths that exist only in the upper layer; far above what
# real filesystems hand out so they do not collide with workspace inodes.
SYNTHETIC_INO_BASE = 1 << 62


def fd_digest(fd: int) -> str:
    """XXH3-128 (hex) of the whole content of ``fd``, read with ``pread``."""
    h = xxhash.xxh3_128()
    off = 0
    while True:
        data = os.pread(fd, 1 << 20, off)
        if not data:
            return h.hexdigest()
        h.update(data)
        off += len(data)


def check_new_name(path: str) -> None:
    """A name a change may create: checked before the failsafe's refusal,
    so that creating ``/.stepfs`` itself is Reserved (EEXIST) while
    anything below it is ReadOnly."""
    if path == META_ROOT:
        raise Reserved(path)
    if len(os.fsencode(parent_name(path)[1])) > 255:
        raise NameTooLong(path)


class Namespace:
    """``root``: the workspace; ``upper``: the open step's nodes; ``links``:
    link counts shown for multi-link workspace files."""

    def __init__(self, root: Root, upper: Upper, links: Links):
        self.root, self.upper, self.links = root, upper, links
        #: Kept workspace directory descriptors: a lookup's ``fstatat`` (started by the daemon).
        self.dirs = DirHandles(root)
        self.root_dev = os.fstat(root.fd).st_dev
        self.listings = Listings(root)  # workspace directory listings
        #: Inode numbers stay stable for the life of the mount: a committed
        #: path keeps the number the view showed, though the workspace file
        #: behind it is new.  (dev, workspace ino) -> ino shown.
        self.ino_alias: dict[tuple[int, int], int] = {}
        #: Directory -> 2 + subdirectories, for directories the step changed;
        #: cleared at every namespace change.
        self.nlink_cache: dict[str, tuple[int, int]] = {}
        #: Workspace directory -> when the view last changed its entries
        #: (ns): shown as its mtime and ctime (:meth:`entries_changed`).
        self.dir_times: dict[str, int] = {}
        self._ino = itertools.count(SYNTHETIC_INO_BASE)

    def new_ino(self) -> int:
        """An inode number for a path only the upper layer has."""
        return next(self._ino)

    def resolve(self, path: str) -> tuple[Node | None, os.stat_result | None]:
        """``(node, None)`` for an upper path, ``(None, stat)`` for a workspace
        path; raises NotFound."""
        nodes = self.upper.nodes
        if nodes:
            node = nodes.get(path)
            if node is not None:
                if node.kind == "whiteout":
                    raise NotFound(path)
                return node, None
            if path != "/" and self.children_covered(path.rpartition("/")[0] or "/"):
                raise NotFound(path)  # below a file, a whiteout or an opaque directory
        if path == "/":
            return None, os.stat(self.root.fd)
        try:
            st = self.dirs.lstat(path)
        except (FileNotFoundError, NotADirectoryError):
            raise NotFound(path) from None
        if st is not None:
            return None, st
        try:
            return None, self.root.lstat(rel(path))
        except (FileNotFoundError, NotADirectoryError):
            raise NotFound(path) from None
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.EXDEV):
                raise NotFound(path) from None  # a symlink swapped in from outside
            raise

    def exists(self, path: str) -> bool:
        try:
            self.resolve(path)
            return True
        except NotFound:
            return False

    def kind(self, node: Node | None, st: os.stat_result | None) -> str:
        return node.kind if node is not None else kind_of(st.st_mode)

    def require_dir(self, path: str) -> None:
        node, st = self.resolve(path)
        if self.kind(node, st) != "dir":
            raise NotADirectory(path)

    def lower_stat(self, path: str) -> os.stat_result | None:
        """The workspace's ``lstat`` of ``path``, or None when nothing is
        reachable there (absent, or a file or symlink in place of a parent)."""
        return self.root.lstat_or_none(rel(path))

    def lower_token(self, path: str, st: os.stat_result | None | bool = False) -> str:
        """The version token of the workspace's ``path``; ``st``: its
        ``lstat`` (or None) when the caller just took it."""
        if st is False:
            st = self.lower_stat(path)
        if st is None:
            return tokens.ABSENT
        target = self.root.readlink(rel(path)) if stat_mod.S_ISLNK(st.st_mode) else None
        return tokens.from_stat(st, target)

    def base_for(self, path: str) -> str:
        node = self.upper.get(path)
        if node is None:
            return self.lower_token(path)
        return node.name_bases.get(path, node.base)

    def covered(self, path: str) -> bool:
        """The upper layer decides what ``path`` is (a node there, or an
        ancestor that hides the workspace below it: see :meth:`resolve`)."""
        nodes = self.upper.nodes
        if path in nodes:
            return True
        p = path
        while p != "/":
            p = p.rpartition("/")[0] or "/"
            anc = nodes.get(p)
            if anc is not None and (anc.kind != "dir" or anc.opaque):
                return True
        return False

    def children_covered(self, path: str) -> bool:
        """An upper node at directory ``path`` or above it hides the
        workspace below ``path``: one that is not a directory, or an opaque
        one (the ancestor rule of :meth:`resolve` and of
        :meth:`getattr_listed`)."""
        nodes = self.upper.nodes
        if not nodes:
            return False
        p = path
        while True:
            anc = nodes.get(p)
            if anc is not None and (anc.kind != "dir" or anc.opaque):
                return True
            if p == "/":
                return False
            p = p.rpartition("/")[0] or "/"

    def dir_nlink(self, path: str, stamp: int = 0) -> int:
        """2 + subdirectories, for a directory the open step changed (the
        workspace's own count is right for the others).  Cached until the
        next change of the step's directories (the view clears
        :attr:`nlink_cache`) or, given the workspace directory's mtime as
        ``stamp``, until that changes (a directory made outside)."""
        cached = self.nlink_cache.get(path)
        if cached is not None and cached[0] == stamp:
            return cached[1]
        n = 2 + sum(1 for _name, kind, _ino in self.listing(path)[2:] if kind == stat_mod.S_IFDIR)
        self.nlink_cache[path] = (stamp, n)
        return n

    def stat_lower(self, path: str, st: os.stat_result) -> dict:
        nlink = st.st_nlink
        if stat_mod.S_ISDIR(st.st_mode) and self.upper.child_names(path):
            nlink = self.dir_nlink(path, st.st_mtime_ns)  # the upper layer changed its entries
        ino = self.ino_alias.get((st.st_dev, st.st_ino), st.st_ino) if self.ino_alias else st.st_ino
        mtime, ctime = st.st_mtime_ns, st.st_ctime_ns
        if nlink > 1 and not stat_mod.S_ISDIR(st.st_mode):
            nlink, ctime = self.links.shown_lower(st, path, ctime)
        if self.dir_times and stat_mod.S_ISDIR(st.st_mode):
            changed = self.dir_times.get(path, 0)
            mtime, ctime = max(mtime, changed), max(ctime, changed)
        return {
            "st_mode": st.st_mode, "st_ino": ino, "st_nlink": nlink, "st_size": st.st_size,
            "st_uid": st.st_uid, "st_gid": st.st_gid, "st_atime": st.st_atime_ns,
            "st_mtime": mtime, "st_ctime": ctime, "st_blocks": st.st_blocks,
            "st_blksize": st.st_blksize, "st_rdev": st.st_rdev,
        }

    def stat_node(self, node: Node) -> dict:
        out = {
            "st_mode": node.type_bits | stat_mod.S_IMODE(node.mode), "st_ino": node.ino,
            "st_nlink": node.nlink, "st_uid": node.uid, "st_gid": node.gid, "st_size": node.size,
            "st_atime": node.atime_ns, "st_mtime": node.mtime_ns, "st_ctime": node.ctime_ns,
            "st_blocks": (node.size + 511) // 512, "st_blksize": 4096,
        }
        if node.kind == "file" and node.scratch is not None:
            out["st_blocks"] = os.stat(node.scratch).st_blocks  # holes stay holes
        elif node.kind == "dir":
            out.update(st_size=4096, st_blocks=8)
        elif node.kind == "symlink":
            out.update(st_size=len(node.target or b""), st_blocks=0)
        elif node.kind in DEVICE_KINDS:
            out["st_rdev"] = rdev_of(node.kind, node.target)
        return out

    def is_empty_dir(self, path: str) -> bool:
        """Whether directory ``path`` lists nothing but ``.`` and ``..``:
        :meth:`listing`'s merge without building and sorting the entries
        (every rmdir of an ``rm -rf`` asks, of a directory whose names are
        all whiteouts by then)."""
        node, st = self.resolve(path)
        if self.kind(node, st) != "dir":
            raise NotADirectory(path)
        nodes = self.upper.nodes
        prefix = path if path != "/" else ""
        for name in self.upper.child_names(path):
            child = nodes.get(prefix + "/" + name)
            if child is not None and child.kind != "whiteout":
                return False  # (None: a directory on the way to staged paths, listed below if it exists)
        if node is None or not node.opaque:
            try:
                wpath = rel(path)
                lower = self.listings.listdir(wpath, st if st is not None else self.root.lstat(wpath))
            except (FileNotFoundError, NotADirectoryError):
                return True
            for name, _kind, _ino in lower:
                child = nodes.get(prefix + "/" + name)
                if child is None or child.kind != "whiteout":
                    return False
        return True

    def inherit_group(self, path: str, node: Node) -> None:
        """In a set-group-ID directory a new name takes the directory's
        group, and a new directory the S_ISGID bit too (the kernel leaves
        this to the filesystem; BSD group semantics)."""
        pnode, pst = self.resolve(parent_name(path)[0])
        pmode, pgid = (pnode.mode, pnode.gid) if pnode is not None else (pst.st_mode, pst.st_gid)
        if pmode & stat_mod.S_ISGID:
            node.gid = pgid
            if node.kind == "dir":
                node.mode |= stat_mod.S_ISGID

    def entries_changed(self, *paths: str) -> None:
        """The directories holding ``paths`` gained or lost an entry: their
        mtime and ctime become now.  Shown for the life of the mount, not
        staged (the commit's own changes give workspace directories new
        times); a directory node keeps them in memory the same way."""
        now = time.time_ns()
        for path in paths:
            parent = parent_name(path)[0]
            node = self.upper.get(parent)
            if node is not None:
                node.mtime_ns = node.ctime_ns = now
            else:
                self.dir_times[parent] = now

    def xattrs_of(self, path: str) -> dict[bytes, bytes]:
        node, st = self.resolve(path)
        if node is not None:
            return node.xattrs
        kind = self.kind(None, st)
        if kind not in ("file", "dir"):
            return {}
        fd = self.root.open(rel(path), os.O_RDONLY | os.O_NOFOLLOW | (os.O_DIRECTORY if kind == "dir" else 0))
        try:
            return xattr_codec.read_fd(fd)
        finally:
            os.close(fd)

    def listing(self, path: str) -> list[tuple[str, int, int]]:
        """The merged entries of directory ``path`` (``Overlay.readdir``)."""
        node, st = self.resolve(path)
        if self.kind(node, st) != "dir":
            raise NotADirectory(path)
        ino = node.ino if node is not None else st.st_ino
        out = [(".", stat_mod.S_IFDIR, ino), ("..", stat_mod.S_IFDIR, 1)]
        lower: list[tuple[str, int, int]] = []
        if node is None or not node.opaque:
            try:
                wpath = rel(path)
                # An upper directory over a workspace one: its own stamp.
                wst = st if st is not None else self.root.lstat(wpath)
                lower = self.listings.listdir(wpath, wst)
            except (FileNotFoundError, NotADirectoryError):
                pass
        upper_names = self.upper.child_names(path)
        alias = self.ino_alias
        if not upper_names and not alias:
            out += lower  # sorted by name already (Listings)
            return out
        dev = self.root_dev
        entries: dict[str, tuple[int, int]] = {
            name: (kind, alias.get((dev, ino), ino) if alias else ino) for name, kind, ino in lower}
        prefix = path if path != "/" else ""
        for name in upper_names:
            child = self.upper.nodes.get(prefix + "/" + name)
            if child is None:
                continue  # an unchanged directory on the way to staged paths
            if child.kind == "whiteout":
                entries.pop(name, None)
            else:
                entries[name] = (child.type_bits, child.ino)
        out += [(name, kind, i) for name, (kind, i) in sorted(entries.items())]
        return out

    def lower_digest(self, path: str) -> str:
        fd = self.root.open(rel(path), os.O_RDONLY | os.O_NOFOLLOW)
        try:
            return fd_digest(fd)
        finally:
            os.close(fd)

    def shown_ino(self, dev: int, ino: int) -> int:
        return self.ino_alias.get((dev, ino), ino) if self.ino_alias else ino

    def file_ino(self, path: str) -> int | None:
        """The inode number of the file ``path`` names now, or None."""
        try:
            node, st = self.resolve(path)
        except NotFound:
            return None
        return self.shown_ino(self.root_dev, node.ino) if node is not None else self.shown_ino(st.st_dev, st.st_ino)
