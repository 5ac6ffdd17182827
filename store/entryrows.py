"""The plain-SQL reads of the entry tables (format 8: ``paths``,
``layer_entries``, ``path_layers``; no SQLAlchemy import): the half of the
entry seam (``store/entrytable.py``) that ``store/cardrows.py`` runs, so
that the CLI's ``log`` and ``show`` read a store without importing
SQLAlchemy, and that ``entrytable`` runs for its history reads.

Each function takes ``fetch(sql, params) -> list of tuples`` (``?``
placeholders), as :class:`store.cardrows.Rows` holds it.  Oids come back
as hex keys.  A layer's entries are its lists decoded
(``store/entrylist.py``); a path's layers are ``path_layers`` rows; a
path id becomes its bytes by walking ``paths`` up to the root (0).
"""

from __future__ import annotations

from bisect import bisect_left
from collections import namedtuple
from typing import Callable, Iterable

from stepfs.store import baseref, entrylist
from stepfs.store.records import Entry, State

Fetch = Callable[[str, tuple], list]

#: Variables in one statement at most (SQLite's default limit is 32,766).
BATCH = 900
#: Layers committed (SQL for ``IN``).
COMMITTED = "SELECT number FROM layers WHERE state = 'committed'"


#: One entry of one layer, by field name (what ``entrytable.entry_from_row``
#: reads), plus the fields some queries add (``message`` …).  A named tuple:
#: made in C, which matters for the 30,000 rows of a session's history.
Row = namedtuple("Row", ("layer",) + entrylist.COLUMNS + ("message", "created_ns", "kind"), defaults=(None,) * 3)


def row_of(layer: int, values: tuple, path: bytes, extra: dict | None = None) -> Row:
    """The :class:`Row` of a decoded list row whose path is ``path``."""
    return Row(layer, path, *values[1:], **(extra or {}))


def entry_of(values: tuple, path: bytes) -> Entry:
    """An :class:`Entry` from a decoded list row whose path is ``path``."""
    (_p, bk, bm, bo, bt, bu, bg, bx, ak, am, ao, at, au, ag, ax, mt, link) = values
    return Entry(path=path, before=State(bk, bm, bo, bt, bu, bg, bx), after=State(ak, am, ao, at, au, ag, ax),
                 after_mtime_ns=mt, after_link=link)


# -- paths ---------------------------------------------------------------------------


def path_id(fetch: Fetch, path: bytes) -> int | None:
    """The id of ``path``'s node, or None if no entry ever named it."""
    node = 0
    for name in path.split(b"/"):
        rows = fetch("SELECT id FROM paths WHERE parent = ? AND name = ?", (node, name))
        if not rows:
            return None
        node = rows[0][0]
    return node


def names(fetch: Fetch, ids: Iterable[int]) -> dict[int, bytes]:
    """``{id: path}`` for the nodes ``ids`` (a level of the tree a query)."""
    nodes: dict[int, tuple[int, bytes]] = {}
    want = set(ids) - {0}
    while want:
        todo = sorted(want)
        want = set()
        for i in range(0, len(todo), BATCH):
            part = todo[i:i + BATCH]
            for id_, parent, name in fetch(f"SELECT id, parent, name FROM paths WHERE id IN ({', '.join('?' * len(part))})",
                                           tuple(part)):
                nodes[id_] = (parent, bytes(name))
                if parent and parent not in nodes:
                    want.add(parent)
    out: dict[int, bytes] = {}

    def full(id_: int) -> bytes:
        got = out.get(id_)
        if got is None:
            parent, name = nodes[id_]
            got = out[id_] = full(parent) + b"/" + name if parent else name
        return got

    for id_ in ids:
        if id_:
            full(id_)
    return out


SUBTREE = ("WITH RECURSIVE sub(id) AS (SELECT id FROM paths WHERE parent = ? "
           "UNION ALL SELECT p.id FROM paths p JOIN sub ON p.parent = sub.id) ")


def subtree(fetch: Fetch, node: int) -> list[int]:
    """The ids strictly below node ``node`` (0: every node)."""
    return [r[0] for r in fetch(SUBTREE + "SELECT id FROM sub", (node,))]


# -- lists ---------------------------------------------------------------------------


def decoded(fetch: Fetch, where: str = "", params: tuple = ()) -> list[tuple[int, list[tuple]]]:
    """``(layer, rows)`` of every list matching ``where`` (SQL on
    ``layer_entries``), by layer then first path id."""
    return [(layer, entrylist.decode(data)) for layer, data in
            fetch(f"SELECT layer, data FROM layer_entries {where} ORDER BY layer, first", params)]


def layer_rows(fetch: Fetch, number: int) -> list[tuple]:
    """Layer ``number``'s decoded rows, by path id."""
    return [r for _n, rows in decoded(fetch, "WHERE layer = ?", (number,)) for r in rows]


def layer_entries(fetch: Fetch, number: int) -> list[Entry]:
    """Layer ``number``'s entries in path order."""
    rows = layer_rows(fetch, number)
    paths = names(fetch, [r[0] for r in rows])
    return sorted((entry_of(r, paths[r[0]]) for r in rows), key=lambda e: e.path)


def rows_at(fetch: Fetch, pairs: Iterable[tuple[int, int]], extra: dict[int, dict] | None = None) -> list[Row]:
    """The rows of the ``(layer, path id)`` pairs, by path then layer: the
    lists of those layers read in one statement a batch, each path found
    by bisection in its (cached, path-id-sorted) decoded list."""
    by_layer: dict[int, set[int]] = {}
    for layer, pid in pairs:
        by_layer.setdefault(layer, set()).add(pid)
    found: list[tuple[int, tuple]] = []
    numbers = sorted(by_layer)
    for i in range(0, len(numbers), BATCH):
        part = numbers[i:i + BATCH]
        for layer, data in fetch(f"SELECT layer, data FROM layer_entries WHERE layer IN ({', '.join('?' * len(part))})",
                                 tuple(part)):
            rows = entrylist.decode(data)
            pids = by_layer[layer]
            if len(pids) * 16 > len(rows):
                found += [(layer, r) for r in rows if r[0] in pids]
                continue
            for pid in pids:
                j = bisect_left(rows, (pid,))  # (pid,) sorts before every row of pid
                if j < len(rows) and rows[j][0] == pid:
                    found.append((layer, rows[j]))
    paths = names(fetch, {r[0] for _l, r in found})
    extra = extra or {}
    out = [row_of(layer, r, paths[r[0]], extra.get(layer)) for layer, r in found]
    out.sort(key=lambda row: (row.path, row.layer))
    return out


#: ``(layer, path id)`` of committed layers' entries, joined with the
#: layer: given ``layer IN (committed layers)`` instead, SQLite probed
#: (path, layer) once per committed layer for every path (180 ms for the
#: 3,600 paths of a session's node_modules, against 35 ms joined).
_PAIRS = ("SELECT pl.layer, pl.path FROM path_layers pl JOIN layers l ON l.number = pl.layer "
          "WHERE l.state = 'committed' AND pl.path IN ({ids})")


def committed_pairs(fetch: Fetch, ids: list[int]) -> list[tuple[int, int]]:
    """``(layer, path id)`` of the committed layers' entries at ``ids``."""
    out: list[tuple[int, int]] = []
    for i in range(0, len(ids), BATCH):
        part = ids[i:i + BATCH]
        out += fetch(_PAIRS.format(ids=", ".join("?" * len(part))), tuple(part))
    return out


def committed_pairs_under(fetch: Fetch, node: int) -> list[tuple[int, int]]:
    """``(layer, path id)`` of the committed layers' entries strictly below
    node ``node``, in one statement."""
    return fetch(SUBTREE + "SELECT pl.layer, pl.path FROM sub JOIN path_layers pl ON pl.path = sub.id "
                 "JOIN layers l ON l.number = pl.layer WHERE l.state = 'committed'", (node,))


# -- cards ---------------------------------------------------------------------------


def layer_counts(fetch: Fetch, numbers: list[int] | None = None) -> dict[int, tuple[int, int, int]]:
    """``{layer: (added, deleted, entries)}`` for the layers ``numbers``
    (at most the store's variable limit of them), or for every layer with
    entries (None)."""
    if numbers is None:
        lists = decoded(fetch)
    else:
        lists = decoded(fetch, f"WHERE layer IN ({', '.join('?' * len(numbers))})", tuple(numbers))
    out: dict[int, tuple[int, int, int]] = {}
    for layer, rows in lists:
        a, d, t = out.get(layer, (0, 0, 0))
        out[layer] = (a + sum(r[1] is None for r in rows), d + sum(r[8] is None for r in rows), t + len(rows))
    return out


def committed_refs(fetch: Fetch) -> list[tuple[int, str | None, str | None]]:
    """``(layer, before_oid, after_oid)`` of every committed row, by layer."""
    return [(layer, r[3], r[10]) for layer, rows in decoded(fetch, f"WHERE layer IN ({COMMITTED})") for r in rows]


def added_bytes(fetch: Fetch, top: int) -> list[tuple[int, int]]:
    """``(layer, bytes)``: what each committed layer up to ``top`` added to
    the store (each object goes to the first layer naming it, each piece to
    the first layer of an object holding it).  The first layer of each
    object comes from the lists; its pieces are read by key, a batch of
    objects a statement (a join on anything but the keys scanned every
    object for each one: minutes on the agent session's store)."""
    first: dict[bytes, int] = {}
    for layer, data in fetch(f"SELECT layer, data FROM layer_entries WHERE layer <= ? AND layer IN ({COMMITTED}) "
                             f"ORDER BY layer, first", (top,)):
        for pair in entrylist.stored_oids(data):
            for oid in pair:
                if oid is not None and oid not in first:
                    first[oid] = layer
    piece_layer: dict[tuple[int, bytes], int] = {}
    piece_size: dict[tuple[int, bytes], int] = {}
    items = list(first.items())
    for i in range(0, len(items), BATCH // 2):
        part = items[i:i + BATCH // 2]
        values = ", ".join("(?, ?)" for _ in part)
        params = tuple(x for oid, layer in part for x in (oid, layer))
        for layer, inline, piece, size in fetch(_PIECES.format(values=values), params):
            key = (inline, bytes(piece))
            if key not in piece_layer or layer < piece_layer[key]:
                piece_layer[key] = layer
            piece_size[key] = size or 0
    out: dict[int, int] = {}
    for key, layer in piece_layer.items():
        out[layer] = out.get(layer, 0) + piece_size[key]
    return sorted(out.items())


#: Each piece of a batch of objects ``(oid, layer)``: a chunk, a delta's
#: base chunk, an inline object or its base, with its stored length.
_PIECES = """
WITH first_obj(oid, layer) AS (VALUES {values})
SELECT f.layer, 0, oc.cid, length(c.data) FROM first_obj f JOIN object_chunks oc ON oc.oid = f.oid
  JOIN chunks c ON c.cid = oc.cid
UNION ALL
SELECT f.layer, 0, c.base, (SELECT length(data) FROM chunks WHERE cid = c.base) FROM first_obj f
  JOIN object_chunks oc ON oc.oid = f.oid JOIN chunks c ON c.cid = oc.cid WHERE c.base IS NOT NULL
UNION ALL
SELECT f.layer, 1, o.oid, length(o.data) FROM first_obj f JOIN objects o ON o.oid = f.oid WHERE o.data IS NOT NULL
UNION ALL
SELECT f.layer, 1, b.oid, length(b.data)
  FROM first_obj f JOIN objects o ON o.oid = f.oid
  JOIN objects b ON b.oid >= o.base AND b.oid < """ + baseref.TOP_SQL.format(col="o.base") + """
   AND b.data IS NOT NULL AND (b.codec IS NULL OR b.codec != 2)
 WHERE o.data IS NOT NULL AND o.base IS NOT NULL
"""
# (Format 10: a delta names its base by a key prefix, store/baseref.py; a
# collision counts the other object too.)
