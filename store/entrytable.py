"""Every query on the ``entries`` table (store side, no FUSE): the seam a
new entry layout (``docs/format8.md``) replaces in one place.

The rest of the store asks for what it needs, never for SQL on the table:
a layer's entries (:func:`layer_entries`, through :mod:`store.entryrows`,
the plain-SQL half of this seam that the CLI's SQLAlchemy-free ``log`` and
``show`` also use), the committed rows of a path (:func:`path_rows`), of
everything below a directory (:func:`rows_under`), of the paths some layers
touched (:func:`rows_touched`), the newest row of a path at or before a
layer (:func:`newest_at_or_before`), a path's history (:func:`path_history`),
writing and deleting a layer's entries (:func:`insert`, :func:`delete_layer`),
prune's fold (:func:`fold_rows`, :func:`replace_through`) and the objects
the entries reference (:func:`referenced_oids`, :func:`unreferenced_sql`).

Rows handed out carry ``layer`` plus the table's columns by name (what
:func:`entry_from_row` reads); oids are hex keys.  Committed means the
row's layer is committed, read through a join with ``layers``.
"""

from __future__ import annotations

from typing import Iterable

from sqlalchemy import bindparam, func, or_, select, union_all
from sqlalchemy.engine import Connection

from stepfs.store import schema
from stepfs.store.cardrows import Rows
from stepfs.store.db import Prepared
from stepfs.store.records import Entry, State

E, L, O = schema.entries, schema.layers, schema.objects

_COMMITTED = select(L.c.number).where(L.c.state == "committed")


# -- writing -------------------------------------------------------------------------

_ENTRY_COLUMNS = [c.name for c in E.columns]

# Every commit runs it: compiled once, run on the DBAPI cursor (db.Prepared).
_INSERT = Prepared(E.insert(), _ENTRY_COLUMNS)


def entry_row(layer: int, e: Entry) -> dict:
    """The table row of entry ``e`` of layer ``layer``."""
    return {
        "layer": layer, "path": e.path,
        "before_kind": e.before.kind, "before_mode": e.before.mode,
        "before_oid": e.before.oid, "before_target": e.before.target,
        "after_kind": e.after.kind, "after_mode": e.after.mode,
        "after_oid": e.after.oid, "after_target": e.after.target,
        "after_mtime_ns": e.after_mtime_ns,
        "before_uid": e.before.uid, "before_gid": e.before.gid, "before_xattrs": e.before.xattrs,
        "after_uid": e.after.uid, "after_gid": e.after.gid, "after_xattrs": e.after.xattrs,
        "after_link": e.after_link,
    }


def insert(conn: Connection, number: int, entries: Iterable[Entry]) -> None:
    """Write ``entries`` as layer ``number``'s (in the caller's transaction)."""
    rows = [entry_row(number, e) for e in entries]
    if rows:
        _INSERT.executemany(conn, rows)


def delete_layer(conn: Connection, number: int) -> None:
    """Delete layer ``number``'s entries (a withdrawn intent)."""
    conn.execute(E.delete().where(E.c.layer == number))


def replace_through(conn: Connection, keep: int, folded: list[Entry]) -> None:
    """Prune's write: the entries of every layer up to ``keep`` become
    ``folded``, layer ``keep``'s (in the caller's transaction)."""
    conn.execute(E.delete().where(E.c.layer <= keep))
    if folded:
        conn.execute(E.insert(), [entry_row(keep, e) for e in folded])


# -- one layer -----------------------------------------------------------------------


def layer_entries(conn: Connection, number: int) -> list[Entry]:
    """Layer ``number``'s entries in path order (``entryrows.layer_entries``)."""
    return Rows.over(conn).entries(number)


def entry_from_row(r) -> Entry:
    """An :class:`Entry` from a row this module handed out."""
    def t(v):
        return bytes(v) if v is not None else None

    return Entry(
        path=bytes(r.path),
        before=State(r.before_kind, r.before_mode, r.before_oid, t(r.before_target),
                     r.before_uid, r.before_gid, t(r.before_xattrs)),
        after=State(r.after_kind, r.after_mode, r.after_oid, t(r.after_target),
                    r.after_uid, r.after_gid, t(r.after_xattrs)),
        after_mtime_ns=r.after_mtime_ns,
        after_link=t(r.after_link),
    )


# Run for every file a commit modified (delta.py): compiled once.
_MODIFIED_FILES = Prepared(select(E.c.before_oid, E.c.after_oid, O.c.size, O.c.data.is_not(None))
                           .join(O, O.c.oid == E.c.after_oid)
                           .where(E.c.layer == bindparam("n"), E.c.before_kind == bindparam("k1"),
                                  E.c.after_kind == bindparam("k2"), E.c.before_oid != E.c.after_oid))


def modified_files(conn: Connection, number: int) -> list[tuple]:
    """``(before_oid, after_oid, after size, after stored inline)`` of each
    file layer ``number`` changed in place (a file before and after, the
    content differs)."""
    return _MODIFIED_FILES.execute(conn, {"n": number, "k1": "file", "k2": "file"})


# -- paths through history -----------------------------------------------------------


def _committed_rows(conn: Connection, where, order_by_path: bool = True) -> list:
    """Committed entry rows matching the SQL condition ``where``.

    A join with the layer, not ``layer IN (committed layers)``: given that
    list, SQLite probed (path, layer) once per committed layer for every
    path, so a rollback of 10,000 paths over 10,000 layers took ~110 s."""
    q = select(E).join(L, L.c.number == E.c.layer).where(where, L.c.state == "committed")
    if order_by_path:
        q = q.order_by(E.c.path, E.c.layer)
    return conn.execute(q).all()


def _under(path: bytes):
    """SQL condition: entry paths strictly below directory ``path``
    (``b"."`` is the workspace root: every path)."""
    if path == b".":
        return E.c.path.is_not(None)
    prefix = path + b"/"
    return (E.c.path >= prefix) & (E.c.path < path + b"0")  # '0' follows '/' in byte order


def _path_condition(paths: list[bytes] | None):
    """SQL condition on entry paths: each of ``paths`` and everything below
    it (``None`` or ``b"."`` among them: every path)."""
    if not paths or b"." in paths:
        return E.c.path.is_not(None)
    return or_(*[(E.c.path == p) | _under(p) for p in paths])


def path_rows(conn: Connection, path: bytes) -> list:
    """The committed rows of ``path``, oldest layer first."""
    return _committed_rows(conn, E.c.path == path)


def rows_under(conn: Connection, path: bytes) -> list:
    """The committed rows of every path strictly below directory ``path``
    (``b"."``: every path), by path then layer."""
    return _committed_rows(conn, _under(path))


def all_rows(conn: Connection) -> list:
    """Every committed row, by path then layer."""
    return _committed_rows(conn, E.c.path.is_not(None))


def rows_touched(conn: Connection, after: int, through: int | None = None,
                 paths: list[bytes] | None = None) -> list:
    """Every committed row (of any layer) of each path that a committed
    layer in ``after < layer <= through`` (no upper bound for None) touched,
    restricted to ``paths`` and below them (None: every path); by path
    then layer."""
    where = [E.c.layer > after, E.c.layer.in_(_COMMITTED), _path_condition(paths)]
    if through is not None:
        where.insert(1, E.c.layer <= through)
    touched = select(E.c.path).where(*where)
    return _committed_rows(conn, E.c.path.in_(touched))


def newest_at_or_before(conn: Connection, path: bytes, number: int):
    """The newest committed row of ``path`` in a layer <= ``number``, or None."""
    return conn.execute(
        select(E).where(E.c.path == path, E.c.layer <= number, E.c.layer.in_(_COMMITTED))
        .order_by(E.c.layer.desc()).limit(1)
    ).first()


def oldest_after(conn: Connection, path: bytes, number: int):
    """The oldest committed row of ``path`` in a layer > ``number``, or None."""
    return conn.execute(
        select(E).where(E.c.path == path, E.c.layer > number, E.c.layer.in_(_COMMITTED))
        .order_by(E.c.layer).limit(1)
    ).first()


def layers_touching(path: bytes):
    """A subquery: the numbers of the layers with an entry at ``path`` or
    below it (any state; the caller filters)."""
    return select(E.c.layer).where(_path_condition([path]))


def every_path(conn: Connection) -> set[bytes]:
    """Every path any layer's entries name (all states, pruned folds included)."""
    return {bytes(p) for p in conn.execute(select(E.c.path).distinct()).scalars()}


def path_history(conn: Connection, path: bytes, limit: int) -> list:
    """The newest ``limit`` committed rows of ``path`` itself, newest first,
    each with its layer's ``message``, ``created_ns`` and ``kind``."""
    return conn.execute(
        select(E, L.c.message, L.c.created_ns, L.c.kind).join(L, L.c.number == E.c.layer)
        .where(E.c.path == path, E.c.layer.in_(_COMMITTED)).order_by(E.c.layer.desc()).limit(limit)
    ).all()


def ever_linked(conn: Connection, path: bytes) -> bool:
    """Whether a layer published ``path`` as a hard link, or another name
    as a hard link of it."""
    q = select(E.c.layer).where(((E.c.path == path) & E.c.after_link.is_not(None)) | (E.c.after_link == path)).limit(1)
    return conn.execute(q).first() is not None


# -- prune ---------------------------------------------------------------------------


def fold_rows(conn: Connection, keep_from: int) -> list:
    """The rows of every committed layer up to ``keep_from``, by path then
    layer (prune folds them into one layer)."""
    committed = select(L.c.number).where(L.c.state == "committed", L.c.number <= keep_from)
    return conn.execute(select(E).where(E.c.layer.in_(committed)).order_by(E.c.path, E.c.layer)).all()


# -- the objects entries reference ---------------------------------------------------


def unreferenced_sql(column: str) -> str:
    """A plain-SQL condition for gc's sweep: no entry (of any layer) names
    the stored key in ``column`` (one ``NOT IN`` per oid column)."""
    return (f"{column} NOT IN (SELECT before_oid FROM entries WHERE before_oid IS NOT NULL)\n"
            f"      AND {column} NOT IN (SELECT after_oid FROM entries WHERE after_oid IS NOT NULL)")


def referenced_oids(conn: Connection, after: int | None = None) -> set[str]:
    """The objects the entries of every layer (any state) name, or only of
    the layers numbered above ``after``."""
    q = select(E.c.before_oid, E.c.after_oid)
    if after is not None:
        q = q.where(E.c.layer > after)
    out: set[str] = set()
    for b, a in conn.execute(q):
        out.update(x for x in (b, a) if x)
    return out


def object_refs(conn: Connection) -> list[tuple]:
    """``(layer, path, before_oid, after_oid)`` of every row, any state
    (``verify``)."""
    return conn.execute(select(E.c.layer, E.c.path, E.c.before_oid, E.c.after_oid)).all()


def committed_object_refs(conn: Connection) -> list:
    """``(layer, path, before_oid, after_oid)`` of every committed row, by
    layer then path (``du``)."""
    return conn.execute(select(E.c.layer, E.c.path, E.c.before_oid, E.c.after_oid)
                        .where(E.c.layer.in_(_COMMITTED))
                        .order_by(E.c.layer, E.c.path)).all()


def first_referencing(conn: Connection, numbers: list[int]) -> dict[int, int]:
    """``{layer: bytes}``: the size of the content objects each of the
    layers ``numbers`` references that no earlier committed layer does."""
    mine = union_all(
        select(E.c.after_oid.label("oid")).where(E.c.layer.in_(numbers), E.c.after_oid.is_not(None)),
        select(E.c.before_oid.label("oid")).where(E.c.layer.in_(numbers), E.c.before_oid.is_not(None)),
    ).subquery()
    oids = select(mine.c.oid).distinct()
    refs = union_all(
        select(E.c.after_oid.label("oid"), E.c.layer).where(E.c.after_oid.in_(oids), E.c.layer.in_(_COMMITTED)),
        select(E.c.before_oid.label("oid"), E.c.layer).where(E.c.before_oid.in_(oids), E.c.layer.in_(_COMMITTED)),
    ).subquery()
    first = select(refs.c.oid, func.min(refs.c.layer).label("first")).group_by(refs.c.oid).subquery()
    q = select(first.c.first, func.sum(O.c.size)).join(O, O.c.oid == first.c.oid).group_by(first.c.first)
    wanted = set(numbers)
    return {int(n): int(size or 0) for n, size in conn.execute(q) if n in wanted}
