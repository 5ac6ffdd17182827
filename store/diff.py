"""Differences between layers: changed paths, renames, unified diffs (store side).

Pure reads of the store.  A :class:`Change` is one path whose state differs
between two points of history (or one entry of a layer); a rename is a
deleted path and an added path whose content object (or symlink target) is
the same, paired one to one in path order.  Empty files are never paired:
every empty file has the same object.

Text is anything without a NUL byte in its first 8 KiB that decodes as
UTF-8 (git's heuristic, roughly) and is at most :data:`TEXT_LIMIT` bytes;
everything else is diffed as binary ("Binary files ... differ").
"""

from __future__ import annotations

import difflib
import os
import stat as stat_mod
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sqlalchemy import or_, select
from sqlalchemy.engine import Connection

from stepfs.store import schema
from stepfs.store.contained import NODE_KINDS
from stepfs.store.history import committed_rows, require_layer, state_from_rows, under
from stepfs.store.layers import Entry, State
from stepfs.store.objects import ObjectStore

E, L = schema.entries, schema.layers

#: Files above this size are not diffed or line-counted (reported as binary).
TEXT_LIMIT = 4 << 20

if TYPE_CHECKING:
    from stepfs.store.workspace import Workspace


@dataclass
class Change:
    """``before`` -> ``after`` at ``path``; a rename also has ``old_path``."""

    path: bytes
    before: State
    after: State
    old_path: bytes | None = None

    @property
    def op(self) -> str:
        if self.old_path is not None:
            return "renamed"
        return self.after.op_against(self.before)


# -- which paths changed ------------------------------------------------------------


def path_condition(paths: list[bytes] | None):
    """SQL condition on entry paths: each of ``paths`` and everything below
    it (``None`` or ``b"."`` among them: every path)."""
    if not paths or b"." in paths:
        return E.c.path.is_not(None)
    return or_(*[(E.c.path == p) | under(p) for p in paths])


def changes_between(conn: Connection, old: int, new: int, paths: list[bytes] | None = None) -> list[Change]:
    """Every path (restricted to ``paths`` and below) whose state as of layer
    ``old`` differs from its state as of layer ``new``; renames paired.
    Raises NoSuchLayer for a layer that is not committed."""
    require_layer(conn, old)
    require_layer(conn, new)
    lo, hi = min(old, new), max(old, new)
    committed = select(L.c.number).where(L.c.state == "committed")
    touched = select(E.c.path).where(E.c.layer > lo, E.c.layer <= hi, E.c.layer.in_(committed),
                                     path_condition(paths))
    by_path: dict[bytes, list] = {}
    for row in committed_rows(conn, E.c.path.in_(touched)):
        by_path.setdefault(bytes(row.path), []).append(row)
    out = []
    for path, rows in sorted(by_path.items()):
        before, _ = state_from_rows(rows, old)
        after, _ = state_from_rows(rows, new)
        if before != after:
            out.append(Change(path, before, after))
    return pair_renames(conn, out)


def from_entries(conn: Connection, entries: list[Entry]) -> list[Change]:
    """A layer's entries as changes, renames paired."""
    return pair_renames(conn, [Change(e.path, e.before, e.after) for e in entries])


def _content_key(conn: Connection, s: State) -> tuple | None:
    if s.kind == "file" and s.oid is not None and ObjectStore.size(conn, s.oid) > 0:
        return ("file", s.oid)
    if s.kind == "symlink":
        return ("symlink", s.target)
    return None


def pair_renames(conn: Connection, changes: list[Change]) -> list[Change]:
    """Pair deletions with additions of the same content (one to one, in
    path order); everything else is returned unchanged, sorted by path."""
    gone: dict[tuple, list[Change]] = {}
    for c in changes:
        if c.after.kind is None and c.before.kind is not None:
            key = _content_key(conn, c.before)
            if key is not None:
                gone.setdefault(key, []).append(c)
    if not gone:
        return sorted(changes, key=lambda c: c.path)
    paired: set[int] = set()
    out = []
    for c in sorted(changes, key=lambda c: c.path):
        if c.before.kind is None and c.after.kind is not None:
            key = _content_key(conn, c.after)
            candidates = gone.get(key) if key is not None else None
            if candidates:
                src = candidates.pop(0)
                paired.add(id(src))
                out.append(Change(c.path, src.before, c.after, old_path=src.path))
                continue
        out.append(c)
    return sorted((c for c in out if id(c) not in paired), key=lambda c: c.path)


# -- content ---------------------------------------------------------------------------


def content(objects: ObjectStore, conn: Connection, state: State) -> bytes:
    """A file's bytes or a symlink's target; empty for anything else."""
    if state.kind == "file" and state.oid is not None:
        return objects.read_all(conn, state.oid)
    if state.kind == "symlink":
        return state.target or b""
    return b""


def text_lines(data: bytes) -> list[str] | None:
    """``data`` split into lines (ends kept), or None if it is binary."""
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8").splitlines(keepends=True)
    except UnicodeDecodeError:
        return None


def sizes(conn: Connection, c: Change) -> tuple[int, int]:
    def one(s: State) -> int:
        if s.kind == "file" and s.oid is not None:
            return ObjectStore.size(conn, s.oid)
        if s.kind == "symlink":
            return len(s.target or b"")
        return 0

    return one(c.before), one(c.after)


def lines_of(objects: ObjectStore, conn: Connection, c: Change) -> tuple[list[str] | None, list[str] | None, int, int]:
    """``(old lines, new lines, old size, new size)``; lines are None for
    binary or oversized content.  Only files and symlinks have lines."""
    n_old, n_new = sizes(conn, c)
    if max(n_old, n_new) > TEXT_LIMIT:
        return None, None, n_old, n_new
    old = content(objects, conn, c.before) if c.before.kind in ("file", "symlink") else b""
    new = content(objects, conn, c.after) if c.after.kind in ("file", "symlink") else b""
    return text_lines(old), text_lines(new), len(old), len(new)


def count_lines(a: list[str], b: list[str]) -> tuple[int, int]:
    """``(added, removed)`` lines between two texts."""
    added = removed = 0
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b).get_opcodes():
        if tag in ("replace", "delete"):
            removed += i2 - i1
        if tag in ("replace", "insert"):
            added += j2 - j1
    return added, removed


# -- unified diff ------------------------------------------------------------------------


def _git_mode(s: State) -> str:
    kind_bits = {"file": stat_mod.S_IFREG, "dir": stat_mod.S_IFDIR, "symlink": stat_mod.S_IFLNK,
                 **NODE_KINDS}.get(s.kind, 0)
    mode = 0o777 if s.kind == "symlink" else (s.mode or 0)
    return f"{kind_bits | mode:06o}"


def _name(p: bytes) -> str:
    return os.fsdecode(p)


def _hunks(a: list[str], b: list[str], old_name: str, new_name: str) -> list[str]:
    out = []
    for line in difflib.unified_diff(a, b, old_name, new_name, n=3):
        if line.endswith("\n"):
            out.append(line)
        else:
            out.append(line + "\n\\ No newline at end of file\n")
    return out


def _section(objects: ObjectStore, conn: Connection, path: bytes, old_path: bytes, before: State, after: State) -> list[str]:
    a_name, b_name = "a/" + _name(old_path), "b/" + _name(path)
    out = [f"diff --git {a_name} {b_name}\n"]
    if before.kind is None:
        out.append(f"new {'directory' if after.kind == 'dir' else 'file'} mode {_git_mode(after)}\n")
    elif after.kind is None:
        out.append(f"deleted {'directory' if before.kind == 'dir' else 'file'} mode {_git_mode(before)}\n")
    else:
        if old_path != path:
            out += ["similarity index 100%\n" if (before.oid, before.target) == (after.oid, after.target) else "",
                    f"rename from {_name(old_path)}\n", f"rename to {_name(path)}\n"]
        if _git_mode(before) != _git_mode(after):
            out += [f"old mode {_git_mode(before)}\n", f"new mode {_git_mode(after)}\n"]
    if "dir" in (before.kind, after.kind) or (before.oid, before.target) == (after.oid, after.target):
        return [line for line in out if line]
    c = Change(path, before, after)
    a, b, _, _ = lines_of(objects, conn, c)
    from_name = "/dev/null" if before.kind is None else a_name
    to_name = "/dev/null" if after.kind is None else b_name
    if a is None or b is None:
        out.append(f"Binary files {from_name} and {to_name} differ\n")
    else:
        out += _hunks(a, b, from_name, to_name)
    return [line for line in out if line]


def patch(objects: ObjectStore, conn: Connection, changes: list[Change]) -> str:
    """A git-style unified diff of ``changes``.  A change of kind (a file
    replaced by a symlink, say) is shown as a deletion and an addition."""
    out: list[str] = []
    for c in changes:
        old_path = c.old_path if c.old_path is not None else c.path
        if c.before.kind is not None and c.after.kind is not None and c.before.kind != c.after.kind:
            out += _section(objects, conn, old_path, old_path, c.before, State(None))
            out += _section(objects, conn, c.path, c.path, State(None), c.after)
        else:
            out += _section(objects, conn, c.path, old_path, c.before, c.after)
    return "".join(out)


def read_changes(ws: Workspace, old: int, new: int, paths: list[bytes] | None = None) -> tuple[list[Change], str]:
    """:func:`changes_between` and their :func:`patch`, in one read
    transaction of ``ws`` (for callers that hold a workspace, not a transaction)."""
    with ws.db.read() as conn:
        changes = changes_between(conn, old, new, paths)
        return changes, patch(ws.objects, conn, changes)
