"""The history in pages, for a reader that shows it (store side, no FUSE).

Pure reads of the store.  ``stepfs serve`` shows a history of any length
and layers of any size without loading either whole:

* :func:`layer_page`: committed layers newest first, ``limit`` at a time
  below a layer number (keyset pagination: a page costs what its layers
  hold, wherever it starts), filtered by path (layers that touched it or
  anything below it) and by metadata (``key=value`` pairs, all required);
* :func:`card_page`: one layer's change card with a slice of its files;
* :func:`touching`: the layers that touched one path, newest first.

Line counts read the content of every changed text file, so a timeline row
counts lines only for layers of at most :data:`LINE_COUNT_FILES` files.
"New content" is the size of the content objects a layer references (before
or after) that no earlier layer references: what the layer brought into the
store's history, before chunk deduplication and compression.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from sqlalchemy import func, select
from sqlalchemy.engine import Connection

from stepfs.store import cards, diff, entrytable, layers, schema
from stepfs.store.history import require_layer
from stepfs.store.objects import ObjectStore

L = schema.layers

#: A timeline row counts lines for layers with at most this many files.
LINE_COUNT_FILES = 200
#: Layers read per round while a metadata filter skips non-matching ones.
_BATCH = 200


@dataclass
class Page:
    """A page of layers (each a card without its file list: ``files`` is the
    count) and the ``before`` value of the next page (None: no more)."""

    rows: list[dict] = field(default_factory=list)
    next_before: int | None = None


def _meta_matches(meta: dict, wanted: dict[str, str]) -> bool:
    return all(k in meta and str(meta[k]) == v for k, v in wanted.items())


def layer_page(objects: ObjectStore, conn: Connection, *, before: int | None = None, limit: int = 50,
               path: bytes | None = None, meta: dict[str, str] | None = None) -> Page:
    """Committed layers numbered below ``before`` (all when None), newest
    first, at most ``limit``, that touched ``path`` (or below it) and carry
    every ``meta`` pair."""
    q = select(L.c.number, L.c.meta).where(L.c.state == "committed").order_by(L.c.number.desc())
    if path is not None:
        q = q.where(L.c.number.in_(entrytable.layers_touching(path)))
    chosen: list[int] = []
    more = False
    cursor = before
    while True:
        batch_q = q if cursor is None else q.where(L.c.number < cursor)
        batch = conn.execute(batch_q.limit(_BATCH if meta else limit + 1)).all()
        for number, meta_text in batch:
            if meta and not _meta_matches(json.loads(meta_text or "{}"), meta):
                continue
            if len(chosen) == limit:
                more = True
                break
            chosen.append(number)
        if more or not batch or not meta or len(batch) < _BATCH:
            break
        cursor = batch[-1][0]
    return Page(rows=_rows(objects, conn, chosen), next_before=chosen[-1] if more and chosen else None)


def _rows(objects: ObjectStore, conn: Connection, numbers: list[int]) -> list[dict]:
    if not numbers:
        return []
    new_bytes = new_content(conn, numbers)
    out = []
    for number in numbers:
        layer = layers.get(conn, number)
        row = {**cards.header(layer), "time": cards.card_for(objects, conn, cards.header(layer), [])["time"],
               "added": layer.added, "modified": layer.modified, "deleted": layer.deleted,
               "files": layer.added + layer.modified + layer.deleted, "new_bytes": new_bytes.get(number, 0),
               "lines_added": None, "lines_removed": None}
        if row["files"] <= LINE_COUNT_FILES:
            c = cards.card(objects, conn, number)
            row["lines_added"], row["lines_removed"] = c["lines_added"], c["lines_removed"]
            row["renamed"] = c["renamed"]
        out.append(row)
    return out


def new_content(conn: Connection, numbers: list[int]) -> dict[int, int]:
    """``{layer: bytes}``: the size of the content objects each of the
    layers ``numbers`` references that no earlier committed layer does."""
    return entrytable.first_referencing(conn, numbers)


def card_page(objects: ObjectStore, conn: Connection, number: int, offset: int = 0,
              limit: int = 100) -> tuple[dict, list[diff.Change]]:
    """The card of layer ``number`` with files ``offset`` to ``offset+limit``
    and those files' changes (for their diffs)
    (in path order, renames paired over the whole layer); ``total_files``
    counts them all.  The header's file and line totals are the whole
    layer's when it has at most :data:`LINE_COUNT_FILES` files, else the
    file totals are and the line totals are None."""
    layer = layers.get(conn, number)
    changes = diff.from_entries(conn, layers.entries(conn, number))
    head = cards.header(layer)
    page = cards.card_for(objects, conn, head, changes[offset:offset + limit], layer=number)
    if len(changes) <= LINE_COUNT_FILES and (offset > 0 or len(changes) > limit):
        whole = cards.card_for(objects, conn, head, changes, layer=number)
        page.update({k: whole[k] for k in ("added", "deleted", "renamed", "modified",
                                           "lines_added", "lines_removed")})
    elif len(changes) > LINE_COUNT_FILES:
        ops = [c.op for c in changes]
        renamed = ops.count("renamed")
        page.update(added=ops.count("added"), deleted=ops.count("deleted"), renamed=renamed,
                    modified=len(ops) - ops.count("added") - ops.count("deleted") - renamed,
                    lines_added=None, lines_removed=None)
    page["total_files"] = len(changes)
    page["offset"] = offset
    return page, changes[offset:offset + limit]


def change_at(conn: Connection, number: int, path: bytes) -> diff.Change | None:
    """The change layer ``number`` made at ``path`` (a rename is found by
    its new path), or None."""
    for c in diff.from_entries(conn, layers.entries(conn, number)):
        if c.path == path:
            return c
    return None


def touching(conn: Connection, path: bytes, limit: int = 100) -> list[dict]:
    """The newest ``limit`` committed layers that changed ``path`` itself:
    ``[{number, op, message, created_ns, kind}]``."""
    rows = entrytable.path_history(conn, path, limit)
    return [{"number": r.layer, "op": entrytable.entry_from_row(r).op, "message": r.message,
             "created_ns": r.created_ns, "kind": r.kind} for r in rows]


def layer_exists(conn: Connection, number: int) -> None:
    """NoSuchLayer unless ``number`` is a committed layer."""
    require_layer(conn, number)


def activity(conn: Connection) -> tuple:
    """A value that changes whenever the head, an open step's number of
    staged rows or the list of conflicts changes (what a live view polls;
    cheap: three indexed aggregates)."""
    from stepfs.store import staging

    steps = tuple((s["id"], s["staged"]) for s in staging.list_steps(conn))
    conflicts = conn.execute(select(func.count(), func.max(schema.conflicts.c.id))).one()
    return layers.head(conn), steps, tuple(conflicts)
