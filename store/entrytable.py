"""Every query on the entry tables (format 8: ``paths``, ``layer_entries``,
``path_layers``; store side, no FUSE): the one place that knows how a
layer's entries are stored (``docs/format8.md``, ``store/FORMAT.md``).

The rest of the store asks for what it needs, never for SQL on the tables:
a layer's entries (:func:`layer_entries`, through :mod:`store.entryrows`,
the plain-SQL half of this seam that the CLI's SQLAlchemy-free ``log`` and
``show`` also use), the committed rows of a path (:func:`path_rows`), of
everything below a directory (:func:`rows_under`), of the paths some layers
touched (:func:`rows_touched`), the newest row of a path at or before a
layer (:func:`newest_at_or_before`), a path's history (:func:`path_history`),
writing and deleting a layer's entries (:func:`insert`, :func:`delete_layer`),
prune's fold (:func:`fold_rows`, :func:`replace_through`) and the objects
the entries reference (:func:`referenced_oids`, :func:`unreferenced_sql`).

Rows handed out carry ``layer`` plus the entry's columns by name (what
:func:`entry_from_row` reads); oids are hex keys.  Committed means the
row's layer is committed.  A layer's entries are read from its lists
(decoded once, cached by their bytes: ``store/entrylist.py``); which
layers hold a path comes from ``path_layers``; "below a directory" is the
subtree of its node in ``paths``.
"""

from __future__ import annotations

from collections import namedtuple
from typing import Iterable

from sqlalchemy import literal, or_, select
from sqlalchemy.engine import Connection

from stepfs.store import entrylist, entryrows, schema
from stepfs.store.entryrows import COMMITTED, Row, row_of
from stepfs.store.keytext import to_db
from stepfs.store.records import Entry, State

P, LE, PL = schema.paths, schema.layer_entries, schema.path_layers


def _fetch(conn: Connection):
    """``fetch(sql, params)`` on the DBAPI connection of ``conn`` (same
    transaction): the entry reads are plain SQL, and SQLAlchemy's statement
    setup cost more than the query for the few-row reads a commit makes."""
    raw = conn.connection.dbapi_connection

    def fetch(sql: str, params: tuple = ()) -> list:
        cur = raw.cursor()
        try:
            return cur.execute(sql, tuple(params)).fetchall()
        finally:
            cur.close()

    return fetch


# -- writing -------------------------------------------------------------------------


def path_ids(conn: Connection, paths: Iterable[bytes]) -> dict[bytes, int]:
    """``{path: id}``, making the nodes ``paths`` and their directories
    lack (in the caller's transaction; an id is never reused)."""
    cur = conn.connection.dbapi_connection.cursor()
    known: dict[bytes, int] = {}
    out: dict[bytes, int] = {}
    try:
        for path in paths:
            node, prefix = 0, b""
            for name in path.split(b"/"):
                prefix = prefix + b"/" + name if prefix else name
                got = known.get(prefix)
                if got is None:
                    row = cur.execute("SELECT id FROM paths WHERE parent = ? AND name = ?", (node, name)).fetchone()
                    if row is None:
                        cur.execute("INSERT INTO paths (parent, name) VALUES (?, ?)", (node, name))
                        got = cur.lastrowid
                    else:
                        got = row[0]
                    known[prefix] = got
                node = got
            out[path] = node
    finally:
        cur.close()
    return out


def _values(pid: int, e: Entry) -> tuple:
    b, a = e.before, e.after
    return (pid, b.kind, b.mode, b.oid, b.target, b.uid, b.gid, b.xattrs,
            a.kind, a.mode, a.oid, a.target, a.uid, a.gid, a.xattrs, e.after_mtime_ns, e.after_link)


def _marked(fetch, number: int, rows: list[tuple]) -> list[tuple]:
    """``rows`` (of layer ``number``) with each ``before_oid`` that repeats
    the ``after_oid`` of the path's newest entry below as a marker
    (``entrylist.PREVIOUS``, format 11), where that newest entry's layer,
    of any state, is committed: the reader resolves a marker against the
    newest committed layer below, and a committed layer stays committed."""
    want = [r[0] for r in rows if r[3] is not None]
    prev: dict[int, int] = {}
    for i in range(0, len(want), entryrows.BATCH):
        part = want[i:i + entryrows.BATCH]
        prev.update(fetch(f"SELECT path, MAX(layer) FROM path_layers WHERE layer < ? AND path IN "
                          f"({', '.join('?' * len(part))}) GROUP BY path", (number, *part)))
    if not prev:
        return rows
    layers = sorted(set(prev.values()))
    lists: dict[int, list[list[tuple]]] = {}
    for i in range(0, len(layers), entryrows.BATCH):
        part = layers[i:i + entryrows.BATCH]
        marks = ", ".join("?" * len(part))
        for layer, data in fetch(f"SELECT e.layer, e.data FROM layer_entries e JOIN layers l ON l.number = e.layer "
                                 f"WHERE e.layer IN ({marks}) AND l.state = 'committed'", tuple(part)):
            lists.setdefault(layer, []).append(entrylist.decode(data))
    out = []
    for r in rows:
        layer = prev.get(r[0])
        if r[3] is not None and layer in lists:
            got = entryrows._find(lists[layer], r[0])
            if got is not None and got[10] == r[3]:
                r = r[:3] + (entrylist.PREVIOUS,) + r[4:]
        out.append(r)
    return out


def insert(conn: Connection, number: int, entries: Iterable[Entry]) -> None:
    """Write ``entries`` as layer ``number``'s (in the caller's transaction):
    its lists (befores that repeat the previous after as markers) and its
    ``path_layers`` rows."""
    entries = list(entries)
    if not entries:
        return
    ids = path_ids(conn, [e.path for e in entries])
    rows = sorted((_values(ids[e.path], e) for e in entries), key=lambda r: r[0])
    rows = _marked(_fetch(conn), number, rows)
    cur = conn.connection.dbapi_connection.cursor()
    try:
        for part in entrylist.split(rows):
            data = entrylist.encode(part)
            entrylist.remember(data, part)
            cur.execute("INSERT INTO layer_entries (layer, first, n, data) VALUES (?, ?, ?, ?)",
                        (number, part[0][0], len(part), data))
        cur.executemany("INSERT INTO path_layers (path, layer) VALUES (?, ?)", [(r[0], number) for r in rows])
    finally:
        cur.close()


def mark_every_list(conn: Connection) -> None:
    """Write every list again with its markers (the upgrade to format 11,
    ``store/upgrade11.py``): read in layer order, a ``before_oid`` that
    equals the ``after_oid`` of the path's newest entry below becomes a
    marker where that entry's layer is committed (:func:`_marked`'s rule);
    markers already there (a store upgraded through format 8's
    :func:`insert`) resolve in memory as the reader resolves them."""
    cur = conn.connection.dbapi_connection.cursor()
    try:
        committed = {n for (n,) in cur.execute(entryrows.COMMITTED)}
        last: dict[int, tuple[str | None, bool]] = {}  # path id -> (after_oid of its newest entry, committed)
        resolved: dict[int, str | None] = {}  # path id -> after_oid of its newest committed entry
        for id_, layer, data in cur.execute("SELECT id, layer, data FROM layer_entries ORDER BY layer, first").fetchall():
            rows = entrylist.decode(data)
            new = []
            for r in rows:
                if r[3] is entrylist.PREVIOUS:
                    r = r[:3] + (resolved.get(r[0]),) + r[4:]
                prev = last.get(r[0])
                if r[3] is not None and prev is not None and prev[1] and prev[0] == r[3]:
                    r = r[:3] + (entrylist.PREVIOUS,) + r[4:]
                new.append(r)
                last[r[0]] = (r[10], layer in committed)
                if layer in committed:
                    resolved[r[0]] = r[10]
            if new != rows:
                cur.execute("UPDATE layer_entries SET data = ? WHERE id = ?", (entrylist.encode(new), id_))
    finally:
        cur.close()


def delete_layer(conn: Connection, number: int) -> None:
    """Delete layer ``number``'s entries (a withdrawn intent)."""
    conn.execute(LE.delete().where(LE.c.layer == number))
    conn.execute(PL.delete().where(PL.c.layer == number))


def _unmark_dropped(conn: Connection, keep: int, folded: list[Entry]) -> None:
    """Before prune deletes the entries up to ``keep``: a marker above
    ``keep`` that points at a layer up to ``keep`` for a path the fold
    drops (it ended where it began) would point at nothing; its list is
    written again with the explicit oid (same transaction)."""
    fetch = _fetch(conn)
    below = {pid for (pid,) in fetch("SELECT DISTINCT path FROM path_layers WHERE layer <= ?", (keep,))}
    dropped = sorted(below - set(path_ids(conn, [e.path for e in folded]).values()))
    layers: set[int] = set()
    for i in range(0, len(dropped), entryrows.BATCH):
        part = dropped[i:i + entryrows.BATCH]
        layers.update(n for (n,) in fetch(f"SELECT DISTINCT layer FROM path_layers WHERE layer > ? AND path IN "
                                          f"({', '.join('?' * len(part))})", (keep, *part)))
    if not layers:
        return
    gone = set(dropped)
    lists = []
    for layer in sorted(layers):
        for first, data in fetch("SELECT first, data FROM layer_entries WHERE layer = ?", (layer,)):
            rows = entrylist.decode(data)
            if any(r[3] is entrylist.PREVIOUS and r[0] in gone for r in rows):
                lists.append((layer, first, rows))
    pairs = [(layer, r[0]) for layer, _f, rows in lists for r in rows if r[3] is entrylist.PREVIOUS and r[0] in gone]
    target = entryrows.previous_layers(fetch, pairs)
    afters = entryrows.previous_afters(fetch, [p for p in pairs if target[p] is not None and target[p] <= keep])
    cur = conn.connection.dbapi_connection.cursor()
    try:
        for layer, first, rows in lists:
            new = [r[:3] + (afters[(layer, r[0])],) + r[4:] if (layer, r[0]) in afters else r for r in rows]
            if new != rows:
                data = entrylist.encode(new)
                entrylist.remember(data, new)
                cur.execute("UPDATE layer_entries SET data = ? WHERE layer = ? AND first = ?", (data, layer, first))
    finally:
        cur.close()


def replace_through(conn: Connection, keep: int, folded: list[Entry]) -> None:
    """Prune's write: the entries of every layer up to ``keep`` become
    ``folded``, layer ``keep``'s (in the caller's transaction)."""
    _unmark_dropped(conn, keep, folded)
    conn.execute(LE.delete().where(LE.c.layer <= keep))
    conn.execute(PL.delete().where(PL.c.layer <= keep))
    insert(conn, keep, folded)


# -- one layer -----------------------------------------------------------------------


def layer_entries(conn: Connection, number: int) -> list[Entry]:
    """Layer ``number``'s entries in path order (``entryrows.layer_entries``)."""
    return entryrows.layer_entries(_fetch(conn), number)


def entry_from_row(r) -> Entry:
    """An :class:`Entry` from a row this module handed out."""
    return Entry(
        path=r.path,
        before=State(r.before_kind, r.before_mode, r.before_oid, r.before_target,
                     r.before_uid, r.before_gid, r.before_xattrs),
        after=State(r.after_kind, r.after_mode, r.after_oid, r.after_target,
                    r.after_uid, r.after_gid, r.after_xattrs),
        after_mtime_ns=r.after_mtime_ns,
        after_link=r.after_link,
    )


def modified_files(conn: Connection, number: int) -> list[tuple]:
    """``(before_oid, after_oid, after size, after stored inline)`` of each
    file layer ``number`` changed in place (a file before and after, the
    content differs)."""
    cur = conn.connection.dbapi_connection.cursor()
    out = []
    try:
        for r in entryrows.layer_rows(_fetch(conn), number):
            if r[1] == "file" and r[8] == "file" and r[3] != r[10] and r[3] is not None and r[10] is not None:
                got = cur.execute("SELECT size, data IS NOT NULL FROM objects WHERE oid = ?", (to_db(r[10]),)).fetchone()
                if got is not None:
                    out.append((r[3], r[10], got[0], bool(got[1])))
    finally:
        cur.close()
    return out


# -- paths through history -----------------------------------------------------------


def _rows_of_ids(fetch, ids: list[int]) -> list[Row]:
    return entryrows.rows_at(fetch, entryrows.committed_pairs(fetch, ids))


def path_rows(conn: Connection, path: bytes) -> list:
    """The committed rows of ``path``, oldest layer first."""
    fetch = _fetch(conn)
    pid = entryrows.path_id(fetch, path)
    return [] if pid is None else _rows_of_ids(fetch, [pid])


def rows_under(conn: Connection, path: bytes) -> list:
    """The committed rows of every path strictly below directory ``path``
    (``b"."``: every path), by path then layer."""
    if path == b".":
        return all_rows(conn)
    fetch = _fetch(conn)
    pid = entryrows.path_id(fetch, path)
    return [] if pid is None else entryrows.rows_at(fetch, entryrows.committed_pairs_under(fetch, pid))


def _rows_of_layers(fetch, where: str, params: tuple = ()) -> list[Row]:
    """The rows of the lists ``where`` names: every committed layer's up to
    some layer (markers resolve in memory, ``entryrows.resolve``)."""
    found = [(layer, r) for layer, rows in entryrows.decoded(fetch, where, params, prefix=True) for r in rows]
    paths = entryrows.names(fetch, {r[0] for _l, r in found})
    out = [row_of(layer, r, paths[r[0]]) for layer, r in found]
    out.sort(key=lambda row: (row.path, row.layer))
    return out


def all_rows(conn: Connection) -> list:
    """Every committed row, by path then layer."""
    return _rows_of_layers(_fetch(conn), f"WHERE layer IN ({COMMITTED})")


def _with_subtrees(fetch, paths: list[bytes]) -> list[int]:
    ids: list[int] = []
    for p in paths:
        pid = entryrows.path_id(fetch, p)
        if pid is not None:
            ids += [pid] + entryrows.subtree(fetch, pid)
    return ids


def rows_touched(conn: Connection, after: int, through: int | None = None,
                 paths: list[bytes] | None = None) -> list:
    """Every committed row (of any layer) of each path that a committed
    layer in ``after < layer <= through`` (no upper bound for None) touched,
    restricted to ``paths`` and below them (None: every path); by path
    then layer."""
    fetch = _fetch(conn)
    where, params = f"WHERE layer > ? AND layer IN ({COMMITTED})", (after,)
    if through is not None:
        where, params = where + " AND layer <= ?", params + (through,)
    # From the lists of those layers (a few, usually), not a scan of path_layers.
    touched = {r[0] for _n, rows in entryrows.decoded(fetch, where, params, resolve_markers=False) for r in rows}
    if paths and b"." not in paths:
        touched &= set(_with_subtrees(fetch, paths))
    touched = sorted(touched)
    return _rows_of_ids(fetch, touched)


def _one(conn: Connection, path: bytes, sql: str, number: int):
    fetch = _fetch(conn)
    pid = entryrows.path_id(fetch, path)
    if pid is None:
        return None
    got = fetch(sql, (pid, number))
    if not got:
        return None
    rows = entryrows.rows_at(fetch, [(got[0][0], pid)])
    return rows[0] if rows else None


def newest_at_or_before(conn: Connection, path: bytes, number: int):
    """The newest committed row of ``path`` in a layer <= ``number``, or None."""
    return _one(conn, path, "SELECT pl.layer FROM path_layers pl JOIN layers l ON l.number = pl.layer "
                            "WHERE pl.path = ? AND pl.layer <= ? AND l.state = 'committed' "
                            "ORDER BY pl.layer DESC LIMIT 1", number)


def oldest_after(conn: Connection, path: bytes, number: int):
    """The oldest committed row of ``path`` in a layer > ``number``, or None."""
    return _one(conn, path, "SELECT pl.layer FROM path_layers pl JOIN layers l ON l.number = pl.layer "
                            "WHERE pl.path = ? AND pl.layer > ? AND l.state = 'committed' "
                            "ORDER BY pl.layer LIMIT 1", number)


def _node(path: bytes):
    """A scalar subquery: the id of ``path``'s node (NULL if none)."""
    node = literal(0)
    for name in path.split(b"/"):
        node = select(P.c.id).where(P.c.parent == node, P.c.name == name).scalar_subquery()
    return node


def layers_touching(path: bytes):
    """A subquery: the numbers of the layers with an entry at ``path`` or
    below it (any state; the caller filters)."""
    node = _node(path)
    sub = select(P.c.id).where(P.c.parent == node).cte("subtree", recursive=True)
    sub = sub.union_all(select(P.c.id).join(sub, P.c.parent == sub.c.id))
    return select(PL.c.layer).where(or_(PL.c.path == node, PL.c.path.in_(select(sub.c.id)))).distinct()


def every_path(conn: Connection) -> set[bytes]:
    """Every path any layer's entries name (all states, pruned folds included)."""
    fetch = _fetch(conn)
    return set(entryrows.names(fetch, [r[0] for r in fetch("SELECT DISTINCT path FROM path_layers", ())]).values())


def path_history(conn: Connection, path: bytes, limit: int) -> list:
    """The newest ``limit`` committed rows of ``path`` itself, newest first,
    each with its layer's ``message``, ``created_ns`` and ``kind``."""
    fetch = _fetch(conn)
    pid = entryrows.path_id(fetch, path)
    if pid is None:
        return []
    layers = fetch("SELECT pl.layer, l.message, l.created_ns, l.kind FROM path_layers pl "
                   "JOIN layers l ON l.number = pl.layer WHERE pl.path = ? AND l.state = 'committed' "
                   "ORDER BY pl.layer DESC LIMIT ?", (pid, limit))
    extra = {n: {"message": m, "created_ns": c, "kind": k} for n, m, c, k in layers}
    rows = entryrows.rows_at(fetch, [(n, pid) for n in extra], extra)
    return sorted(rows, key=lambda r: -r.layer)


def ever_linked(conn: Connection, path: bytes) -> bool:
    """Whether a layer published ``path`` as a hard link, or another name
    as a hard link of it (any layer's lists: a rollback may link a name to
    a path it has no entry for; only asked for a file with several links)."""
    fetch = _fetch(conn)
    pid = entryrows.path_id(fetch, path)
    if pid is not None:
        for (number,) in fetch("SELECT layer FROM path_layers WHERE path = ?", (pid,)):
            if any(r[0] == pid and r[16] is not None for _n, rows in
                   entryrows.decoded(fetch, "WHERE layer = ?", (number,), resolve_markers=False) for r in rows):
                return True
    return any(r[16] == path for _n, rows in entryrows.decoded(fetch, resolve_markers=False) for r in rows)


def list_problems(conn: Connection) -> list[str]:
    """What is wrong with the stored entries (``verify``): a list that does
    not decode or does not match its row, ``path_layers`` rows that are not
    the lists' paths, a path id with no node."""
    fetch = _fetch(conn)
    out: list[str] = []
    seen: dict[int, set[int]] = {}
    committed = {n for (n,) in fetch(entryrows.COMMITTED, ())}
    last: dict[int, str | None] = {}  # path id -> after_oid of its newest committed entry so far
    for layer, first, n, data in fetch("SELECT layer, first, n, data FROM layer_entries ORDER BY layer, first"):
        try:
            rows = entrylist.decode(data)
        except entrylist.ListDamaged as exc:
            out.append(f"layer {layer}: {exc}")
            continue
        for r in rows:
            if r[3] is entrylist.PREVIOUS and last.get(r[0]) is None:
                out.append(f"layer {layer}: the before state of path id {r[0]} names the previous entry's object "
                           f"(format 11), and no committed layer below has one")
            if layer in committed:
                last[r[0]] = r[10]
        ids = [r[0] for r in rows]
        if len(rows) != n or not rows or ids[0] != first or any(a >= b for a, b in zip(ids, ids[1:])):
            out.append(f"layer {layer}: the entry list from path id {first} does not match its row "
                       f"(count, first path or order)")
        seen.setdefault(layer, set()).update(ids)
    indexed: dict[int, set[int]] = {}
    for path, layer in fetch("SELECT path, layer FROM path_layers", ()):
        indexed.setdefault(layer, set()).add(path)
    for layer in sorted(set(seen) | set(indexed)):
        if seen.get(layer, set()) != indexed.get(layer, set()):
            out.append(f"layer {layer}: path_layers does not list the paths of its entry lists")
    try:
        entryrows.names(fetch, set().union(*seen.values()))
    except KeyError as exc:
        out.append(f"an entry list names path id {exc.args[0]}, which is no node of paths")
    return out


# -- prune ---------------------------------------------------------------------------


def fold_rows(conn: Connection, keep_from: int) -> list:
    """The rows of every committed layer up to ``keep_from``, by path then
    layer (prune folds them into one layer)."""
    return _rows_of_layers(_fetch(conn), f"WHERE layer <= ? AND layer IN ({COMMITTED})", (keep_from,))


# -- the objects entries reference ---------------------------------------------------

#: The temp table :func:`prepare_sweep` fills with the referenced keys.
REFS_TABLE = "temp.stepfs_entry_oids"


def unreferenced_sql(column: str) -> str:
    """A plain-SQL condition for gc's sweep: no entry (of any layer) names
    the stored key in ``column`` (after :func:`prepare_sweep` in the same
    transaction)."""
    return f"{column} NOT IN (SELECT oid FROM {REFS_TABLE})"


def prepare_sweep(conn: Connection) -> None:
    """Fill the table :func:`unreferenced_sql` reads with every key the
    entries of any layer name (the lists are blobs SQL cannot look into)."""
    conn.exec_driver_sql(f"DROP TABLE IF EXISTS {REFS_TABLE}")
    conn.exec_driver_sql(f"CREATE TABLE {REFS_TABLE} (oid BLOB PRIMARY KEY) WITHOUT ROWID")
    keys: set[bytes] = set()
    for (data,) in _fetch(conn)("SELECT data FROM layer_entries", ()):
        for pair in entrylist.stored_oids(data):  # only the oid columns, as stored
            keys.update(k for k in pair if k is not None)
    cur = conn.connection.dbapi_connection.cursor()
    try:
        cur.executemany(f"INSERT INTO {REFS_TABLE} (oid) VALUES (?)", [(k,) for k in keys])
    finally:
        cur.close()


def referenced_oids(conn: Connection, after: int | None = None) -> set[str]:
    """The objects the entries of every layer (any state) name, or only of
    the layers numbered above ``after``."""
    where, params = ("", ()) if after is None else ("WHERE layer > ?", (after,))
    out: set[str] = set()
    for _n, rows in entryrows.decoded(_fetch(conn), where, params, prefix=after is None):
        for r in rows:
            if r[3]:
                out.add(r[3])
            if r[10]:
                out.add(r[10])
    return out


#: One entry's object references (``object_refs``, ``committed_object_refs``).
Ref = namedtuple("Ref", "layer path before_oid after_oid")


def _refs(conn: Connection, where: str, strict: bool = True) -> list[tuple]:
    fetch = _fetch(conn)
    # Every layer's lists or every committed one's: markers resolve in memory.
    found = [(layer, r) for layer, rows in entryrows.decoded(fetch, where, prefix=True, strict=strict) for r in rows]
    paths = entryrows.names(fetch, {r[0] for _l, r in found})
    out = [Ref(layer, paths[r[0]], r[3], r[10]) for layer, r in found]
    out.sort(key=lambda t: (t[0], t[1]))
    return out


def object_refs(conn: Connection) -> list[tuple]:
    """``(layer, path, before_oid, after_oid)`` of every row, any state
    (``verify``; an unresolvable marker gives None: ``list_problems`` names it)."""
    return _refs(conn, "", strict=False)


def committed_object_refs(conn: Connection) -> list:
    """``(layer, path, before_oid, after_oid)`` of every committed row, by
    layer then path (``du``)."""
    return _refs(conn, f"WHERE layer IN ({COMMITTED})")


def first_referencing(conn: Connection, numbers: list[int]) -> dict[int, int]:
    """``{layer: bytes}``: the size of the content objects each of the
    layers ``numbers`` references that no earlier committed layer does."""
    wanted = set(numbers)
    first: dict[str, int] = {}
    for layer, before, after in entryrows.committed_refs(_fetch(conn)):
        for oid in (before, after):
            if oid is not None and oid not in first:
                first[oid] = layer
    mine = [oid for oid, layer in first.items() if layer in wanted]
    out: dict[int, int] = {}
    cur = conn.connection.dbapi_connection.cursor()
    try:
        for oid in mine:
            got = cur.execute("SELECT size FROM objects WHERE oid = ?", (to_db(oid),)).fetchone()
            if got is not None:
                out[first[oid]] = out.get(first[oid], 0) + int(got[0] or 0)
    finally:
        cur.close()
    return out
