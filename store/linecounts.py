"""Remembered line counts of file changes: what a change card needs of a
changed file (lines added and removed, or the byte sizes of binary
content), kept in ``line_counts`` once so that ``log``, ``show`` and the
web pages read one row instead of reading, decoding and diffing both
versions every time.

A row is keyed by the pair of objects (``''`` for "no file"), so it is
true for every layer that names the pair, before and after prune's folding,
and never goes stale; gc deletes the rows of the objects it collects
(``store/gc.py``).  Rows are written after a commit by the mount daemon's
background pass (:func:`fill_layer`, from ``store/deltawork.py``, after the
commit lock is released), and by a reader with a workspace open that
computed some that were missing (:func:`remember`).  The CLI's read-only
path (``cardrows.open_readonly``) computes what is missing and writes
nothing.  The plain-SQL half (:func:`pair_of`, :func:`lookup`,
:func:`compute`) imports no SQLAlchemy.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from stepfs.store import records
from stepfs.store.records import Change, State

if TYPE_CHECKING:
    from stepfs.store.cardrows import Rows

log = logging.getLogger("stepfs.store")

#: ``(lines_added, lines_removed, bytes_before, bytes_after)``; the line
#: counts are None for binary content or content too large to count.
Counts = tuple
#: Pairs per lookup statement (two variables each; SQLite bounds them).
BATCH = 2000
TABLE = "line_counts"


def pair_of(c: Change) -> tuple[str, str] | None:
    """The ``(before, after)`` object pair whose counts the card entry of
    ``c`` needs, or None when it needs none (no file on either side, or the
    same content on both)."""
    if "file" not in (c.before.kind, c.after.kind):
        return None
    if c.before.kind == c.after.kind and c.before.oid == c.after.oid:
        return None
    before = c.before.oid if c.before.kind == "file" else None
    after = c.after.oid if c.after.kind == "file" else None
    return before or "", after or ""


def compute(rows: Rows, pair: tuple[str, str]) -> Counts:
    """The counts of ``pair`` from the objects' bytes (the rules of
    ``records.lines_of``); raises ``CorruptObject``."""
    before, after = pair
    change = Change(b"", State("file", oid=before) if before else State(None),
                    State("file", oid=after) if after else State(None))
    a, b, n_old, n_new = records.lines_of(change, rows.size, rows.read_all)
    if a is None or b is None:
        return None, None, n_old, n_new
    added, removed = records.count_lines(a, b)
    return added, removed, n_old, n_new


def lookup(rows: Rows, pairs) -> dict[tuple[str, str], Counts]:
    """The remembered counts of those of ``pairs`` that have a row (none if
    the store has no ``line_counts`` table).  One statement per
    :data:`BATCH` pairs, each pair one primary-key probe (``CROSS JOIN``
    keeps SQLite from scanning the table instead)."""
    from stepfs.store.keytext import to_db  # noqa: PLC0415

    wanted = sorted(set(pairs))
    out: dict[tuple[str, str], Counts] = {}
    if not wanted or not rows.has_table(TABLE):
        return out
    for i in range(0, len(wanted), BATCH):
        part = wanted[i:i + BATCH]
        by_key = {(to_db(b), to_db(a)): (b, a) for b, a in part}
        params = tuple(k for key in by_key for k in key)
        for b, a, added, removed, n_old, n_new in rows.fetch(
                f"WITH v(b, a) AS (VALUES {', '.join(['(?, ?)'] * len(by_key))}) "
                "SELECT lc.before_oid, lc.after_oid, lc.lines_added, lc.lines_removed, lc.bytes_before, "
                f"lc.bytes_after FROM v CROSS JOIN {TABLE} lc WHERE lc.before_oid = v.b AND lc.after_oid = v.a",
                params):
            out[by_key[(bytes(b), bytes(a))]] = (added, removed, n_old, n_new)
    return out


# -- writing (SQLAlchemy; never on the CLI's read-only path) ----------------------


def remember(ws, counts: dict[tuple[str, str], Counts]) -> int:
    """Write ``counts`` in one short write transaction of ``ws`` (rows
    already there are kept; a pair naming an object that is gone, collected
    since it was read, is skipped).  Returns the rows written.  Failing to
    write (a full or busy store) only logs: the counts are computed again."""
    if not counts:
        return 0
    from stepfs.store.errors import StepfsError  # noqa: PLC0415

    try:
        with ws.db.write() as conn:
            return write_rows(conn, counts)
    except StepfsError as exc:
        log.info("line counts not remembered now: %s", exc)
        return 0


def write_rows(conn, counts: dict[tuple[str, str], Counts]) -> int:
    """:func:`remember` inside the caller's write transaction ``conn``."""
    from sqlalchemy import select  # noqa: PLC0415

    from stepfs.store import schema  # noqa: PLC0415

    if not conn.dialect.has_table(conn, TABLE):
        return 0
    O, T = schema.objects, schema.line_counts
    oids = sorted({o for pair in counts for o in pair if o})
    present: set[str] = set()
    for i in range(0, len(oids), BATCH):
        present.update(conn.execute(select(O.c.oid).where(O.c.oid.in_(oids[i:i + BATCH]))).scalars())
    rows = [{"before_oid": b, "after_oid": a, "lines_added": c[0], "lines_removed": c[1],
             "bytes_before": c[2], "bytes_after": c[3]}
            for (b, a), c in sorted(counts.items()) if (not b or b in present) and (not a or a in present)]
    if not rows:
        return 0
    if conn.dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert  # noqa: PLC0415
    else:
        from sqlalchemy.dialects.sqlite import insert  # noqa: PLC0415
    conn.execute(insert(T).on_conflict_do_nothing(), rows)
    return len(rows)


def fill_layer(ws, number: int, go=None, writing=None) -> int:
    """Remember the counts of every file change of layer ``number`` that has
    none yet: read in one read transaction, written in one write
    transaction (held inside ``writing``, as the delta pass's are).  ``go``:
    asked before each file; False stops (what was counted is written).
    Returns the rows written; an unreadable object is left to the readers
    (``stepfs verify`` names it)."""
    from contextlib import nullcontext  # noqa: PLC0415

    from stepfs.store.cardrows import Rows  # noqa: PLC0415
    from stepfs.store.errors import CorruptObject, StepfsError  # noqa: PLC0415

    counts: dict[tuple[str, str], Counts] = {}
    try:
        with ws.db.read() as conn:
            rows = Rows.over(conn, ws.objects.hasher)
            changes = records.pair_renames([Change(e.path, e.before, e.after) for e in rows.entries(number)],
                                           rows.size)
            pairs = {p for c in changes if (p := pair_of(c)) is not None}
            for pair in sorted(pairs - set(lookup(rows, pairs))):
                if go is not None and not go():
                    break
                try:
                    counts[pair] = compute(rows, pair)
                except CorruptObject:
                    continue
        if not counts:
            return 0
        with writing or nullcontext(), ws.db.write() as conn:
            return write_rows(conn, counts)
    except StepfsError as exc:
        log.warning("line counts of layer %d not remembered now: %s", number, exc)
        return 0
