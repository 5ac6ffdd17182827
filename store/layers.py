"""Layers and their entries: reading history (store side, no FUSE).

A layer is immutable once ``state == 'committed'``.  Entries record, for each
path a layer touched, the state before and the state after (``kind`` NULL
means absent).  Nothing here writes; writing a layer is ``publish.py``'s job.
"""

from __future__ import annotations

import json

from sqlalchemy import case, func, literal_column, select
from sqlalchemy.engine import Connection

from stepfs.store import schema
from stepfs.store.db import Prepared
from stepfs.store.errors import LayerPruned, NoSuchLayer
from stepfs.store.records import Entry, Layer, State  # noqa: F401  (their home before records.py)

L, E = schema.layers, schema.entries


def head(conn: Connection) -> int:
    """The number of the newest committed layer (0 for a new store)."""
    n = conn.execute(select(func.max(L.c.number)).where(L.c.state == "committed")).scalar()
    return int(n or 0)


# Every commit asks for it: compiled once, run on the DBAPI cursor (db.Prepared).
_NEXT_NUMBER = Prepared(select(func.coalesce(func.max(L.c.number) + literal_column("1"), literal_column("0"))))


def next_number(conn: Connection) -> int:
    """1 + the largest layer number, whatever its state (0 for an empty
    store); allocate only under the commit lock."""
    return int(_NEXT_NUMBER.execute(conn)[0][0])


def _counts():
    added = func.sum(case((E.c.before_kind.is_(None), 1), else_=0))
    deleted = func.sum(case((E.c.after_kind.is_(None), 1), else_=0))
    total = func.count(E.c.path)
    return added, deleted, total


def committed_numbers(conn: Connection) -> list[int]:
    """The numbers of the committed layers, oldest first."""
    return conn.execute(
        select(schema.layers.c.number).where(schema.layers.c.state == "committed").order_by(schema.layers.c.number)
    ).scalars().all()


def list_layers(conn: Connection, limit: int | None = None, number: int | None = None) -> list[Layer]:
    """Committed layers (or just ``number``), newest first, with counts of
    added / modified / deleted paths.  The layers are chosen first and only
    their entries are counted (through the entries' primary key): listing
    a few layers, or one, costs what those layers hold, not what the whole
    history holds."""
    q = select(L).where(L.c.state == "committed").order_by(L.c.number.desc())
    if number is not None:
        q = q.where(L.c.number == number)
    if limit is not None:
        q = q.limit(limit)
    rows = conn.execute(q).all()
    added, deleted, total = _counts()
    counts = select(E.c.layer, added, deleted, total).group_by(E.c.layer)
    if limit is not None or number is not None:
        counts = counts.where(E.c.layer.in_([r.number for r in rows]))
    by_layer = {layer: (int(a or 0), int(d or 0), int(t or 0)) for layer, a, d, t in conn.execute(counts)}
    out = []
    for r in rows:
        a, d, t = by_layer.get(r.number, (0, 0, 0))
        out.append(
            Layer(
                number=r.number, state=r.state, kind=r.kind, created_ns=r.created_ns,
                message=r.message, agent=r.agent, mount=r.mount, meta=json.loads(r.meta or "{}"),
                added=a, deleted=d, modified=t - a - d,
            )
        )
    return out


def get(conn: Connection, number: int) -> Layer:
    for layer in list_layers(conn, number=number):
        return layer
    raise missing(conn, number)


def missing(conn: Connection, number: int) -> NoSuchLayer:
    """The error for a layer number that is not a committed layer: pruned
    ones say so (and which layer is the oldest kept)."""
    state = conn.execute(select(L.c.state).where(L.c.number == number)).scalar()
    if state == "pruned":
        oldest = conn.execute(select(func.min(L.c.number)).where(L.c.state == "committed")).scalar()
        return LayerPruned(f"layer {number} was pruned; the oldest layer kept is {oldest} "
                           f"('stepfs log' lists the layers kept).")
    return NoSuchLayer(f"layer {number} does not exist; 'stepfs log' lists the layers.")


def entries(conn: Connection, number: int) -> list[Entry]:
    rows = conn.execute(select(E).where(E.c.layer == number).order_by(E.c.path))
    return [entry_from_row(r) for r in rows]


def entry_from_row(r) -> Entry:
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
