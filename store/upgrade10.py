"""The upgrade of a version-9 store to format 10 (a delta names its base by
a key prefix, ``store/baseref.py``; docs/format10.md), run by
``db.Database._upgrade`` inside its one durable transaction, with
SQLite's foreign-key checks off (a table rebuild).

``objects`` loses the foreign key of its ``base`` column (a prefix is no
key), which SQLite can only drop by making the table again: the new table
is made beside it, filled with every row (``base`` cut to its prefix), the
old one dropped and the new one renamed.  The old pages become free pages,
given back by the next ``stepfs gc``.  A crash before the COMMIT leaves
the version-9 store.
"""

from __future__ import annotations

from sqlalchemy import MetaData

from stepfs.store import baseref, schema

_NEW = "objects_v10"


def upgrade(conn) -> None:
    new = schema.objects.to_metadata(MetaData(), name=_NEW)
    new.create(conn)
    conn.exec_driver_sql(
        f"INSERT INTO {_NEW} (oid, size, gen, data, codec, base, is_base) "
        f"SELECT oid, size, gen, data, codec, substr(base, 1, {baseref.BASE_BYTES}), is_base FROM objects")
    conn.exec_driver_sql("DROP TABLE objects")
    conn.exec_driver_sql(f"ALTER TABLE {_NEW} RENAME TO objects")
