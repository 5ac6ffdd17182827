"""The upgrade of a version-8 store to format 9 (line counts per layer,
``layer_counts``; docs/format9.md), run by ``db.Database._upgrade`` inside
its one durable transaction.

Each committed layer's changes are paired as a card pairs them, the counts
format 8's ``line_counts`` holds for those pairs are written as the
layer's one ``layer_counts`` row (``linecounts.write_layer``), then
``line_counts`` is dropped; its pages become free pages, given back by the
next ``stepfs gc``.  A store without ``line_counts`` (it is optional) just
gets the new table.  A crash before the COMMIT leaves the version-8 store.
"""

from __future__ import annotations

from sqlalchemy import BigInteger, Column, Integer, MetaData, PrimaryKeyConstraint, Table

from stepfs.store import codec, linecounts, records, schema
from stepfs.store.keys import HexKey
from stepfs.store.keytext import to_db
from stepfs.store.records import Change

_v8 = MetaData()
#: Format 8's table, as a version-8 stepfs made it (for tests that make one).
LINE_COUNTS = Table(
    "line_counts",
    _v8,
    Column("before_oid", HexKey, nullable=False),
    Column("after_oid", HexKey, nullable=False),
    Column("lines_added", Integer),
    Column("lines_removed", Integer),
    Column("bytes_before", BigInteger, nullable=False),
    Column("bytes_after", BigInteger, nullable=False),
    PrimaryKeyConstraint("before_oid", "after_oid"),
    sqlite_with_rowid=False,
)


def upgrade(conn) -> None:
    _short_deltas(conn)
    _layer_counts(conn)


def _short_deltas(conn) -> None:
    """Every delta stored without the frame head its size implies
    (``codec.delta``): inline objects' and chunks'."""
    for table, key in (("objects", "oid"), ("chunks", "cid")):
        short = []
        for k, size, data in conn.exec_driver_sql(
                f"SELECT {key}, size, data FROM {table} WHERE codec = ? AND data IS NOT NULL", (codec.DELTA,)):
            head = codec.frame_head(size)
            if head is not None and bytes(data).startswith(head):
                short.append((bytes(data)[len(head):], k))
        if short:
            conn.exec_driver_sql(f"UPDATE {table} SET data = ? WHERE {key} = ?", short)


def _layer_counts(conn) -> None:
    from stepfs.store.cardrows import Rows  # noqa: PLC0415

    schema.metadata.create_all(conn, tables=[schema.layer_counts])
    if not conn.dialect.has_table(conn, linecounts.OLD_TABLE):
        return
    rows = Rows.over(conn)
    numbers = [n for (n,) in rows.fetch("SELECT number FROM layers WHERE state = 'committed' ORDER BY number", ())]
    for number in numbers:
        changes = records.pair_renames([Change(e.path, e.before, e.after) for e in rows.entries(number)], rows.size)
        pairs = sorted({p for c in changes if (p := linecounts.pair_of(c)) is not None})
        counts = {}
        for i in range(0, len(pairs), 400):
            part = pairs[i:i + 400]
            by_key = {(to_db(b), to_db(a)): (b, a) for b, a in part}
            params = tuple(k for key in by_key for k in key)
            for b, a, added, removed, n_old, n_new in rows.fetch(
                    f"WITH v(b, a) AS (VALUES {', '.join(['(?, ?)'] * len(by_key))}) "
                    "SELECT lc.before_oid, lc.after_oid, lc.lines_added, lc.lines_removed, lc.bytes_before, "
                    "lc.bytes_after FROM v CROSS JOIN line_counts lc WHERE lc.before_oid = v.b AND lc.after_oid = v.a",
                    params):
                counts[by_key[(bytes(b), bytes(a))]] = (added, removed, n_old, n_new)
        if counts:
            linecounts.write_layer(conn, number, counts)
    conn.exec_driver_sql("DROP TABLE line_counts")
