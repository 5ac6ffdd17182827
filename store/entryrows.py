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

Format 11: a list's ``before_oid`` may be a marker (``entrylist.PREVIOUS``:
"the ``after_oid`` of this path's entry in the newest committed layer below
this one"); every read here hands out resolved rows (:func:`resolve`),
except where only other columns are read (``resolve=False``).
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


# -- markers (format 11) -------------------------------------------------------------

PREVIOUS = entrylist.PREVIOUS


class Unresolved(entrylist.ListDamaged):
    """A marker whose path has no entry with an ``after_oid`` in a committed
    layer below (a damaged store; ``verify`` names it)."""


def _find(lists: list[list[tuple]], pid: int) -> tuple | None:
    """The row of ``pid`` in a layer's (path-id-sorted) lists, or None."""
    for rows in lists:
        j = bisect_left(rows, (pid,))  # (pid,) sorts before every row of pid
        if j < len(rows) and rows[j][0] == pid:
            return rows[j]
    return None


#: For each ``(layer, path id)``: the newest committed layer below it with an
#: entry at the path (a backward range of ``path_layers``' primary key).
_PREVIOUS_SQL = ("WITH want(layer, path) AS (VALUES {values}) SELECT w.layer, w.path, "
                 "(SELECT pl.layer FROM path_layers pl JOIN layers l ON l.number = pl.layer "
                 "WHERE pl.path = w.path AND pl.layer < w.layer AND l.state = 'committed' "
                 "ORDER BY pl.layer DESC LIMIT 1) FROM want w")


def previous_layers(fetch: Fetch, pairs: Iterable[tuple[int, int]]) -> dict[tuple[int, int], int | None]:
    """``{(layer, path id): the newest committed layer below it with an entry
    at the path}`` (None: none)."""
    pairs = sorted(set(pairs))
    target: dict[tuple[int, int], int | None] = {}
    for i in range(0, len(pairs), BATCH // 2):
        part = pairs[i:i + BATCH // 2]
        values = ", ".join("(?, ?)" for _ in part)
        for layer, pid, prev in fetch(_PREVIOUS_SQL.format(values=values), tuple(x for p in part for x in p)):
            target[(layer, pid)] = prev
    return target


def previous_afters(fetch: Fetch, pairs: Iterable[tuple[int, int]],
                    known: dict[int, list[list[tuple]]] | None = None) -> dict[tuple[int, int], str | None]:
    """``{(layer, path id): after_oid}`` of the path's entry in the newest
    committed layer below ``layer`` (None: no such entry, or no after
    object).  ``known``: lists already decoded, by layer (not read again)."""
    target = previous_layers(fetch, pairs)
    lists: dict[int, list[list[tuple]]] = dict(known or {})
    need = sorted({prev for prev in target.values() if prev is not None and prev not in lists})
    for i in range(0, len(need), BATCH):
        part = need[i:i + BATCH]
        for layer, data in fetch(f"SELECT layer, data FROM layer_entries WHERE layer IN ({', '.join('?' * len(part))}) "
                                 f"ORDER BY layer, first", tuple(part)):
            lists.setdefault(layer, []).append(entrylist.decode(data))
    out: dict[tuple[int, int], str | None] = {}
    for (layer, pid), prev in target.items():
        row = None if prev is None else _find(lists.get(prev, []), pid)
        out[(layer, pid)] = None if row is None else row[10]
    return out


def _resolved(rows: list[tuple], layer: int, afters: dict, strict: bool) -> list[tuple]:
    """``rows`` (of ``layer``) with each marker replaced by its oid."""
    out = []
    for r in rows:
        if r[3] is PREVIOUS:
            oid = afters.get((layer, r[0]))
            if oid is None and strict:
                raise Unresolved(f"layer {layer}: the before state of path id {r[0]} names the previous "
                                 f"entry's object, and no committed layer below has one")
            r = r[:3] + (oid,) + r[4:]
        out.append(r)
    return out


def resolve(fetch: Fetch, lists: list[tuple[int, list[tuple]]], prefix: bool = False,
            strict: bool = True) -> list[tuple[int, list[tuple]]]:
    """``lists`` (``(layer, rows)``, by layer) with their markers resolved
    (new row tuples; the decoded-list cache keeps the markers).  ``prefix``:
    ``lists`` hold every committed layer's lists below the newest of them,
    so markers resolve in memory in layer order, without a query.  An
    unresolvable marker raises :class:`Unresolved` (``strict``) or
    becomes None."""
    marked = [entrylist.has_markers(rows) for _l, rows in lists]
    if not any(marked):
        return lists
    if prefix:
        committed = {n for (n,) in fetch(COMMITTED, ())}
        last: dict[int, str | None] = {}
        out = []
        for (layer, rows), has in zip(lists, marked):
            if has:
                rows = _resolved(rows, layer, {(layer, r[0]): last.get(r[0]) for r in rows if r[3] is PREVIOUS},
                                 strict)
            if layer in committed:
                for r in rows:
                    last[r[0]] = r[10]
            out.append((layer, rows))
        return out
    known: dict[int, list[list[tuple]]] = {}
    for layer, rows in lists:
        known.setdefault(layer, []).append(rows)
    afters = previous_afters(fetch, [(layer, r[0]) for (layer, rows), has in zip(lists, marked) if has
                                     for r in rows if r[3] is PREVIOUS], known)
    return [(layer, _resolved(rows, layer, afters, strict) if has else rows)
            for (layer, rows), has in zip(lists, marked)]


# -- lists ---------------------------------------------------------------------------


def decoded(fetch: Fetch, where: str = "", params: tuple = (), resolve_markers: bool = True,
            prefix: bool = False, strict: bool = True) -> list[tuple[int, list[tuple]]]:
    """``(layer, rows)`` of every list matching ``where`` (SQL on
    ``layer_entries``), by layer then first path id; markers resolved
    unless not ``resolve_markers`` (a caller that reads no before oid, or
    takes a marker's None as "named by an earlier entry").  ``prefix``:
    see :func:`resolve`."""
    lists = [(layer, entrylist.decode(data)) for layer, data in
             fetch(f"SELECT layer, data FROM layer_entries {where} ORDER BY layer, first", params)]
    if not resolve_markers:
        return lists
    return resolve(fetch, lists, prefix=prefix, strict=strict)


def layer_rows(fetch: Fetch, number: int) -> list[tuple]:
    """Layer ``number``'s decoded rows (markers resolved), by path id."""
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
    known: dict[int, list[list[tuple]]] = {}
    numbers = sorted(by_layer)
    for i in range(0, len(numbers), BATCH):
        part = numbers[i:i + BATCH]
        for layer, data in fetch(f"SELECT layer, data FROM layer_entries WHERE layer IN ({', '.join('?' * len(part))})",
                                 tuple(part)):
            rows = entrylist.decode(data)
            known.setdefault(layer, []).append(rows)
            pids = by_layer[layer]
            if len(pids) * 16 > len(rows):
                found += [(layer, r) for r in rows if r[0] in pids]
                continue
            for pid in pids:
                j = bisect_left(rows, (pid,))  # (pid,) sorts before every row of pid
                if j < len(rows) and rows[j][0] == pid:
                    found.append((layer, rows[j]))
    marked = [(layer, r[0]) for layer, r in found if r[3] is PREVIOUS]
    if marked:
        afters = previous_afters(fetch, marked, known)
        found = [(layer, _resolved([r], layer, afters, True)[0] if r[3] is PREVIOUS else r) for layer, r in found]
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
        lists = decoded(fetch, resolve_markers=False)
    else:
        lists = decoded(fetch, f"WHERE layer IN ({', '.join('?' * len(numbers))})", tuple(numbers),
                        resolve_markers=False)
    out: dict[int, tuple[int, int, int]] = {}
    for layer, rows in lists:
        a, d, t = out.get(layer, (0, 0, 0))
        out[layer] = (a + sum(r[1] is None for r in rows), d + sum(r[8] is None for r in rows), t + len(rows))
    return out


def committed_refs(fetch: Fetch) -> list[tuple[int, str | None, str | None]]:
    """``(layer, before_oid, after_oid)`` of every committed row, by layer;
    a marker's before is None (its object is the previous entry's after,
    named earlier: what ``first_referencing`` counts is the same)."""
    return [(layer, None if r[3] is PREVIOUS else r[3], r[10])
            for layer, rows in decoded(fetch, f"WHERE layer IN ({COMMITTED})", resolve_markers=False) for r in rows]


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
