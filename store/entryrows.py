"""The plain-SQL queries on the ``entries`` table (no SQLAlchemy import):
the half of the entry seam (``store/entrytable.py``) that
``store/cardrows.py`` runs, so that the CLI's ``log`` and ``show`` read a
store without importing SQLAlchemy.

Each function takes ``fetch(sql, params) -> list of tuples`` (``?``
placeholders), as :class:`store.cardrows.Rows` holds it.  Oids come back
as hex keys except where a docstring says stored keys.
"""

from __future__ import annotations

from typing import Callable

from stepfs.store.keytext import from_db
from stepfs.store.records import Entry, State

Fetch = Callable[[str, tuple], list]

_ENTRY_COLUMNS = ("path, before_kind, before_mode, before_oid, before_target, before_uid, before_gid, before_xattrs, "
                  "after_kind, after_mode, after_oid, after_target, after_uid, after_gid, after_xattrs, "
                  "after_mtime_ns, after_link")


def _b(v) -> bytes | None:
    return bytes(v) if v is not None else None


def entry_from_tuple(r) -> Entry:
    """An :class:`Entry` from a row of :data:`_ENTRY_COLUMNS`."""
    return Entry(
        path=bytes(r[0]),
        before=State(r[1], r[2], from_db(r[3]), _b(r[4]), r[5], r[6], _b(r[7])),
        after=State(r[8], r[9], from_db(r[10]), _b(r[11]), r[12], r[13], _b(r[14])),
        after_mtime_ns=r[15], after_link=_b(r[16]),
    )


def layer_entries(fetch: Fetch, number: int) -> list[Entry]:
    """Layer ``number``'s entries in path order."""
    return [entry_from_tuple(r) for r in
            fetch(f"SELECT {_ENTRY_COLUMNS} FROM entries WHERE layer = ? ORDER BY path", (number,))]


_COUNTS = ("SELECT layer, SUM(CASE WHEN before_kind IS NULL THEN 1 ELSE 0 END), "
           "SUM(CASE WHEN after_kind IS NULL THEN 1 ELSE 0 END), COUNT(path) FROM entries")


def layer_counts(fetch: Fetch, numbers: list[int] | None = None) -> dict[int, tuple[int, int, int]]:
    """``{layer: (added, deleted, entries)}`` for the layers ``numbers``
    (through the entries' primary key: a few layers cost what they hold;
    at most the store's variable limit of them), or for every layer with
    entries (None)."""
    if numbers is None:
        rows = fetch(_COUNTS + " GROUP BY layer", ())
    else:
        rows = fetch(_COUNTS + f" WHERE layer IN ({', '.join('?' * len(numbers))}) GROUP BY layer", tuple(numbers))
    return {layer: (int(a or 0), int(d or 0), int(t or 0)) for layer, a, d, t in rows}


def committed_refs(fetch: Fetch) -> list[tuple[int, str | None, str | None]]:
    """``(layer, before_oid, after_oid)`` of every committed row, by layer."""
    return [(layer, from_db(b), from_db(a)) for layer, b, a in fetch(
        "SELECT layer, before_oid, after_oid FROM entries WHERE layer IN "
        "(SELECT number FROM layers WHERE state = 'committed') ORDER BY layer", ())]


def added_bytes(fetch: Fetch, top: int) -> list[tuple[int, int]]:
    """``(layer, bytes)``: what each committed layer up to ``top`` added to
    the store (each object goes to the first layer naming it, each piece to
    the first layer of an object holding it), in one statement."""
    return fetch(_ADDED_BYTES, (top, top))


#: Each piece is a chunk, a delta's base chunk, an inline object or its base.
_ADDED_BYTES = """
WITH refs(layer, oid) AS (
    SELECT e.layer, e.before_oid FROM entries e JOIN layers l ON l.number = e.layer
     WHERE l.state = 'committed' AND e.layer <= ? AND e.before_oid IS NOT NULL
    UNION ALL
    SELECT e.layer, e.after_oid FROM entries e JOIN layers l ON l.number = e.layer
     WHERE l.state = 'committed' AND e.layer <= ? AND e.after_oid IS NOT NULL),
first_obj(oid, layer) AS (SELECT oid, MIN(layer) FROM refs GROUP BY oid),
pieces(inline, piece, layer) AS (
    SELECT 0, oc.cid, f.layer FROM first_obj f JOIN object_chunks oc ON oc.oid = f.oid
      JOIN chunks c ON c.cid = oc.cid
    UNION ALL
    SELECT 0, c.base, f.layer FROM first_obj f JOIN object_chunks oc ON oc.oid = f.oid
      JOIN chunks c ON c.cid = oc.cid WHERE c.base IS NOT NULL
    UNION ALL
    SELECT 1, o.oid, f.layer FROM first_obj f JOIN objects o ON o.oid = f.oid WHERE o.data IS NOT NULL
    UNION ALL
    SELECT 1, o.base, f.layer FROM first_obj f JOIN objects o ON o.oid = f.oid
     WHERE o.data IS NOT NULL AND o.base IS NOT NULL),
first_piece(inline, piece, layer) AS (SELECT inline, piece, MIN(layer) FROM pieces GROUP BY inline, piece)
SELECT fp.layer, SUM(CASE WHEN fp.inline = 0 THEN (SELECT length(data) FROM chunks WHERE cid = fp.piece)
                          ELSE (SELECT length(data) FROM objects WHERE oid = fp.piece AND data IS NOT NULL) END)
  FROM first_piece fp GROUP BY fp.layer
"""
