"""Change cards: what a layer did, per path, in words and line counts.

Pure reads of the store, through ``cardrows.Rows`` (plain SQL, so the
CLI's no-mount ``log`` and ``show`` need no SQLAlchemy; the functions that
take ``objects, conn`` wrap the connection in one).  A card lists every path a layer touched with its
operation (added, modified, deleted, renamed, mode, replaced), lines added
and removed for text, byte sizes for binary content (see ``store.diff`` for
what counts as text), the layer's message, agent and metadata.  A rollback
that has not happened yet (``--dry-run``) gets a card through
:func:`card_for` from the entries it would write.

A ``.git`` directory's churn (an agent running ``git commit`` in the mount
touches dozens of objects) is folded by default into one entry of the card's
``folded`` list (``.git/``, with its counts); the per-file list, the file and
line counts and the layer's patch then hold only the rest.  ``fold=False``
lists everything.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

from stepfs.store import linecounts, records
from stepfs.store.cardrows import Rows
from stepfs.store.contained import DEVICE_KINDS, rdev_of
from stepfs.store.errors import CorruptObject
from stepfs.store.records import Change, State

#: Kept for callers of the old name: files above this size are not line-counted.
LINE_COUNT_LIMIT = records.TEXT_LIMIT

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection

    from stepfs.store.objects import ObjectStore
    from stepfs.store.workspace import Workspace


#: Directory names whose contents a card folds into one line by default.
FOLDED_NAMES = (".git",)


def fold_root(path: str) -> str | None:
    """The folded directory ``path`` is or lies in (``.git``, ``sub/.git``),
    or None."""
    parts = path.split("/")
    for i, part in enumerate(parts):
        if part in FOLDED_NAMES:
            return "/".join(parts[:i + 1])
    return None


def split_folded(changes: list[Change]) -> tuple[list[Change], dict[str, list[Change]]]:
    """``changes`` outside every folded directory, and the rest by directory."""
    kept: list[Change] = []
    folded: dict[str, list[Change]] = {}
    for c in changes:
        root = fold_root(os.fsdecode(c.path))
        if root is None:
            kept.append(c)
        else:
            folded.setdefault(root, []).append(c)
    return kept, folded


def _fold_entry(root: str, changes: list[Change]) -> dict:
    ops = [c.op for c in changes]
    added, deleted, renamed = ops.count("added"), ops.count("deleted"), ops.count("renamed")
    return {"path": root + "/", "files": len(ops), "added": added, "deleted": deleted, "renamed": renamed,
            "modified": len(ops) - added - deleted - renamed}


def _state(s: State) -> dict:
    out = {"kind": s.kind, "mode": s.mode, "oid": s.oid}
    if s.kind == "symlink":
        out["target"] = os.fsdecode(s.target or b"")
    elif s.kind in DEVICE_KINDS:
        out["rdev"] = rdev_of(s.kind, s.target)
    return out


def file_card(objects: ObjectStore, conn: Connection, c: Change, tolerant: bool = False) -> dict:
    """:func:`card_entry` read through ``conn``."""
    return card_entry(Rows.over(conn, objects.hasher), c, tolerant)


def card_entry(rows: Rows, c: Change, tolerant: bool = False, counts: dict | None = None,
               layer: int | None = None) -> dict:
    """One path of a card.  ``tolerant``: a file whose bytes cannot be read
    back (a corrupt chunk) gets ``unreadable: True`` and no line counts
    instead of failing the card (``log`` lists layers from their rows,
    whatever the chunks).  ``counts``: remembered line counts by object
    pair (``store/linecounts.py``); a pair not in it is computed from the
    objects' bytes and added to it, and, when the change is one of committed
    layer ``layer``'s, to ``rows.computed[layer]``."""
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
    pair = linecounts.pair_of(c)
    got = counts.get(pair) if counts is not None else None
    if got is None:
        try:
            got = linecounts.compute(rows, pair)
        except CorruptObject:
            if not tolerant:
                raise
            out.update(unreadable=True)
            return out
        if layer is not None:
            rows.computed.setdefault(layer, {})[pair] = got
        if counts is not None:
            counts[pair] = got
    added, removed, n_old, n_new = got
    if added is None:
        out.update(binary=True, bytes_before=n_old, bytes_after=n_new)
        return out
    out.update(binary=False, lines_added=added, lines_removed=removed)
    return out


def card_for(objects: ObjectStore, conn: Connection, header: dict, changes: list[Change],
             fold: bool = True, tolerant: bool = False, layer: int | None = None) -> dict:
    """:func:`card_of` read through ``conn``."""
    return card_of(Rows.over(conn, objects.hasher), header, changes, fold, tolerant, layer)


def card_of(rows: Rows, header: dict, changes: list[Change], fold: bool = True, tolerant: bool = False,
            layer: int | None = None) -> dict:
    """A card from a layer header (number, kind, created_ns, message, agent,
    mount, meta) and its changes; with ``fold``, each ``.git`` directory is
    one entry of ``folded`` (its files are not read) instead of one per path
    (``tolerant``: see :func:`card_entry`).  ``layer``: the committed layer
    the changes are (some of) the changes of, whose remembered line counts
    serve them (``store/linecounts.py``); None computes every count."""
    kept, folded = split_folded(changes) if fold else (changes, {})
    counts = linecounts.lookup(rows, layer) if layer is not None and kept else {}
    files = [card_entry(rows, c, tolerant, counts, layer) for c in kept]
    ops = [f["op"] for f in files]
    return {
        **header,
        "time": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(header["created_ns"] / 1e9)),
        "added": ops.count("added"), "deleted": ops.count("deleted"), "renamed": ops.count("renamed"),
        "modified": len(ops) - ops.count("added") - ops.count("deleted") - ops.count("renamed"),
        "lines_added": sum(f.get("lines_added", 0) for f in files),
        "lines_removed": sum(f.get("lines_removed", 0) for f in files),
        "files": files,
        "folded": [_fold_entry(root, cs) for root, cs in sorted(folded.items())],
    }


def header(layer: records.Layer) -> dict:
    return {
        "number": layer.number, "kind": layer.kind, "created_ns": layer.created_ns, "message": layer.message,
        "agent": layer.agent, "mount": layer.mount, "meta": layer.meta,
    }


def _changes(rows: Rows, number: int) -> list[Change]:
    """Layer ``number``'s entries as changes, renames paired (``diff.from_entries``)."""
    return records.pair_renames([Change(e.path, e.before, e.after) for e in rows.entries(number)], rows.size)


def card(objects: ObjectStore, conn: Connection, number: int, fold: bool = True) -> dict:
    """:func:`card_at` read through ``conn``."""
    return card_at(Rows.over(conn, objects.hasher), number, fold)


def card_at(rows: Rows, number: int, fold: bool = True) -> dict:
    """The card of committed layer ``number``; raises NoSuchLayer."""
    layer = rows.layer(number)
    c = card_of(rows, header(layer), _changes(rows, number), fold, layer=number)
    c["stored_bytes"] = rows.added_bytes([number])[number]
    return c


def layer_patch(objects: ObjectStore, conn: Connection, number: int, fold: bool = True) -> str:
    """The unified diff of what layer ``number`` changed (with ``fold``,
    nothing inside a ``.git`` directory)."""
    from stepfs.store import diff, layers

    layers.get(conn, number)
    changes = diff.from_entries(conn, layers.entries(conn, number))
    return diff.patch(objects, conn, split_folded(changes)[0] if fold else changes)


def log(objects: ObjectStore, conn: Connection, limit: int | None = None, fold: bool = True) -> list[dict]:
    """:func:`log_of` read through ``conn``."""
    return log_of(Rows.over(conn, objects.hasher), limit, fold)


def log_of(rows: Rows, limit: int | None = None, fold: bool = True) -> list[dict]:
    """Committed layers, newest first, each as its card without the per-file
    list (``files`` holds the count; ``folded`` stays a list).  Line counts
    are read from ``layer_counts`` (``store/linecounts.py``); only a change
    not counted there reads its content.  A file whose chunks are corrupt is counted in
    ``unreadable`` instead of failing the listing (``stepfs verify`` names it)."""
    out = []
    listed = rows.layers(limit=limit)
    added = rows.added_bytes([layer.number for layer in listed])
    for layer in listed:
        c = card_of(rows, header(layer), _changes(rows, layer.number), fold, tolerant=True, layer=layer.number)
        unreadable = sum(1 for f in c["files"] if f.get("unreadable"))
        if unreadable:
            c["unreadable"] = unreadable
        c["files"] = len(c["files"])
        c["stored_bytes"] = added[layer.number]  # what the layer added to the store (store/du.py)
        out.append(c)
    return out


# -- for callers that hold a workspace, not a transaction (the CLI) --------------


def read_log(ws: Workspace, limit: int | None = None, fold: bool = True) -> list[dict]:
    """:func:`log` in one read transaction of ``ws``; the line counts it
    had to compute are remembered after it (``store/linecounts.py``)."""
    with ws.db.read() as conn:
        rows = Rows.over(conn, ws.objects.hasher)
        out = log_of(rows, limit=limit, fold=fold)
    linecounts.remember(ws, rows.computed)
    return out


def read_card(ws: Workspace, number: int, with_patch: bool = False, fold: bool = True) -> tuple[dict, str | None]:
    """:func:`card` of layer ``number`` and, if asked, its :func:`layer_patch`,
    in one read transaction of ``ws`` (line counts as :func:`read_log`)."""
    with ws.db.read() as conn:
        rows = Rows.over(conn, ws.objects.hasher)
        out = (card_at(rows, number, fold), layer_patch(ws.objects, conn, number, fold) if with_patch else None)
    linecounts.remember(ws, rows.computed)
    return out
