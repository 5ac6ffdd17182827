"""The upgrade of a version-6 store to format 7 (binary keys, inline
objects, tables without rowid), run by ``db.Database._upgrade`` inside its
one durable transaction, with SQLite's foreign-key checks off for it.

SQLite cannot change a column's type in place, so every table that holds a
key is rebuilt: the old one is renamed ``v6_<name>``, the format-7 table
created from ``store/schema.py``, the rows copied with each key converted
by the same function the code uses (``keys.to_db``, registered as the SQL
function ``stepfs_key``), and the old table dropped.  Objects keep their
chunks (only objects put from now on are stored inline).  The pages the
old tables took become free pages, given back by the next ``stepfs gc``.
"""

from __future__ import annotations

from sqlalchemy import BigInteger, Column, Index, Integer, LargeBinary, MetaData, PrimaryKeyConstraint, String, Table

from stepfs.store import keys, schema
from stepfs.store.keys import HexKey

#: Format 7's ``entries`` table, as it was (format 8 replaced it with entry
#: lists, ``store/upgrade8.py``): a version-6 store is upgraded through it.
_v7 = MetaData()
ENTRIES = Table(
    "entries", _v7,
    Column("layer", Integer, nullable=False), Column("path", LargeBinary, nullable=False),
    Column("before_kind", String(8)), Column("before_mode", Integer), Column("before_oid", HexKey),
    Column("before_target", LargeBinary), Column("after_kind", String(8)), Column("after_mode", Integer),
    Column("after_oid", HexKey), Column("after_target", LargeBinary), Column("after_mtime_ns", BigInteger),
    Column("before_uid", Integer), Column("before_gid", Integer), Column("before_xattrs", LargeBinary),
    Column("after_uid", Integer), Column("after_gid", Integer), Column("after_xattrs", LargeBinary),
    Column("after_link", LargeBinary),
    PrimaryKeyConstraint("layer", "path"), sqlite_with_rowid=False,
)
Index("entries_path_layer", ENTRIES.c.path, ENTRIES.c.layer)

#: Tables with a key column, in the order their rows are copied (a table
#: before the ones that refer to it).
TABLES = ("chunks", "objects", "object_chunks", "entries", "staged", "conflicts")
#: Indexes of those tables in version 6 (their names are taken again).
OLD_INDEXES = ("chunks_base", "object_chunks_cid", "entries_path_layer")


def upgrade(conn) -> None:
    raw = conn.connection.dbapi_connection
    raw.create_function("stepfs_key", 1, keys.to_db, deterministic=True)
    for index in OLD_INDEXES:
        conn.exec_driver_sql(f'DROP INDEX IF EXISTS "{index}"')
    for name in TABLES:
        conn.exec_driver_sql(f'ALTER TABLE "{name}" RENAME TO "v6_{name}"')
    tables = [ENTRIES if name == "entries" else schema.metadata.tables[name] for name in TABLES]
    schema.metadata.create_all(conn, tables=[t for t in tables if t is not ENTRIES])
    ENTRIES.create(conn)
    for table in tables:
        old = {row[1] for row in conn.exec_driver_sql(f'PRAGMA table_info("v6_{table.name}")')}
        cols = [c for c in table.c if c.name in old]
        names = ", ".join(f'"{c.name}"' for c in cols)
        values = ", ".join(f'stepfs_key("{c.name}")' if keys.is_key(c.type) else f'"{c.name}"' for c in cols)
        conn.exec_driver_sql(f'INSERT INTO "{table.name}" ({names}) SELECT {values} FROM "v6_{table.name}"')
    for name in reversed(TABLES):
        conn.exec_driver_sql(f'DROP TABLE "v6_{name}"')
