"""The workspace against its head layer (``stepfs verify --workspace``).

For every path any committed layer touched, the state the head layer
records (after its last entry) is compared with what the workspace holds
now: kind, permission bits, and content (a file's bytes against its
object, byte for byte; a symlink's target; a device's number).  Owners,
times and extended attributes are not compared (a copy restored by another
user differs there without being damaged).  A difference is not a store
problem: it is either an edit made outside stepfs since the last step (the
next step will record it) or a workspace damaged behind stepfs's back (a
file swapped for a hard link elsewhere, a symlink where a directory was);
each is named so a person can tell which.

Read-only; every workspace path is reached beneath the workspace handle
without following a symlink (``store.contained``).
"""

from __future__ import annotations

import os
import stat as stat_mod
from typing import Callable

from stepfs.store import entrytable
from stepfs.store.contained import kind_of, rdev_target
from stepfs.store.history import state_from_rows
from stepfs.store.layers import State, head
from stepfs.store.workspace import Workspace



def check_workspace(ws: Workspace, add: Callable[[str, str], None]) -> int:
    """Call ``add("workspace", sentence)`` for each path whose workspace
    state differs from the head layer's; returns how many paths were
    checked."""
    with ws.db.read() as conn:
        number = head(conn)
        rows = entrytable.all_rows(conn)
        by_path: dict[bytes, list] = {}
        for r in rows:
            by_path.setdefault(bytes(r.path), []).append(r)
        checked = 0
        for path, path_rows in by_path.items():
            found = state_from_rows(path_rows, number)
            if found is None:
                continue
            checked += 1
            why = _differs(ws, conn, path, found[0])
            if why:
                add("workspace", f"workspace path {os.fsdecode(path)!r} {why} (layer {number} records "
                                 f"{_describe(found[0])})")
    return checked


def _describe(s: State) -> str:
    if s.kind is None:
        return "no such path"
    if s.kind == "symlink":
        return f"a symlink to {os.fsdecode(s.target or b'')!r}"
    return f"a {s.kind} with mode {s.mode or 0:o}"


def _differs(ws: Workspace, conn, path: bytes, s: State) -> str | None:
    """Why the workspace path is not in state ``s`` (None if it is)."""
    st = ws.root.lstat_or_none(path)
    if st is None:
        return None if s.kind is None else "is missing (or lies below a symlink or a file)"
    kind = kind_of(st.st_mode)
    if s.kind is None:
        return f"exists as a {kind}"
    if s.kind == "special":  # a device or socket as older stores recorded it
        return None if kind not in ("file", "dir", "symlink") else f"is a {kind}"
    if kind != s.kind:
        return f"is a {kind}"
    if kind == "symlink":
        target = ws.root.readlink(path)
        return None if target == s.target else f"points to {os.fsdecode(target)!r}"
    if stat_mod.S_IMODE(st.st_mode) != (s.mode or 0):
        return f"has mode {stat_mod.S_IMODE(st.st_mode):o}"
    if kind == "file":
        if st.st_nlink > 1 and not _linked_in_layer(conn, path):
            return f"has {st.st_nlink} links (stepfs publishes every file as a new inode)"
        fd = ws.root.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            return None if ws.objects.holds(conn, s.oid, fd) else "holds other bytes"
        finally:
            os.close(fd)
    if kind in ("chardev", "blockdev"):
        return None if rdev_target(kind, st.st_rdev) == s.target else "is another device"
    return None


def _linked_in_layer(conn, path: bytes) -> bool:
    """Whether a layer published ``path`` as a hard link, or another name
    as a hard link of it (then more than one link is what stepfs made)."""
    return entrytable.ever_linked(conn, path)
