"""Garbage collection of a store (``stepfs gc``), store side, no FUSE.

Mark and sweep with a generation number, so that it runs while mounts
stage files, commits commit and rollbacks roll back (FORMAT.md, "Garbage
collection", gives the rule every writer keeps):

1. **New generation.**  One durable transaction raises
   ``meta.gc_generation`` to G.  From then on every put, of a new object or
   of one already stored (``ObjectStore._touch``), marks the object with G,
   and an object of generation G is never collected by this run: a writer
   that just put bytes and holds only their id is safe.
2. **Quiesce.**  ``quiesce()`` (the caller's; the CLI asks every live
   mount daemon to write the staged rows it holds in memory) makes every
   object a daemon put before step 1 and still uses named by a row.
3. **Sweep.**  Under the commit lock (no commit, rollback, recovery or
   prune runs meanwhile), one durable ``BEGIN IMMEDIATE`` transaction finds
   the objects of a generation below G that no entry (before or after, of
   any layer not pruned), staged row or conflict names, deletes them and
   their chunk lists, then the chunks no object lists and no kept delta
   has as its base.  Marking and deleting happen in that one transaction,
   so no put or row can fall between them.
4. **Deltas** (``store.delta``): chunks of files a layer modified are
   re-encoded as deltas against the version before, in small transactions.
5. **Space.**  SQLite's free pages are given back with
   ``incremental_vacuum`` (stores made by format 6; an older store needs
   one ``full_vacuum``), then the WAL is checkpointed and truncated.

A crash at any point loses nothing referenced: step 1 only raises a
number, step 3 commits whole or not at all, step 4 rewrites encodings, not
bytes, and running gc again repeats whatever did not finish.
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass, field
from typing import Callable

from sqlalchemy import select, text

from stepfs.store import durable as durable_calls
from stepfs.store import baseref, entrytable, schema
from stepfs.store.objects import generation
from stepfs.store.workspace import Workspace

log = logging.getLogger("stepfs.store")

#: Objects no row names: every object of a generation below :gen that no
#: entry, staged row or conflict references.
_UNREFERENCED = f"""
    SELECT o.oid FROM objects o WHERE o.gen < :gen
      AND {entrytable.unreferenced_sql("o.oid")}
      AND o.oid NOT IN (SELECT oid FROM staged WHERE oid IS NOT NULL)
      AND o.oid NOT IN (SELECT oid FROM conflicts WHERE oid IS NOT NULL)
"""
#: Objects only conflicts keep (counted apart: the user drops them).
_CONFLICT_ONLY = f"""
    SELECT count(*), coalesce(sum(o.size), 0) FROM objects o
     WHERE o.oid IN (SELECT oid FROM conflicts WHERE oid IS NOT NULL)
       AND {entrytable.unreferenced_sql("o.oid")}
       AND o.oid NOT IN (SELECT oid FROM staged WHERE oid IS NOT NULL)
"""


@dataclass
class Report:
    dry_run: bool
    generation: int = 0
    objects: int = 0  # objects collected (or collectable, dry run)
    object_bytes: int = 0  # their content's length
    chunks: int = 0  # chunks collected
    chunk_bytes: int = 0  # stored bytes of those chunks
    conflict_objects: int = 0  # objects only conflicts keep (kept)
    conflict_bytes: int = 0
    deltas: int = 0  # chunks re-encoded as deltas
    delta_saved: int = 0  # stored bytes that saved
    vacuum: str = "none"  # incremental | full | none (pages kept for reuse)
    file_before: int = 0  # bytes of store.db and its WAL before
    file_after: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def freed(self) -> int:
        return max(self.file_before - self.file_after, 0)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["freed"] = self.freed
        return d


def store_bytes(ws: Workspace) -> int:
    """Bytes of ``store.db`` with its WAL (what the store takes on disk)."""
    total = 0
    for suffix in ("", "-wal"):
        try:
            total += os.stat(ws.db.label + suffix).st_size
        except OSError:
            pass
    return total


def _garbage(conn, gen: int) -> None:
    """Fill temp tables ``gc_objects`` and ``gc_chunks`` with what a sweep
    of generation ``gen`` deletes, inside the caller's transaction."""
    entrytable.prepare_sweep(conn)
    conn.exec_driver_sql("DROP TABLE IF EXISTS temp.gc_objects")
    conn.exec_driver_sql("DROP TABLE IF EXISTS temp.gc_chunks")
    conn.execute(text(f"CREATE TEMP TABLE gc_objects AS {_UNREFERENCED}"), {"gen": gen})
    conn.exec_driver_sql("CREATE INDEX temp.gc_objects_oid ON gc_objects (oid)")
    # An object that is the base of a delta object that stays, stays too (a
    # base is never a delta: one pass is enough; format 7).  Format 10: a
    # delta names its base by a key prefix, so every object under a prefix
    # a staying delta names stays (store/baseref.py).
    conn.exec_driver_sql(f"""
        DELETE FROM gc_objects WHERE substr(oid, 1, {baseref.BASE_BYTES}) IN (
            SELECT base FROM objects WHERE base IS NOT NULL AND oid NOT IN (SELECT oid FROM gc_objects))""")
    # Chunks that only collected objects list (or none at all) ...
    conn.exec_driver_sql("""
        CREATE TEMP TABLE gc_chunks AS SELECT c.cid AS cid, length(c.data) AS stored FROM chunks c
         WHERE c.cid NOT IN (SELECT oc.cid FROM object_chunks oc
                              WHERE oc.oid NOT IN (SELECT oid FROM gc_objects))""")
    conn.exec_driver_sql("CREATE INDEX temp.gc_chunks_cid ON gc_chunks (cid)")
    # ... except the base of a delta that stays (a base is never a delta,
    # so one pass is enough) ...
    conn.exec_driver_sql("""
        DELETE FROM gc_chunks WHERE cid IN (SELECT base FROM chunks WHERE base IS NOT NULL
                                             AND cid NOT IN (SELECT cid FROM gc_chunks))""")
    # ... and a plain key while a suffixed key of its family stays: the put
    # path takes a free plain key for bytes never seen (objects.py).
    # (Keys are bytes, format 7: a plain key is the 16-byte hash, a family
    # member the same 16 bytes and a suffix; store/keys.py.)
    conn.exec_driver_sql("""
        DELETE FROM gc_chunks WHERE length(cid) = 16 AND EXISTS (
            SELECT 1 FROM chunks c WHERE c.cid > gc_chunks.cid AND substr(c.cid, 1, 16) = gc_chunks.cid
               AND length(c.cid) > 16 AND c.cid NOT IN (SELECT cid FROM gc_chunks))""")


def _count(conn, report: Report) -> None:
    report.objects, report.object_bytes = conn.exec_driver_sql(
        "SELECT count(*), coalesce(sum(o.size), 0) FROM objects o WHERE o.oid IN (SELECT oid FROM gc_objects)"
    ).one()
    report.chunks, report.chunk_bytes = conn.exec_driver_sql(
        "SELECT count(*), coalesce(sum(stored), 0) FROM gc_chunks").one()
    # The bytes of collected objects stored inline (format 7) count as stored bytes freed too.
    report.chunk_bytes += conn.exec_driver_sql(
        "SELECT coalesce(sum(length(data)), 0) FROM objects WHERE oid IN (SELECT oid FROM gc_objects)").scalar()
    report.conflict_objects, report.conflict_bytes = conn.exec_driver_sql(_CONFLICT_ONLY).one()


def collect(ws: Workspace, dry_run: bool = False, quiesce: Callable[[], None] | None = None,
            deltas: bool = True, vacuum: bool = True, full_vacuum: bool = False) -> Report:
    """Run gc on ``ws`` (see the module doc); returns what it freed (with
    ``dry_run``: what it would free, changing nothing)."""
    report = Report(dry_run=dry_run, file_before=store_bytes(ws))
    if dry_run:
        with ws.db.read() as conn:
            report.generation = generation(conn) + 1
            _garbage(conn, report.generation)
            _count(conn, report)
        report.file_after = report.file_before
        return report
    # 1. a new generation (durable: a put after it is marked, whatever crashes).
    # gc's own write locks (this one, the sweep's, the vacuum's) are taken
    # under the commit lock: a commit waits for them there, in a queue, not
    # in SQLite's busy handler, whose polling lost every short gap between
    # back-to-back gc runs for its whole 30 s timeout.
    with ws.commit_lock(), ws.db.write(durable=True) as conn:
        gen = generation(conn) + 1
        conn.execute(schema.meta.delete().where(schema.meta.c.key == "gc_generation"))
        conn.execute(schema.meta.insert().values(key="gc_generation", value=str(gen)))
    report.generation = gen
    # 2. every live writer's ids of older objects into rows
    if quiesce is not None:
        quiesce()
    # 3. mark and sweep in one transaction, no commit running
    with ws.commit_lock():
        with ws.db.write(durable=True, foreign_keys=False) as conn:
            _garbage(conn, gen)
            _count(conn, report)
            conn.exec_driver_sql("DELETE FROM object_chunks WHERE oid IN (SELECT oid FROM gc_objects)")
            conn.exec_driver_sql("DELETE FROM objects WHERE oid IN (SELECT oid FROM gc_objects)")
            if conn.dialect.has_table(conn, "layer_counts"):  # optional (store/linecounts.py)
                # A row names only objects its committed layer's entries name, so
                # it goes with its layer; one of a layer no longer committed is dropped.
                conn.exec_driver_sql(
                    "DELETE FROM layer_counts WHERE layer NOT IN "
                    "(SELECT number FROM layers WHERE state = 'committed')")
            conn.exec_driver_sql("DELETE FROM chunks WHERE cid IN (SELECT cid FROM gc_chunks)")
            conn.exec_driver_sql("DROP TABLE temp.gc_objects")
            conn.exec_driver_sql("DROP TABLE temp.gc_chunks")
    # 4. deltas of what layers modified
    if deltas:
        from stepfs.store import delta

        report.deltas, report.delta_saved = delta.deltify(ws)
    # 5. the free pages back to the file system
    if vacuum or full_vacuum:
        with ws.commit_lock():
            report.vacuum = give_back(ws, full=full_vacuum)
        if report.vacuum == "none":
            report.notes.append("this store was made before format 6: its free pages are reused, not given "
                                "back; run 'stepfs gc --full-vacuum' once (it rewrites the whole file)")
    report.file_after = store_bytes(ws)
    log.info("gc generation %d: %d objects, %d chunks (%d bytes) collected", gen, report.objects,
             report.chunks, report.chunk_bytes)
    return report


#: Free pages given back per transaction of ``incremental_vacuum`` (64 MiB).
VACUUM_BATCH = 16384
#: A store at least half free whose live pages are at most this big is
#: rewritten with VACUUM instead (it holds the write lock while it runs).
VACUUM_LIVE_MAX = 256 << 20


def give_back(ws: Workspace, full: bool = False) -> str:
    """Return SQLite's free pages to the file system: ``incremental`` (a
    format-6 store: pages moved into the holes, the file truncated, in
    transactions of :data:`VACUUM_BATCH` pages), ``full`` (``VACUUM``:
    rewrites the file; asked for, turns an older store's auto_vacuum on;
    chosen when most pages are free and the rest is small), or ``none``.  Then checkpoints and truncates the WAL, if no reader holds
    it."""
    with ws.db.read() as conn:
        mode = conn.exec_driver_sql("PRAGMA auto_vacuum").scalar()
        pages = conn.exec_driver_sql("PRAGMA page_count").scalar()
        free = conn.exec_driver_sql("PRAGMA freelist_count").scalar()
        live = (pages - free) * conn.exec_driver_sql("PRAGMA page_size").scalar()
    # Mostly free and small once rewritten: VACUUM copies only what lives
    # (1.8 s where incremental_vacuum took 19 s for 180 of 200 MiB free),
    # and is short enough for writers waiting on the busy timeout.
    if mode == 2 and free * 2 >= pages and live <= VACUUM_LIVE_MAX:
        full = True
    how = "none"
    if full or mode != 2:
        if full:
            with ws.db.engine.connect() as conn:
                raw = conn.connection.dbapi_connection
                raw.execute("PRAGMA auto_vacuum=INCREMENTAL").close()
                raw.execute("VACUUM").close()
            how = "full"
    else:
        while _vacuum_batch(ws) > VACUUM_BATCH:
            pass
        how = "incremental"
    with ws.db.engine.connect() as conn:
        try:
            conn.connection.dbapi_connection.execute("PRAGMA wal_checkpoint(TRUNCATE)").close()
        except Exception as exc:  # a busy reader: the WAL is reused instead
            log.info("WAL not truncated after gc: %s", exc)
    return how


def _vacuum_batch(ws: Workspace) -> int:
    """One transaction of ``incremental_vacuum`` (up to :data:`VACUUM_BATCH`
    pages), committed through the durable seam; returns the free pages
    there were.  Run with ``executescript``: Python's driver steps a
    statement that declares no columns only once, and this pragma frees
    one page per step."""
    with ws.db._translated(notify=True), ws.db.engine.connect() as conn:
        raw = conn.connection.dbapi_connection
        free = raw.execute("PRAGMA freelist_count").fetchone()[0]
        if not free:
            return 0
        raw.executescript(f"BEGIN IMMEDIATE; PRAGMA incremental_vacuum({VACUUM_BATCH});")
        try:
            durable_calls.commit(lambda: raw.execute("COMMIT").close(), False)
        finally:
            if raw.in_transaction:
                raw.execute("ROLLBACK").close()
        return free


def drop_conflicts(ws: Workspace, ids: list[int] | None) -> int:
    """Delete conflict rows (``ids``, or every one for None); their bytes
    go at the next gc.  Returns how many rows went.  Unknown ids raise
    :class:`InputError` naming them, and nothing is deleted."""
    from stepfs.store.errors import InputError

    C = schema.conflicts
    with ws.db.write(durable=True) as conn:
        if ids is None:
            return conn.execute(C.delete()).rowcount
        have = set(conn.execute(select(C.c.id).where(C.c.id.in_(ids))).scalars())
        missing = sorted(set(ids) - have)
        if missing:
            raise InputError(f"no conflict #{', #'.join(map(str, missing))}; 'stepfs status' lists the conflicts.")
        return conn.execute(C.delete().where(C.c.id.in_(ids))).rowcount
