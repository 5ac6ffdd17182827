"""Layers and their entries: reading history (store side, no FUSE).

A layer is immutable once ``state == 'committed'``.  Entries record, for each
path a layer touched, the state before and the state after (``kind`` NULL
means absent).  Nothing here writes; writing a layer is ``publish.py``'s job.
"""

from __future__ import annotations


from sqlalchemy import func, literal_column, select
from sqlalchemy.engine import Connection

from stepfs.store import entrytable, schema
from stepfs.store.db import Prepared
from stepfs.store.cardrows import Rows
from stepfs.store.errors import NoSuchLayer
from stepfs.store.records import Entry, Layer, State  # noqa: F401  (their home before records.py)

L = schema.layers


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


def committed_numbers(conn: Connection) -> list[int]:
    """The numbers of the committed layers, oldest first."""
    return conn.execute(
        select(schema.layers.c.number).where(schema.layers.c.state == "committed").order_by(schema.layers.c.number)
    ).scalars().all()


def list_layers(conn: Connection, limit: int | None = None, number: int | None = None) -> list[Layer]:
    """Committed layers (or just ``number``), newest first, with counts of
    added / modified / deleted paths (``cardrows.Rows.layers``)."""
    return Rows.over(conn).layers(limit=limit, number=number)


def get(conn: Connection, number: int) -> Layer:
    return Rows.over(conn).layer(number)


def missing(conn: Connection, number: int) -> NoSuchLayer:
    """The error for a layer number that is not a committed layer: pruned
    ones say so (and which layer is the oldest kept)."""
    return Rows.over(conn).missing(number)


def entries(conn: Connection, number: int) -> list[Entry]:
    """Layer ``number``'s entries in path order (``entrytable.layer_entries``)."""
    return entrytable.layer_entries(conn, number)
