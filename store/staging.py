"""Open steps and their staged rows (store side, no FUSE).

An open step belongs to one mountpoint; its rows in ``staged`` are the
overlay's upper layer as it was at one moment: the last close-write, fsync,
commit, status request or unmount, or at most the daemon's ``ROW_DELAY``
after a namespace or metadata change (``overlayfs/core/view.py``, "Staged rows
and crashes").  A daemon that restarts on the same mountpoint resumes from
there; one killed with SIGKILL loses the changes of that window together,
never an earlier one without the later ones.  The daemon keeps the state in
memory (``overlayfs/core/upper.py``) and writes these rows in batches, one
transaction each; it never reads them on a hot path.
"""

from __future__ import annotations

import time
from typing import Callable
from dataclasses import dataclass

from sqlalchemy import bindparam, delete, func, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection

from stepfs.store import schema, tokens
from stepfs.store.db import Prepared

S = schema.staged

# The write statements, built once: a metadata change of the mount writes one
# staged row, and building a statement per call cost ten times what SQLite
# takes to run it (py-spy of untar).  A row is written with one upsert on the
# primary key (step, path); SQLite and PostgreSQL spell it the same way, any
# other dialect gets a delete and an insert.
_FIELDS = ("kind", "mode", "oid", "target", "size", "mtime_ns", "opaque", "base", "uid", "gid", "xattrs",
           "link_group", "scratch", "scratch_sum")


def _upsert(insert):
    stmt = insert(S)
    return stmt.on_conflict_do_update(index_elements=[S.c.step, S.c.path],
                                      set_={f: stmt.excluded[f] for f in _FIELDS})


_UPSERT = {"sqlite": _upsert(sqlite.insert), "postgresql": _upsert(postgresql.insert)}
# SQLite's, run on the DBAPI cursor (``db.Prepared``): SQLAlchemy compiled
# the upsert again at every execution (its ON CONFLICT clause has no cache
# key), a third of the SQL cost of a close-write (py-spy of npm_create).
# Its values are plain str, int, bytes and None; ``opaque`` binds as 0/1.
_SQLITE_UPSERT = Prepared(_UPSERT["sqlite"], ["step", "path", *_FIELDS])
_INSERT = S.insert()
_DELETE = delete(S).where(S.c.step == bindparam("b_step"), S.c.path == bindparam("b_path"))
# What lies below a path: a range of the primary key.  (One statement with
# "path = ? OR path in the range" made SQLite scan every row of the step:
# 0.4 ms per removal of a step of 2,000 rows, on the view's lock.)
_DELETE_BELOW = delete(S).where(S.c.step == bindparam("b_step"), S.c.path >= bindparam("b_lo"),
                                S.c.path < bindparam("b_hi"))
# The deletes of a batch of recorded rows (rows.PendingRows.write) run on the
# DBAPI cursor in one executemany: through SQLAlchemy each cost about 50 us
# of Python, one per file of an rm -rf of staged files.
_PREPARED_DELETE = Prepared(_DELETE)
_PREPARED_DELETE_BELOW = Prepared(_DELETE_BELOW)


@dataclass
class StagedRow:
    """One staged path.  ``kind`` is file | dir | symlink | fifo | chardev |
    blockdev | socket | whiteout; a device's number is its ``target``."""

    path: bytes
    kind: str
    mode: int = 0
    oid: str | None = None
    target: bytes | None = None
    size: int = 0
    mtime_ns: int = 0
    opaque: bool = False
    base: str = "absent"
    uid: int | None = None
    gid: int | None = None
    xattrs: bytes | None = None
    link_group: int | None = None
    scratch: str | None = None  # staged by reference (store/refs.py); oid is None then
    scratch_sum: str | None = None
    #: A path the step removed and then replaced (by a directory, file or
    #: symlink): when it was first removed (the view's ``removal_time``).
    #: Stored in ``base`` after :data:`REMOVED_SEP` (FORMAT.md, "staged").
    removed_ns: int | None = None


#: ``staged.base`` of a replaced path: ``<token>;removed=<ns>``.  Kept in the
#: base so that an older reader of the same format, which knows nothing of
#: it, sees a base no token equals and refuses that path as changed instead
#: of deleting what was made below it outside after the removal.
REMOVED_SEP = ";removed="


def _split_base(stored: str) -> tuple[str, int | None]:
    base, sep, ns = stored.partition(REMOVED_SEP)
    return base, (int(ns) if sep else None)


def open_step(conn: Connection, mountpoint: str, agent: str = "") -> int:
    """The id of the open step of ``mountpoint``, created if there is none."""
    row = conn.execute(select(schema.steps.c.id).where(schema.steps.c.mountpoint == mountpoint)).first()
    if row is not None:
        return row.id
    return conn.execute(
        schema.steps.insert().values(mountpoint=mountpoint, agent=agent, created_ns=time.time_ns())
    ).inserted_primary_key[0]


def list_steps(conn: Connection) -> list[dict]:
    """Every open step with its number of staged rows."""
    counts = (
        select(S.c.step, func.count().label("n")).group_by(S.c.step).subquery()
    )
    rows = conn.execute(
        select(schema.steps, func.coalesce(counts.c.n, 0).label("staged"))
        .outerjoin(counts, counts.c.step == schema.steps.c.id)
        .order_by(schema.steps.c.id)
    )
    return [dict(r._mapping) for r in rows]


# Every commit loads its step's rows: compiled once and run on the DBAPI
# cursor (db.Prepared; the columns are ints, texts and blobs, and opaque is
# turned into a bool here).
_LOAD_COLUMNS = ("path", "kind", "mode", "oid", "target", "size", "mtime_ns", "opaque", "base", "uid", "gid",
                 "xattrs", "link_group", "scratch", "scratch_sum")
_LOAD = Prepared(select(*(S.c[c] for c in _LOAD_COLUMNS)).where(S.c.step == bindparam("step")).order_by(S.c.path))


def load(conn: Connection, step: int) -> list[StagedRow]:
    return [
        StagedRow(
            path=bytes(path), kind=kind, mode=mode, oid=oid, target=bytes(target) if target is not None else None,
            size=size, mtime_ns=mtime_ns, opaque=bool(opaque), base=base, uid=uid, gid=gid,
            xattrs=bytes(xattrs) if xattrs is not None else None,
            link_group=link_group, scratch=scratch, scratch_sum=scratch_sum,
        ) if REMOVED_SEP not in base else _with_removal(
            path, kind, mode, oid, target, size, mtime_ns, opaque, base, uid, gid, xattrs, link_group, scratch,
            scratch_sum)
        for (path, kind, mode, oid, target, size, mtime_ns, opaque, base, uid, gid, xattrs, link_group, scratch,
             scratch_sum) in _LOAD.execute(conn, {"step": step})
    ]


def _with_removal(path, kind, mode, oid, target, size, mtime_ns, opaque, base, uid, gid, xattrs, link_group,
                  scratch, scratch_sum) -> StagedRow:
    base, removed_ns = _split_base(base)
    return StagedRow(
        path=bytes(path), kind=kind, mode=mode, oid=oid, target=bytes(target) if target is not None else None,
        size=size, mtime_ns=mtime_ns, opaque=bool(opaque), base=base, uid=uid, gid=gid,
        xattrs=bytes(xattrs) if xattrs is not None else None,
        link_group=link_group, scratch=scratch, scratch_sum=scratch_sum, removed_ns=removed_ns,
    )


def _params(step: int, row: StagedRow, oid: str | None = None) -> dict:
    return {
        "step": step, "path": row.path, "kind": row.kind, "mode": row.mode, "oid": row.oid if oid is None else oid,
        "target": row.target,
        "size": row.size, "mtime_ns": row.mtime_ns, "opaque": row.opaque,
        "base": row.base if row.removed_ns is None else f"{row.base}{REMOVED_SEP}{row.removed_ns}",
        "uid": row.uid, "gid": row.gid, "xattrs": row.xattrs, "link_group": row.link_group,
        "scratch": row.scratch, "scratch_sum": row.scratch_sum,
    }


def put(conn: Connection, step: int, row: StagedRow) -> None:
    """Insert or replace the staged row of ``row.path``."""
    put_many(conn, step, [row])


def put_many(conn: Connection, step: int, rows: list[StagedRow], oids: list[str | None] | None = None) -> None:
    """Insert or replace the staged rows of several paths (distinct paths).
    ``oids``: per row, the object id to write instead of ``row.oid`` (None:
    its own), so a caller that resolves placeholders need not copy rows."""
    if not rows:
        return
    if oids is None:
        params = [_params(step, row) for row in rows]
    else:
        params = [_params(step, row, oid) for row, oid in zip(rows, oids)]
    if conn.dialect.name == "sqlite":
        _SQLITE_UPSERT.executemany(conn, params)
        return
    upsert = _UPSERT.get(conn.dialect.name)
    if upsert is not None:
        conn.execute(upsert, params)
        return
    conn.execute(_DELETE, [{"b_step": step, "b_path": p["path"]} for p in params])
    conn.execute(_INSERT, params)


def remove(conn: Connection, step: int, path: bytes) -> None:
    remove_many(conn, step, [path])


def remove_many(conn: Connection, step: int, paths: list[bytes]) -> None:
    """Remove the rows of ``paths`` (one statement run for each, one call)."""
    if paths:
        _PREPARED_DELETE.executemany(conn, [{"b_step": step, "b_path": p} for p in paths])


def remove_tree(conn: Connection, step: int, path: bytes) -> None:
    """Remove the rows of ``path`` and of everything below it."""
    remove_trees(conn, step, [path])


def remove_trees(conn: Connection, step: int, paths: list[bytes]) -> None:
    """:func:`remove_tree` of each of ``paths``, in one call."""
    if not paths:
        return
    remove_many(conn, step, paths)
    below = []
    for path in paths:
        prefix = path.rstrip(b"/") + b"/"
        below.append({"b_step": step, "b_lo": prefix, "b_hi": prefix[:-1] + b"0"})
    _PREPARED_DELETE_BELOW.executemany(conn, below)


def discard(conn: Connection, step: int, path: bytes, mount: str = "", agent: str = "",
            token_now: Callable[[bytes], str] | None = None) -> list[bytes]:
    """Drop the staged rows of ``path`` and below from ``step``.  A staged
    file whose workspace path changed since it was staged (``token_now(p)``
    no longer matches the row's base) lost a race: its bytes are kept as a
    ``discarded`` conflict row first.  Any other staged file is a draft the
    user threw away: nothing keeps its bytes, the next gc collects them.
    Without ``token_now`` every staged file is kept as a conflict.  (Files
    staged by reference must have been imported first: ``refs.import_refs``
    in the same transaction.)  Returns the dropped paths."""
    prefix = path.rstrip(b"/") + b"/"
    rows = [r for r in load(conn, step) if r.path == path or r.path.startswith(prefix)]
    for r in rows:
        if r.scratch is not None:
            raise ValueError("discard of a row staged by reference: import it first (store/refs.py)")
        # A racy base (one with a content hash) counts as changed: when in doubt, keep.
        lost = token_now is None or not tokens.same(r.base, token_now(r.path), lambda: None)
        if r.kind == "file" and r.oid is not None and lost:
            conn.execute(schema.conflicts.insert().values(
                created_ns=time.time_ns(), path=r.path, mount=mount, agent=agent, reason="discarded",
                oid=r.oid, mode=r.mode & 0o7777, token_mine="", token_theirs=r.base,
            ))
    remove_tree(conn, step, path)
    return [r.path for r in rows]
