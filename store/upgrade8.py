"""The upgrade of a version-7 store to format 8 (entry lists, a tree of
paths, ``path_layers``; docs/format8.md), run by ``db.Database._upgrade``
inside its one durable transaction.

Each layer's rows of the old ``entries`` table are read in path order and
written again through the seam that writes a commit's entries
(``entrytable.insert``: the nodes of their paths, the layer's lists and its
``path_layers`` rows), so an upgraded layer is stored exactly as a new one
would be.  The paths are numbered in byte order first, so that a
directory's files have neighbouring ids.  Then ``entries`` and its index
are dropped; their pages become free pages, given back by the next
``stepfs gc``.  A crash before the COMMIT leaves the version-7 store.
"""

from __future__ import annotations

from stepfs.store import entrytable, schema
from stepfs.store.keytext import from_db
from stepfs.store.records import Entry, State

_COLUMNS = ("layer, path, before_kind, before_mode, before_oid, before_target, before_uid, before_gid, "
            "before_xattrs, after_kind, after_mode, after_oid, after_target, after_uid, after_gid, after_xattrs, "
            "after_mtime_ns, after_link")


def _b(v) -> bytes | None:
    return bytes(v) if v is not None else None


def upgrade(conn) -> None:
    schema.metadata.create_all(conn, tables=[schema.paths, schema.layer_entries, schema.path_layers])
    paths = [bytes(r[0]) for r in conn.exec_driver_sql("SELECT DISTINCT path FROM entries ORDER BY path")]
    entrytable.path_ids(conn, paths)
    numbers = [r[0] for r in conn.exec_driver_sql("SELECT DISTINCT layer FROM entries ORDER BY layer")]
    for number in numbers:
        rows = conn.exec_driver_sql(f"SELECT {_COLUMNS} FROM entries WHERE layer = ? ORDER BY path", (number,)).all()
        entrytable.insert(conn, number, [Entry(
            path=bytes(r[1]),
            before=State(r[2], r[3], from_db(r[4]), _b(r[5]), r[6], r[7], _b(r[8])),
            after=State(r[9], r[10], from_db(r[11]), _b(r[12]), r[13], r[14], _b(r[15])),
            after_mtime_ns=r[16], after_link=_b(r[17])) for r in rows])
    conn.exec_driver_sql("DROP INDEX IF EXISTS entries_path_layer")
    conn.exec_driver_sql("DROP TABLE entries")
