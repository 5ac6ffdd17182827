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
object and writes the staged row.  Metadata changes (mkdir, unlink, rename,
symlink, chmod, utimens) are written through to the store at once.  Mounting
reads only the open step's staged rows: O(1) in the size of the workspace.

Threading: every public method takes ``self.lock`` (one re-entrant lock) for
its whole duration.  The FUSE loop and the control thread (commits) are the
only callers.  Nothing here blocks on another process.

Caveats: mtime-only changes (``touch`` of an unchanged file) are shown in the
mount but not committed; ownership changes are not staged yet.
"""

from __future__ import annotations

import errno
import itertools
import os
import stat as stat_mod
import threading
import time
from dataclasses import dataclass

from store import publish, staging, tokens
from store.errors import NothingToCommit
from store.workspace import Workspace

from .errors import (
    BadHandle, Exists, Invalid, IsADirectory, NameTooLong, NotADirectory, NotEmpty, NotFound, ReadOnly,
    Reserved, Unsupported,
)
from .metatree import ROOT as META_ROOT, MetaTree, is_meta
from .upper import Node, Upper, parent_name, rel, view_path

RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
# Inode numbers for paths that exist only in the upper layer; far above what
# real filesystems hand out so they do not collide with workspace inodes.
SYNTHETIC_INO_BASE = 1 << 62


@dataclass
class Handle:
    """An open file.  ``fd`` reads the workspace file (``node is None``) or
    the node's scratch file; ``data`` serves virtual files."""

    path: str
    fd: int
    node: Node | None
    writable: bool
    wrote: bool = False
    data: bytes | None = None


def _sparse_copy(src: int, dst: int, size: int) -> None:
    """Copy ``size`` bytes, leaving holes where the source has them."""
    pos = 0
    while pos < size:
        try:
            data_start = os.lseek(src, pos, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # only a hole remains
                break
            raise
        hole = os.lseek(src, data_start, os.SEEK_HOLE)
        off = data_start
        while off < hole:
            n = os.copy_file_range(src, dst, hole - off, off, off)
            if n == 0:
                break
            off += n
        pos = hole
    os.ftruncate(dst, size)


class Overlay:
    """The merged view of ``ws`` for the open step of ``mountpoint``."""

    def __init__(self, ws: Workspace, mountpoint: str, agent: str = ""):
        self.ws = ws
        self.root = ws.root
        self.mountpoint = mountpoint
        self.agent = agent
        self.lock = threading.RLock()
        with ws.db.write() as conn:
            self.step = staging.open_step(conn, mountpoint, agent)
        self.scratch_dir = os.path.join(ws.store_dir, "scratch", str(self.step))
        os.makedirs(self.scratch_dir, mode=0o700, exist_ok=True)
        for name in os.listdir(self.scratch_dir):  # leftovers of a dead daemon
            os.unlink(os.path.join(self.scratch_dir, name))
        self.upper = Upper()
        self.handles: dict[int, Handle] = {}
        self._fh = itertools.count(1)
        self._ino = itertools.count(SYNTHETIC_INO_BASE)
        self._scratch_seq = itertools.count(1)
        self.last_error: str | None = None
        self.readonly_reason: str | None = None
        self.meta = MetaTree(self)
        with ws.db.read() as conn:
            for row in staging.load(conn, self.step):
                self.upper.set(view_path(row.path), Node.from_row(row, next(self._ino)))

    # -- resolution ---------------------------------------------------------

    def _resolve(self, path: str) -> tuple[Node | None, os.stat_result | None]:
        """``(node, None)`` for an upper path, ``(None, stat)`` for a workspace
        path; raises NotFound."""
        nodes = self.upper.nodes
        if nodes:
            node = nodes.get(path)
            if node is not None:
                if node.kind == "whiteout":
                    raise NotFound(path)
                return node, None
            p = path
            while p != "/":
                p = p.rpartition("/")[0] or "/"
                anc = nodes.get(p)
                if anc is not None and (anc.kind != "dir" or anc.opaque):
                    raise NotFound(path)
        if path == "/":
            return None, os.stat(self.root.fd)
        try:
            return None, self.root.lstat(rel(path))
        except (FileNotFoundError, NotADirectoryError):
            raise NotFound(path) from None
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.EXDEV):
                raise NotFound(path) from None  # a symlink swapped in from outside
            raise

    def _exists(self, path: str) -> bool:
        try:
            self._resolve(path)
            return True
        except NotFound:
            return False

    def _kind(self, node: Node | None, st: os.stat_result | None) -> str:
        if node is not None:
            return node.kind
        if stat_mod.S_ISDIR(st.st_mode):
            return "dir"
        if stat_mod.S_ISLNK(st.st_mode):
            return "symlink"
        if stat_mod.S_ISREG(st.st_mode):
            return "file"
        return "special"

    def _require_dir(self, path: str) -> None:
        node, st = self._resolve(path)
        if self._kind(node, st) != "dir":
            raise NotADirectory(path)

    def _lower_stat(self, path: str) -> os.stat_result | None:
        """The workspace's ``lstat`` of ``path``, or None when nothing is
        reachable there (absent, or a file or symlink in place of a parent)."""
        try:
            return self.root.lstat(rel(path))
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.EXDEV):
                return None
            raise

    def _lower_token(self, path: str) -> str:
        st = self._lower_stat(path)
        if st is None:
            return tokens.ABSENT
        target = self.root.readlink(rel(path)) if stat_mod.S_ISLNK(st.st_mode) else None
        return tokens.from_stat(st, target)

    def _base_for(self, path: str) -> str:
        node = self.upper.get(path)
        return node.base if node is not None else self._lower_token(path)

    def _check_writable(self, path: str) -> None:
        if is_meta(path):
            raise ReadOnly(path)
        if self.readonly_reason is not None:
            raise ReadOnly(self.readonly_reason)

    # -- persistence (write-through of staged rows) ------------------------------

    def _persist(self, puts: list[str] = (), removes: list[str] = (), trees: list[str] = ()) -> None:
        """Write the rows of ``puts`` (by their current nodes), delete the
        rows of ``removes`` and of everything below ``trees``: one transaction."""
        with self.ws.db.write() as conn:
            for path in trees:
                staging.remove_tree(conn, self.step, rel(path))
            for path in removes:
                staging.remove(conn, self.step, rel(path))
            for path in puts:
                node = self.upper.nodes[path]
                if node.kind == "file" and node.oid is None and node.scratch is not None:
                    # A file open for writing that was never closed after a
                    # write (a fresh copy-up, a create) has no object yet: a
                    # chmod, utimens or rename must stage what its scratch
                    # file holds, never an empty file.
                    fd = os.open(node.scratch, os.O_RDONLY | os.O_CLOEXEC)
                    try:
                        node.oid, node.size = self.ws.objects.put_fd(conn, fd)
                    finally:
                        os.close(fd)
                staging.put(conn, self.step, node.row(path))
                node.staged = True

    def _new_scratch(self) -> str:
        return os.path.join(self.scratch_dir, str(next(self._scratch_seq)))

    def _materialize(self, node: Node) -> None:
        """Give a staged file node a scratch file holding its content."""
        if node.scratch is not None:
            return
        path = self._new_scratch()
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            if node.oid is not None:
                with self.ws.db.read() as conn:
                    self.ws.objects.write_to_fd(conn, node.oid, fd)
            os.utime(fd, ns=(node.atime_ns, node.mtime_ns))
        finally:
            os.close(fd)
        node.scratch = path

    def _drop_scratch(self, node: Node) -> None:
        if node.scratch is not None:
            try:
                os.unlink(node.scratch)
            except FileNotFoundError:
                pass
            node.scratch = None

    def _copy_up(self, path: str) -> Node:
        """The file node of ``path`` with a scratch file, copying the
        workspace file up on first use."""
        node, st = self._resolve(path)
        if node is not None:
            if node.kind == "dir":
                raise IsADirectory(path)
            if node.kind != "file":
                raise Invalid(path)
            self._materialize(node)
            self._readers_follow(path)
            return node
        if stat_mod.S_ISDIR(st.st_mode):
            raise IsADirectory(path)
        if not stat_mod.S_ISREG(st.st_mode):
            raise Invalid(path)
        src = self.root.open(rel(path), os.O_RDONLY | os.O_NOFOLLOW)
        scratch = self._new_scratch()
        try:
            st = os.fstat(src)
            dst = os.open(scratch, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                _sparse_copy(src, dst, st.st_size)
                os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))
            finally:
                os.close(dst)
        finally:
            os.close(src)
        node = Node("file", st.st_mode, base=tokens.from_stat(st), ino=st.st_ino, size=st.st_size,
                    mtime_ns=st.st_mtime_ns, uid=st.st_uid, gid=st.st_gid)
        node.scratch = scratch
        self.upper.set(path, node)
        self._readers_follow(path)
        return node

    def _readers_follow(self, path: str) -> None:
        """Before the copy of ``path`` is written to, move the handles that
        read the workspace file onto it: they must see the writes even if
        the copy is unlinked or renamed over before they read again."""
        for h in self.handles.values():
            if h.node is None and h.data is None and h.path == path:
                self._follow_copy_up(h)

    def _stage_content(self, path: str, node: Node) -> None:
        """Store the scratch file as an object and write the staged row."""
        fd = os.open(node.scratch, os.O_RDONLY | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            with self.ws.db.write() as conn:
                node.oid, node.size = self.ws.objects.put_fd(conn, fd)
                node.mtime_ns = st.st_mtime_ns
                staging.put(conn, self.step, node.row(path))
        finally:
            os.close(fd)
        node.staged = True
        node.dirty = False

    def _node_for_meta(self, path: str) -> Node:
        """An upper node for a metadata change of ``path`` (copied up without
        a scratch file: files are stored as an object once)."""
        node, st = self._resolve(path)
        if node is not None:
            return node
        kind = self._kind(None, st)
        base = self._lower_token(path)
        if kind == "dir":
            node = Node("dir", st.st_mode, base=base, ino=st.st_ino, mtime_ns=st.st_mtime_ns, uid=st.st_uid, gid=st.st_gid)
        elif kind == "symlink":
            node = Node("symlink", st.st_mode, base=base, ino=st.st_ino, target=self.root.readlink(rel(path)),
                        size=st.st_size, mtime_ns=st.st_mtime_ns, uid=st.st_uid, gid=st.st_gid)
        elif kind == "file":
            fd = self.root.open(rel(path), os.O_RDONLY | os.O_NOFOLLOW)
            try:
                st = os.fstat(fd)
                with self.ws.db.write() as conn:
                    oid, size = self.ws.objects.put_fd(conn, fd)
            finally:
                os.close(fd)
            node = Node("file", st.st_mode, base=tokens.from_stat(st), ino=st.st_ino, size=size, oid=oid,
                        mtime_ns=st.st_mtime_ns, uid=st.st_uid, gid=st.st_gid)
        else:
            raise Unsupported(path)
        node.atime_ns = st.st_atime_ns
        node.ctime_ns = st.st_ctime_ns
        self.upper.set(path, node)
        return node

    def _remove(self, path: str) -> None:
        """Make ``path`` (and everything below it) absent in the view."""
        node = self.upper.get(path)
        base = node.base if node is not None else self._lower_token(path)
        below = self.upper.below(path)
        for child in below:
            self._detach(child, self.upper.pop(child))
        self._detach(path, self.upper.pop(path))
        if self._lower_stat(path) is not None:
            self.upper.set(path, Node("whiteout", 0, base=base, ino=0))
            self._persist(puts=[path], trees=[path] if below else [])
        else:
            self._persist(trees=[path])

    def _detach(self, path: str, node: Node | None) -> None:
        """A node leaves the tree; its scratch lives on while handles use it."""
        if node is not None and node.opens == 0:
            self._drop_scratch(node)

    # -- attributes ---------------------------------------------------------

    def getattr(self, path: str, fh: int | None = None) -> dict:
        with self.lock:
            h = self.handles.get(fh) if fh is not None else None
            if h is not None and h.node is not None:
                return self._stat_node(h.node)
            if h is not None and h.data is None and h.fd >= 0:
                # fstat(2) of a workspace file: the file the handle has open,
                # even if its path was unlinked or replaced meanwhile.
                return self._stat_lower(path, os.fstat(h.fd))
            if is_meta(path):
                return self.meta.getattr(path)
            node, st = self._resolve(path)
            if node is None:
                return self._stat_lower(path, st)
            return self._stat_node(node)

    def _stat_lower(self, path: str, st: os.stat_result) -> dict:
        nlink = st.st_nlink
        if stat_mod.S_ISDIR(st.st_mode) and self.upper.child_names(path):
            nlink = 1  # "unknown": the upper layer changed its subdirectories
        return {
            "st_mode": st.st_mode, "st_ino": st.st_ino, "st_nlink": nlink, "st_size": st.st_size,
            "st_uid": st.st_uid, "st_gid": st.st_gid, "st_atime": st.st_atime_ns,
            "st_mtime": st.st_mtime_ns, "st_ctime": st.st_ctime_ns, "st_blocks": st.st_blocks,
            "st_blksize": st.st_blksize,
        }

    def _stat_node(self, node: Node) -> dict:
        out = {
            "st_mode": node.type_bits | stat_mod.S_IMODE(node.mode), "st_ino": node.ino,
            "st_nlink": 1, "st_uid": node.uid, "st_gid": node.gid, "st_size": node.size,
            "st_atime": node.atime_ns, "st_mtime": node.mtime_ns, "st_ctime": node.ctime_ns,
            "st_blocks": (node.size + 511) // 512, "st_blksize": 4096,
        }
        if node.kind == "file" and node.scratch is not None:
            st = os.stat(node.scratch)
            out.update(st_size=st.st_size, st_blocks=st.st_blocks, st_atime=st.st_atime_ns,
                       st_mtime=st.st_mtime_ns, st_ctime=max(st.st_ctime_ns, node.ctime_ns))
        elif node.kind == "dir":
            out.update(st_size=4096, st_blocks=8)
        elif node.kind == "symlink":
            out.update(st_size=len(node.target or b""), st_blocks=0)
        return out

    def chmod(self, path: str, mode: int) -> None:
        with self.lock:
            self._check_writable(path)
            node = self._node_for_meta(path)
            node.mode = stat_mod.S_IFMT(node.mode) | stat_mod.S_IMODE(mode)
            node.ctime_ns = time.time_ns()
            self._persist(puts=[path])

    def chown(self, path: str, uid: int, gid: int) -> None:
        with self.lock:
            self._check_writable(path)
            node = self._node_for_meta(path)
            if uid != -1:
                node.uid = uid
            if gid != -1:
                node.gid = gid
            node.ctime_ns = time.time_ns()

    UTIME_NOW = (1 << 30) - 1
    UTIME_OMIT = (1 << 30) - 2

    def utimens(self, path: str, times: tuple[int, int] | None) -> None:
        """``times`` in ns; libfuse3 passes UTIME_NOW / UTIME_OMIT through as
        the nanosecond field with zero seconds."""
        with self.lock:
            self._check_writable(path)
            node = self._node_for_meta(path)
            now = time.time_ns()
            atime, mtime = times if times is not None else (self.UTIME_NOW, self.UTIME_NOW)
            new_a = node.atime_ns if atime == self.UTIME_OMIT else now if atime == self.UTIME_NOW else atime
            new_m = node.mtime_ns if mtime == self.UTIME_OMIT else now if mtime == self.UTIME_NOW else mtime
            if node.kind == "file" and node.scratch is not None:
                st = os.stat(node.scratch)
                if atime == self.UTIME_OMIT:
                    new_a = st.st_atime_ns
                if mtime == self.UTIME_OMIT:
                    new_m = st.st_mtime_ns
                os.utime(node.scratch, ns=(new_a, new_m))
            node.atime_ns, node.mtime_ns, node.ctime_ns = new_a, new_m, now
            self._persist(puts=[path])

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
            node, st = self._resolve(path)
            if self._kind(node, st) != "dir":
                raise NotADirectory(path)
            entries: dict[str, tuple[int, int]] = {}
            if node is None or not node.opaque:
                try:
                    for name, kind, ino in self.root.listdir(rel(path)):
                        entries[os.fsdecode(name)] = (kind, ino)
                except (FileNotFoundError, NotADirectoryError):
                    pass
            prefix = path if path != "/" else ""
            for name in self.upper.child_names(path):
                child = self.upper.nodes.get(prefix + "/" + name)
                if child is None:
                    continue  # an unchanged directory on the way to staged paths
                if child.kind == "whiteout":
                    entries.pop(name, None)
                else:
                    entries[name] = (child.type_bits, child.ino)
            ino = node.ino if node is not None else st.st_ino
            out = [(".", stat_mod.S_IFDIR, ino), ("..", stat_mod.S_IFDIR, 1)]
            out += [(name, kind, i) for name, (kind, i) in sorted(entries.items())]
            return out

    def _is_empty_dir(self, path: str) -> bool:
        return len(self.readdir(path)) <= 2

    def _check_new_name(self, path: str) -> None:
        """Called before ``_check_writable`` so that creating ``/.stepfs``
        itself is Reserved (EEXIST) while anything below it is ReadOnly."""
        if path == META_ROOT:
            raise Reserved(path)
        if len(os.fsencode(parent_name(path)[1])) > 255:
            raise NameTooLong(path)

    def mkdir(self, path: str, mode: int, owner: tuple[int, int] | None = None) -> None:
        with self.lock:
            self._check_new_name(path)
            self._check_writable(path)
            self._require_dir(parent_name(path)[0])
            if self._exists(path):
                raise Exists(path)
            base = self._base_for(path)
            # Opaque: whatever the workspace has (or will get) at this path
            # was not what this agent saw; its new directory starts empty.
            node = Node("dir", stat_mod.S_IFDIR | stat_mod.S_IMODE(mode), base=base, ino=next(self._ino),
                        opaque=True, uid=os.getuid(), gid=os.getgid())
            if owner is not None:
                node.uid, node.gid = owner
            self.upper.set(path, node)
            self._persist(puts=[path])

    def rmdir(self, path: str) -> None:
        with self.lock:
            self._check_writable(path)
            if path == "/":
                raise Invalid(path)
            node, st = self._resolve(path)
            if self._kind(node, st) != "dir":
                raise NotADirectory(path)
            if not self._is_empty_dir(path):
                raise NotEmpty(path)
            self._remove(path)

    # -- names ------------------------------------------------------------------

    def unlink(self, path: str) -> None:
        with self.lock:
            self._check_writable(path)
            node, st = self._resolve(path)
            if self._kind(node, st) == "dir":
                raise IsADirectory(path)
            self._remove(path)

    def symlink(self, path: str, target: str, owner: tuple[int, int] | None = None) -> None:
        with self.lock:
            self._check_new_name(path)
            self._check_writable(path)
            self._require_dir(parent_name(path)[0])
            if self._exists(path):
                raise Exists(path)
            data = os.fsencode(target)
            node = Node("symlink", stat_mod.S_IFLNK | 0o777, base=self._base_for(path), ino=next(self._ino),
                        target=data, size=len(data))
            if owner is not None:
                node.uid, node.gid = owner
            self.upper.set(path, node)
            self._persist(puts=[path])

    def readlink(self, path: str) -> str:
        with self.lock:
            if is_meta(path):
                return self.meta.readlink(path)
            node, st = self._resolve(path)
            if self._kind(node, st) != "symlink":
                raise Invalid(path)
            if node is not None:
                return os.fsdecode(node.target)
            return os.fsdecode(self.root.readlink(rel(path)))

    def rename(self, old: str, new: str, flags: int = 0) -> None:
        with self.lock:
            self._check_writable(old)
            self._check_writable(new)
            self._check_new_name(new)
            if flags & RENAME_EXCHANGE or flags & ~(RENAME_NOREPLACE):
                raise Unsupported(f"rename flags {flags:#x}")
            src, src_st = self._resolve(old)
            src_kind = self._kind(src, src_st)
            self._require_dir(parent_name(new)[0])
            dst_kind = None
            if self._exists(new):
                if flags & RENAME_NOREPLACE:
                    raise Exists(new)  # even onto itself, as renameat2(2) does
                if old == new:
                    return
                if old.startswith(new + "/"):
                    raise NotEmpty(new)  # onto its own ancestor (the kernel's order of checks)
                dnode, dst_st = self._resolve(new)
                dst_kind = self._kind(dnode, dst_st)
            if src_kind == "dir":
                if new.startswith(old + "/"):
                    raise Invalid(new)
                if dst_kind is not None and dst_kind != "dir":
                    raise NotADirectory(new)
                if dst_kind == "dir" and not self._is_empty_dir(new):
                    raise NotEmpty(new)
                self._rename_dir(old, new)
            else:
                if dst_kind == "dir":
                    raise IsADirectory(new)
                if src_kind == "special":
                    raise Unsupported(old)
                self._rename_leaf(old, new)

    def _take_leaf(self, path: str) -> Node:
        """A detached copy-up of a file or symlink, its content staged."""
        node = self.upper.get(path)
        if node is None:
            return self._node_for_meta(path)
        if node.kind == "file" and node.dirty:
            self._stage_content(path, node)
        return node

    def _rename_leaf(self, old: str, new: str) -> None:
        node = self._take_leaf(old)
        new_base = self._base_for(new)
        self._remove(new) if self._exists(new) else None
        self.upper.pop(old)
        old_lower = self._lower_stat(old) is not None
        if old_lower:
            self.upper.set(old, Node("whiteout", 0, base=node.base, ino=0))
        node.base = new_base
        node.ctime_ns = time.time_ns()
        self.upper.set(new, node)
        self._persist(puts=[new] + ([old] if old_lower else []), removes=[] if old_lower else [old])
        for h in self.handles.values():
            if h.path == old:
                h.path = new

    def _rename_dir(self, old: str, new: str) -> None:
        """Move a directory: every path below it is staged at its new place
        (O(size of the subtree)); the old place becomes a whiteout."""
        subtree: list[tuple[str, Node]] = []  # (relative suffix, node)
        todo = [""]
        while todo:
            suffix = todo.pop()
            path = old + suffix
            node, st = self._resolve(path)
            if self._kind(node, st) == "dir":
                moved = Node("dir", (node.mode if node else st.st_mode), base="", ino=(node.ino if node else st.st_ino),
                             opaque=True, mtime_ns=(node.mtime_ns if node else st.st_mtime_ns))
                subtree.append((suffix, moved))
                todo.extend(suffix + "/" + n for n, _k, _i in self.readdir(path)[2:])
            else:
                subtree.append((suffix, self._take_leaf(path)))
        if self._exists(new):
            self._remove(new)
        self._remove(old)
        puts = []
        for suffix, node in subtree:
            dest = new + suffix
            node.base = self._base_for(dest)
            self.upper.set(dest, node)
            puts.append(dest)
        self._persist(puts=puts)
        for h in self.handles.values():
            if h.path == old or h.path.startswith(old + "/"):
                h.path = new + h.path[len(old):]

    def link(self, path: str, target: str) -> None:
        raise Unsupported("hard links")

    # -- files ------------------------------------------------------------------

    def open(self, path: str, flags: int) -> int:
        with self.lock:
            if is_meta(path):
                if flags & os.O_ACCMODE != os.O_RDONLY or flags & os.O_TRUNC:
                    raise ReadOnly(path)
                entry = self.meta.entry(path)
                if entry.kind == "dir":
                    raise IsADirectory(path)
                return self._add_handle(Handle(path, -1, None, False, data=entry.data))
            writable = flags & os.O_ACCMODE != os.O_RDONLY
            if writable or flags & os.O_TRUNC:
                self._check_writable(path)
                node = self._copy_up(path)
                fd = os.open(node.scratch, os.O_RDWR | os.O_CLOEXEC | (flags & os.O_APPEND))
                h = Handle(path, fd, node, True)
                if flags & os.O_TRUNC:
                    os.ftruncate(fd, 0)
                    node.dirty = True
                    h.wrote = True
                node.opens += 1
                return self._add_handle(h)
            node, st = self._resolve(path)
            if self._kind(node, st) == "dir":
                raise IsADirectory(path)
            if node is not None:
                self._materialize(node)
                node.opens += 1
                return self._add_handle(Handle(path, os.open(node.scratch, os.O_RDONLY | os.O_CLOEXEC), node, False))
            return self._add_handle(Handle(path, self.root.open(rel(path), os.O_RDONLY | os.O_NOFOLLOW), None, False))

    def create(self, path: str, mode: int, flags: int = os.O_RDWR, owner: tuple[int, int] | None = None) -> int:
        with self.lock:
            self._check_new_name(path)
            self._check_writable(path)
            self._require_dir(parent_name(path)[0])
            if self._exists(path):
                if flags & os.O_EXCL:
                    raise Exists(path)
                return self.open(path, flags & ~os.O_CREAT)
            node = Node("file", stat_mod.S_IFREG | stat_mod.S_IMODE(mode), base=self._base_for(path),
                        ino=next(self._ino), uid=os.getuid(), gid=os.getgid())
            if owner is not None:
                node.uid, node.gid = owner
            node.scratch = self._new_scratch()
            fd = os.open(node.scratch, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | (flags & os.O_APPEND), 0o600)
            node.dirty = True  # a new file is a change even if nothing is written
            node.opens += 1
            self.upper.set(path, node)
            h = Handle(path, fd, node, True, wrote=True)
            return self._add_handle(h)

    def _add_handle(self, h: Handle) -> int:
        fh = next(self._fh)
        self.handles[fh] = h
        return fh

    def _handle(self, fh: int) -> Handle:
        try:
            return self.handles[fh]
        except KeyError:
            raise BadHandle(str(fh)) from None

    def read(self, fh: int, size: int, offset: int) -> bytes:
        with self.lock:
            h = self._handle(fh)
            if h.data is not None:
                return h.data[offset:offset + size]
            if h.node is None:
                self._follow_copy_up(h)
            return os.pread(h.fd, size, offset)

    def _follow_copy_up(self, h: Handle) -> None:
        """Move a handle reading a workspace file to the upper copy of that
        same file, if another handle of this view copied it up since (POSIX:
        the reader sees the writer's bytes).  "Same file" is the inode, which
        a copy-up keeps: a different file that took the path meanwhile (a
        rename over it, an unlink and create) is not what this handle has
        open, and the handle keeps reading what it opened."""
        node = self.upper.get(h.path)
        if node is None or node.kind != "file" or node.ino != os.fstat(h.fd).st_ino:
            return
        self._materialize(node)
        fd = os.open(node.scratch, os.O_RDONLY | os.O_CLOEXEC)
        os.close(h.fd)
        h.fd = fd
        h.node = node
        node.opens += 1

    def write(self, fh: int, data: bytes, offset: int) -> int:
        with self.lock:
            h = self._handle(fh)
            if not h.writable:
                raise BadHandle(str(fh))
            n = os.pwrite(h.fd, data, offset)
            h.wrote = True
            h.node.dirty = True
            return n

    def truncate(self, path: str, length: int, fh: int | None = None) -> None:
        with self.lock:
            self._check_writable(path)
            if fh is not None and fh in self.handles and self.handles[fh].writable:
                h = self.handles[fh]
                os.ftruncate(h.fd, length)
                h.wrote = True
                h.node.dirty = True
                return
            node = self._copy_up(path)
            fd = os.open(node.scratch, os.O_RDWR | os.O_CLOEXEC)
            try:
                os.ftruncate(fd, length)
            finally:
                os.close(fd)
            # No close will follow a path truncate: stage it now.
            self._stage_content(path, node)

    def flush(self, fh: int) -> None:
        """The close of a descriptor: stage what this handle wrote."""
        with self.lock:
            h = self._handle(fh)
            if h.writable and h.wrote and h.node is not None and h.node.dirty and self.upper.get(h.path) is h.node:
                self._stage_content(h.path, h.node)
            h.wrote = False

    def fsync(self, fh: int, datasync: bool) -> None:
        with self.lock:
            h = self._handle(fh)
            if h.writable and h.node is not None and h.node.dirty and self.upper.get(h.path) is h.node:
                self._stage_content(h.path, h.node)

    def release(self, fh: int) -> None:
        with self.lock:
            h = self.handles.pop(fh, None)
            if h is None:
                return
            if h.fd >= 0:
                os.close(h.fd)
            node = h.node
            if node is None:
                return
            node.opens -= 1
            attached = self.upper.get(h.path) is node
            if attached and node.dirty and node.opens == 0:
                self._stage_content(h.path, node)  # writes after the last flush (mmap)
            if node.opens == 0 and (not attached or not node.staged):
                # Unlinked while open, or copied up but never changed: the
                # workspace (or nothing) is the truth again.
                if attached:
                    self.upper.pop(h.path)
                self._drop_scratch(node)

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

        Files still open for writing keep their scratch copies and are
        staged again at their next close, against the new workspace state.
        """
        with self.lock:
            # A commit replaces workspace files (rename over): readers of a
            # workspace file that this view changed move to the staged copy
            # first, so they keep seeing this view's bytes afterwards.
            for h in self.handles.values():
                if h.node is None and h.data is None:
                    self._follow_copy_up(h)
            try:
                number = publish.commit_step(
                    self.ws, self.step, message=message, agent=self.agent, mount=self.mountpoint,
                    meta=meta, allow_empty=allow_empty, overwrite=overwrite,
                )
            except NothingToCommit:
                self._after_commit()  # the no-op rows were dropped from the store
                raise
            self._after_commit()
            return number

    def _after_commit(self) -> None:
        for path in list(self.upper.nodes):
            node = self.upper.nodes[path]
            if node.opens:
                node.staged = False
                node.base = self._lower_token(path)
            else:
                self.upper.pop(path)
                self._drop_scratch(node)

    def status_text(self) -> str:
        lines = [f"mount: {self.mountpoint}", f"workspace: {self.ws.path}", f"step: {self.step}"]
        if self.readonly_reason:
            lines.append(f"read-only: {self.readonly_reason}")
        if self.last_error:
            lines.append(f"last error: {self.last_error}")
        staged = self.staged_paths()
        lines.append(f"staged: {len(staged)}")
        lines += [f"  {op} {path}" for op, path in staged]
        return "\n".join(lines) + "\n"

    def close(self) -> None:
        """Stage what is still dirty and close every handle (unmount)."""
        with self.lock:
            for fh in list(self.handles):
                h = self.handles[fh]
                if h.writable and h.node is not None and h.node.dirty and self.upper.get(h.path) is h.node:
                    self._stage_content(h.path, h.node)
                self.release(fh)
