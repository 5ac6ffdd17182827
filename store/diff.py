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
import stat as stat_mod
from typing import TYPE_CHECKING

from sqlalchemy.engine import Connection

from stepfs.store import entrytable
from stepfs.store.contained import NODE_KINDS
from stepfs.store.history import require_layer, state_from_rows
from stepfs.store import records
from stepfs.store.records import TEXT_LIMIT, Change, Entry, State, count_lines, text_lines  # noqa: F401  (their home before records.py)
from stepfs.store.objects import ObjectStore

if TYPE_CHECKING:
    from stepfs.store.workspace import Workspace


# -- which paths changed ------------------------------------------------------------


def changes_between(conn: Connection, old: int, new: int, paths: list[bytes] | None = None) -> list[Change]:
    """Every path (restricted to ``paths`` and below) whose state as of layer
    ``old`` differs from its state as of layer ``new``; renames paired.
    Raises NoSuchLayer for a layer that is not committed."""
    require_layer(conn, old)
    require_layer(conn, new)
    lo, hi = min(old, new), max(old, new)
    by_path: dict[bytes, list] = {}
    for row in entrytable.rows_touched(conn, lo, hi, paths):
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


def pair_renames(conn: Connection, changes: list[Change]) -> list[Change]:
    """:func:`records.pair_renames` with object sizes read through ``conn``."""
    return records.pair_renames(changes, lambda oid: ObjectStore.size(conn, oid))


# -- content ---------------------------------------------------------------------------


def content(objects: ObjectStore, conn: Connection, state: State) -> bytes:
    """A file's bytes or a symlink's target; empty for anything else."""
    if state.kind == "file" and state.oid is not None:
        return objects.read_all(conn, state.oid)
    if state.kind == "symlink":
        return state.target or b""
    return b""


def sizes(conn: Connection, c: Change) -> tuple[int, int]:
    def one(s: State) -> int:
        if s.kind == "file" and s.oid is not None:
            return ObjectStore.size(conn, s.oid)
        if s.kind == "symlink":
            return len(s.target or b"")
        return 0

    return one(c.before), one(c.after)


def lines_of(objects: ObjectStore, conn: Connection, c: Change) -> tuple[list[str] | None, list[str] | None, int, int]:
    """:func:`records.lines_of` with sizes and bytes read through ``conn``."""
    return records.lines_of(c, lambda oid: objects.size(conn, oid), lambda oid: objects.read_all(conn, oid))


# -- unified diff ------------------------------------------------------------------------


def _git_mode(s: State) -> str:
    kind_bits = {"file": stat_mod.S_IFREG, "dir": stat_mod.S_IFDIR, "symlink": stat_mod.S_IFLNK,
                 **NODE_KINDS}.get(s.kind, 0)
    mode = 0o777 if s.kind == "symlink" else (s.mode or 0)
    return f"{kind_bits | mode:06o}"


_C_ESCAPES = {7: "\\a", 8: "\\b", 9: "\\t", 10: "\\n", 11: "\\v", 12: "\\f", 13: "\\r", 34: '\\"', 92: "\\\\"}


def git_quote(name: bytes) -> str:
    """A path as git writes it in a patch: as is, or, if it holds a control
    byte, a quote, a backslash or a byte above 0x7f, in double quotes with
    C escapes and octal (git's ``quote_c_style`` with ``core.quotePath``):
    a newline in a name cannot break the patch, an escape sequence cannot
    reach a terminal, and ``git apply`` reads the name back."""
    if not any(b < 0x20 or b >= 0x7f or b in (34, 92) for b in name):
        return name.decode("ascii")
    return '"' + "".join(_C_ESCAPES.get(b) or (chr(b) if 0x20 <= b < 0x7f else f"\\{b:03o}") for b in name) + '"'


def _name(p: bytes, prefix: bytes = b"") -> str:
    return git_quote(prefix + p)


def _hunks(a: list[str], b: list[str], old_name: str, new_name: str) -> list[str]:
    out = []
    for line in difflib.unified_diff(a, b, old_name, new_name, n=3):
        if line.endswith("\n"):
            out.append(line)
        else:
            out.append(line + "\n\\ No newline at end of file\n")
    return out


def _section(objects: ObjectStore, conn: Connection, path: bytes, old_path: bytes, before: State, after: State) -> list[str]:
    a_name, b_name = _name(old_path, b"a/"), _name(path, b"b/")
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
