"""Change cards: what a layer did, per path, in words and line counts.

Pure reads of the store.  A card lists every path a layer touched with its
operation (added, modified, deleted, renamed, mode, replaced), lines added
and removed for text, byte sizes for binary content (see ``store.diff`` for
what counts as text), the layer's message, agent and metadata.  A rollback
that has not happened yet (``--dry-run``) gets a card through
:func:`card_for` from the entries it would write.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

from sqlalchemy.engine import Connection

from stepfs.store import diff, du, layers
from stepfs.store.contained import DEVICE_KINDS, rdev_of
from stepfs.store.objects import ObjectStore

#: Kept for callers of the old name: files above this size are not line-counted.
LINE_COUNT_LIMIT = diff.TEXT_LIMIT

if TYPE_CHECKING:
    from stepfs.store.workspace import Workspace


def _state(s: layers.State) -> dict:
    out = {"kind": s.kind, "mode": s.mode, "oid": s.oid}
    if s.kind == "symlink":
        out["target"] = os.fsdecode(s.target or b"")
    elif s.kind in DEVICE_KINDS:
        out["rdev"] = rdev_of(s.kind, s.target)
    return out


def file_card(objects: ObjectStore, conn: Connection, c: diff.Change) -> dict:
    out = {
        "path": os.fsdecode(c.path), "op": c.op, "kind": c.after.kind or c.before.kind,
        "before": _state(c.before), "after": _state(c.after),
    }
    if c.old_path is not None:
        out["from"] = os.fsdecode(c.old_path)
    if "file" not in (c.before.kind, c.after.kind):
        return out
    if c.before.kind == c.after.kind and c.before.oid == c.after.oid:
        out.update(binary=False, lines_added=0, lines_removed=0)
        return out
    only_files = diff.Change(c.path, c.before if c.before.kind == "file" else layers.State(None),
                             c.after if c.after.kind == "file" else layers.State(None))
    a, b, n_old, n_new = diff.lines_of(objects, conn, only_files)
    if a is None or b is None:
        out.update(binary=True, bytes_before=n_old, bytes_after=n_new)
        return out
    added, removed = diff.count_lines(a, b)
    out.update(binary=False, lines_added=added, lines_removed=removed)
    return out


def card_for(objects: ObjectStore, conn: Connection, header: dict, changes: list[diff.Change]) -> dict:
    """A card from a layer header (number, kind, created_ns, message, agent,
    mount, meta) and its changes."""
    files = [file_card(objects, conn, c) for c in changes]
    ops = [f["op"] for f in files]
    return {
        **header,
        "time": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(header["created_ns"] / 1e9)),
        "added": ops.count("added"), "deleted": ops.count("deleted"), "renamed": ops.count("renamed"),
        "modified": len(ops) - ops.count("added") - ops.count("deleted") - ops.count("renamed"),
        "lines_added": sum(f.get("lines_added", 0) for f in files),
        "lines_removed": sum(f.get("lines_removed", 0) for f in files),
        "files": files,
    }


def header(layer: layers.Layer) -> dict:
    return {
        "number": layer.number, "kind": layer.kind, "created_ns": layer.created_ns, "message": layer.message,
        "agent": layer.agent, "mount": layer.mount, "meta": layer.meta,
    }


def card(objects: ObjectStore, conn: Connection, number: int) -> dict:
    """The card of committed layer ``number``; raises NoSuchLayer."""
    layer = layers.get(conn, number)
    c = card_for(objects, conn, header(layer), diff.from_entries(conn, layers.entries(conn, number)))
    c["stored_bytes"] = du.added_bytes(conn, [number])[number]
    return c


def layer_patch(objects: ObjectStore, conn: Connection, number: int) -> str:
    """The unified diff of what layer ``number`` changed."""
    layers.get(conn, number)
    return diff.patch(objects, conn, diff.from_entries(conn, layers.entries(conn, number)))


def log(objects: ObjectStore, conn: Connection, limit: int | None = None) -> list[dict]:
    """Committed layers, newest first, each as its card without the per-file
    list (``files`` holds the count).  Line counts read the content of every
    changed text file, so this costs what the layers changed."""
    out = []
    listed = layers.list_layers(conn, limit=limit)
    added = du.added_bytes(conn, [layer.number for layer in listed])
    for layer in listed:
        c = card_for(objects, conn, header(layer), diff.from_entries(conn, layers.entries(conn, layer.number)))
        c["files"] = len(c["files"])
        c["stored_bytes"] = added[layer.number]  # what the layer added to the store (store/du.py)
        out.append(c)
    return out


# -- for callers that hold a workspace, not a transaction (the CLI) --------------


def read_log(ws: Workspace, limit: int | None = None) -> list[dict]:
    """:func:`log` in one read transaction of ``ws``."""
    with ws.db.read() as conn:
        return log(ws.objects, conn, limit=limit)


def read_card(ws: Workspace, number: int, with_patch: bool = False) -> tuple[dict, str | None]:
    """:func:`card` of layer ``number`` and, if asked, its :func:`layer_patch`,
    in one read transaction of ``ws``."""
    with ws.db.read() as conn:
        return card(ws.objects, conn, number), layer_patch(ws.objects, conn, number) if with_patch else None
