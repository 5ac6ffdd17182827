"""Change cards: what a layer did, per path, in words and line counts.

Pure reads of the store.  Text is anything without a NUL byte in its first
8 KiB that decodes as UTF-8 (git's heuristic, roughly); for binary content
the card reports byte sizes instead of lines.
"""

from __future__ import annotations

import difflib
import os
import time

from sqlalchemy.engine import Connection

from . import layers
from .objects import ObjectStore

#: Above this size a file's lines are not counted (the card says so).
LINE_COUNT_LIMIT = 4 << 20


def _text(data: bytes) -> list[str] | None:
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8").splitlines(keepends=True)
    except UnicodeDecodeError:
        return None


def line_counts(a: list[str], b: list[str]) -> tuple[int, int]:
    """``(added, removed)`` lines from ``a`` to ``b``, from the matcher's
    opcodes (not by parsing diff text, where a removed ``-- x`` line looks
    like a ``---`` header)."""
    added = removed = 0
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b).get_opcodes():
        if tag != "equal":
            removed += i2 - i1
            added += j2 - j1
    return added, removed


def content(objects: ObjectStore, conn: Connection, state: layers.State) -> bytes:
    if state.kind == "file" and state.oid is not None:
        return objects.read_all(conn, state.oid)
    if state.kind == "symlink":
        return state.target or b""
    return b""


def file_card(objects: ObjectStore, conn: Connection, e: layers.Entry) -> dict:
    out = {
        "path": os.fsdecode(e.path), "op": e.op, "kind": e.after.kind or e.before.kind,
        "before": {"kind": e.before.kind, "mode": e.before.mode, "oid": e.before.oid},
        "after": {"kind": e.after.kind, "mode": e.after.mode, "oid": e.after.oid},
    }
    if "file" not in (e.before.kind, e.after.kind):
        return out
    sizes = [objects.size(conn, s.oid) if s.kind == "file" and s.oid else 0 for s in (e.before, e.after)]
    if max(sizes) > LINE_COUNT_LIMIT:
        out.update(binary=None, bytes_before=sizes[0], bytes_after=sizes[1])
        return out
    old = content(objects, conn, e.before) if e.before.kind == "file" else b""
    new = content(objects, conn, e.after) if e.after.kind == "file" else b""
    a, b = _text(old), _text(new)
    if a is None or b is None:
        out.update(binary=True, bytes_before=len(old), bytes_after=len(new))
        return out
    added, removed = line_counts(a, b)
    out.update(binary=False, lines_added=added, lines_removed=removed)
    return out


def card(objects: ObjectStore, conn: Connection, number: int) -> dict:
    layer = layers.get(conn, number)
    files = [file_card(objects, conn, e) for e in layers.entries(conn, number)]
    return {
        "number": layer.number, "kind": layer.kind, "created_ns": layer.created_ns,
        "time": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(layer.created_ns / 1e9)),
        "message": layer.message, "agent": layer.agent, "mount": layer.mount, "meta": layer.meta,
        "added": layer.added, "modified": layer.modified, "deleted": layer.deleted,
        "lines_added": sum(f.get("lines_added", 0) for f in files),
        "lines_removed": sum(f.get("lines_removed", 0) for f in files),
        "files": files,
    }
