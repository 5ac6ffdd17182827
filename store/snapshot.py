"""The workspace as it was after layer N, path by path (store side, no FUSE).

This is what ``MOUNT/.stepfs/layers/N/...`` shows.  Nothing is materialised:
the state of a path as of N follows :func:`store.history.state_at` (the
newest entry at or before N, else the oldest entry after N's *before*
state, else the workspace now, for paths no layer ever touched).

Cost: a lookup reads one path's entries (``entrytable.path_rows``).  A
listing of directory ``D`` reads the workspace directory ``D`` (if it is a
directory now) plus the committed entries below ``D``: those of layers
after N undo later changes, those up to N apply earlier ones.  It never
walks the workspace or the whole history.

Every method runs inside the read transaction of the connection it was
given, so one call sees one consistent store.  The workspace side is read
through ``ws.root`` (no symlink followed, never the store).
"""

from __future__ import annotations

import errno
import os
import stat as stat_mod
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.engine import Connection

from stepfs.store import schema
from stepfs.store.contained import NODE_KINDS, rdev_of
from stepfs.store.entrytable import path_rows, rows_under
from stepfs.store.history import require_layer, state_from_rows
from stepfs.store.workspace import Workspace

#: What a directory reports as its size (as most filesystems do).
DIR_SIZE = 4096


@dataclass(frozen=True)
class Item:
    """One path of a layer's tree.  ``oid`` is set for file content from the
    store; a file with ``oid is None`` reads the workspace file (untouched
    since the layer)."""

    kind: str  # file | dir | symlink | fifo | chardev | blockdev | socket
    mode: int  # permission bits
    size: int
    mtime_ns: int
    oid: str | None = None
    target: bytes | None = None
    rdev: int = 0  # a device's number
    #: The owner the layer recorded (or the workspace file has); None when
    #: unknown (states of stores that did not record it): the mount's owner
    #: is shown then.  A mount shows layer files with it, so the kernel's
    #: permission checks in ``.stepfs/layers`` are those of the original.
    uid: int | None = None
    gid: int | None = None


_KINDS = {stat_mod.S_IFREG: "file", stat_mod.S_IFDIR: "dir", stat_mod.S_IFLNK: "symlink",
          **{bits: kind for kind, bits in NODE_KINDS.items()}}


class Snapshot:
    """Layer ``number`` of ``ws`` as a read-only tree; raises NoSuchLayer."""

    def __init__(self, ws: Workspace, conn: Connection, number: int):
        require_layer(conn, number)
        self.ws = ws
        self.conn = conn
        self.number = number
        self.created_ns = conn.execute(
            select(schema.layers.c.created_ns).where(schema.layers.c.number == number)
        ).scalar_one()

    # -- one path -----------------------------------------------------------

    def lookup(self, path: bytes) -> Item | None:
        """The item at ``path`` (``b"."`` is the root), or None if absent.
        FIFOs, devices and sockets are shown as nodes (never opened here)."""
        if path == b".":
            st = os.stat(self.ws.root.fd)
            return Item("dir", stat_mod.S_IMODE(st.st_mode), DIR_SIZE, self.created_ns, uid=st.st_uid, gid=st.st_gid)
        found = state_from_rows(path_rows(self.conn, path), self.number)
        if found is None:
            return self._from_workspace(path)
        state, mtime = found
        return self._from_state(state, mtime)

    def _from_state(self, state, mtime_ns: int | None) -> Item | None:
        when = mtime_ns or self.created_ns
        owner = {"uid": state.uid, "gid": state.gid}
        if state.kind == "file":
            return Item("file", state.mode or 0, self.ws.objects.size(self.conn, state.oid), when, oid=state.oid,
                        **owner)
        if state.kind == "dir":
            return Item("dir", state.mode or 0, DIR_SIZE, when, **owner)
        if state.kind == "symlink":
            target = state.target or b""
            return Item("symlink", 0o777, len(target), when, target=target, **owner)
        if state.kind in NODE_KINDS:
            return Item(state.kind, state.mode or 0, 0, when, rdev=rdev_of(state.kind, state.target), **owner)
        return None  # absent, or a "special" file of an older store (no type recorded)

    def _from_workspace(self, path: bytes) -> Item | None:
        try:
            st = self.ws.root.lstat(path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.EXDEV):
                return None  # through a symlink: not a path of the tree
            raise
        kind = _KINDS.get(stat_mod.S_IFMT(st.st_mode))
        if kind is None:
            return None
        if kind == "symlink":
            target = self.ws.root.readlink(path)
            return Item("symlink", 0o777, len(target), st.st_mtime_ns, target=target, uid=st.st_uid, gid=st.st_gid)
        size = DIR_SIZE if kind == "dir" else st.st_size
        return Item(kind, stat_mod.S_IMODE(st.st_mode), size, st.st_mtime_ns, rdev=st.st_rdev, uid=st.st_uid,
                    gid=st.st_gid)

    # -- directories ----------------------------------------------------------

    def listdir(self, path: bytes) -> list[tuple[bytes, str]]:
        """``[(name, kind)]`` of directory ``path`` as of the layer, sorted.
        The caller has checked that ``path`` is a directory there."""
        names: dict[bytes, str] = {}
        try:
            for name, fmt, _ino in self.ws.root.listdir(path):
                kind = _KINDS.get(fmt)
                if kind is not None:
                    names[name] = kind
        except (FileNotFoundError, NotADirectoryError):
            pass  # gone (or replaced) since: the entries below tell what it held
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.EXDEV):
                raise
        depth = 0 if path == b"." else path.count(b"/") + 1
        by_child: dict[bytes, list] = {}
        for row in rows_under(self.conn, path):
            p = bytes(row.path)
            parts = p.split(b"/")
            if len(parts) == depth + 1:
                by_child.setdefault(parts[-1], []).append(row)
        for name, rows in by_child.items():
            state, _mtime = state_from_rows(rows, self.number)
            kind = state.kind if state.kind in _KINDS.values() else None
            if kind is None:
                names.pop(name, None)
            else:
                names[name] = kind
        return sorted(names.items())

    # -- content --------------------------------------------------------------

    def read(self, path: bytes, item: Item, offset: int, size: int) -> bytes:
        """Bytes of a file item: from its object, or from the workspace file."""
        if item.oid is not None:
            return self.ws.objects.read_range(self.conn, item.oid, offset, size)
        fd = self.ws.root.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            return os.pread(fd, size, offset)
        finally:
            os.close(fd)
