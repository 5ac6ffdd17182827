"""``stepfs gc-history``: delete the objects and chunks of a shared
history's database that no layer names (PostgreSQL).

Objects are uploaded before the layer that names them (FORMAT.md, "Shared
history"), so a step killed or cut off between the two leaves objects no
entry names; they are garbage once no step is between the two.  Every
step and sync holds the objects' advisory lock shared, with the history's
lock (``Remote.lock``); gc takes it exclusively, so it waits for the steps
in progress and the next ones wait for it.  Objects are shared by every
history of the database, so an object is kept while any entry of any
history names it.  An SQLite history has no such lock: gc refuses it.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import func, select, union

from stepfs.store.errors import HistoryError
from stepfs.store.shared import tables as T
from stepfs.store.shared.remote import Remote

#: Keys per DELETE statement.
BATCH = 1000


@dataclass
class Collected:
    objects: int
    chunks: int
    bytes: int

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def ensure_indexes(remote: Remote) -> None:
    """Make ``tables.GC_INDEXES`` on a database made before them."""
    with remote.tx() as conn:
        for index in T.GC_INDEXES:
            index.create(conn, checkfirst=True)


def collect(remote: Remote) -> Collected:
    if remote.url.dialect != "postgresql":
        raise HistoryError(f"gc-history runs on a PostgreSQL history; the SQLite history {remote.url.display} has "
                           f"no lock that keeps gc from a step between its upload and its layer.")
    with remote.objects_held(alone=True):
        ensure_indexes(remote)  # no step is between an upload and its layer: the tables' locks are short
        with remote.tx() as conn:
            named = union(select(T.entries.c.before_object).where(T.entries.c.before_object.is_not(None)),
                          select(T.entries.c.after_object).where(T.entries.c.after_object.is_not(None)))
            dead = conn.execute(select(T.objects.c.hash).where(T.objects.c.hash.not_in(named))).scalars().all()
            for i in range(0, len(dead), BATCH):
                part = dead[i:i + BATCH]
                conn.execute(T.object_chunks.delete().where(T.object_chunks.c.object.in_(part)))
                conn.execute(T.objects.delete().where(T.objects.c.hash.in_(part)))
            loose = select(T.object_chunks.c.chunk)
            size = conn.execute(select(func.coalesce(func.sum(T.chunks.c.size), 0))
                                .where(T.chunks.c.hash.not_in(loose))).scalar()
            chunks = conn.execute(T.chunks.delete().where(T.chunks.c.hash.not_in(loose))).rowcount
        return Collected(len(dead), int(chunks), int(size))
