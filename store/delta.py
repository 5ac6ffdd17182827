"""Deltas: a modified file's new bytes re-encoded against its version
before, once the layer is committed (:func:`after_commit`, format 7; run
after the commit lock is released, by ``store/deltawork.py``) and, for
layers that missed it, by gc's step 4 (``store/gc.py``); store side, no FUSE.

A small file stored inline (format 7, ``objects.data``) becomes a delta
object (``objects.codec`` 2, ``objects.base``) against the inline object
of its version before (or that one's base); the same rules as for chunks
below hold, with :data:`MAX_RATIO_INLINE`.

For every committed layer not yet done (``meta.delta_through``), every
entry whose before and after states are files with different objects: each
chunk of the after object that the before object does not share is
compressed with the before object's chunk that overlaps it most as the
zstd dictionary (``codec.DELTA``).  The row is rewritten only when that
stores at most a fifth of what the chunk takes now.  Its key and bytes do not
change, so readers see the same content before and after, in any snapshot.

Chains stay one link long: the base is a chunk that is not a delta itself
(the overlapping chunk, or, if that is a delta, its own base), and a chunk
that is some delta's base is never made a delta.  gc keeps a base as long
as a delta names it (``gc._garbage``).
"""

from __future__ import annotations

import logging
from collections import namedtuple
from contextlib import nullcontext
from typing import Callable, ContextManager

from sqlalchemy import bindparam, exists, select

from stepfs.store import codec, entrytable, schema
from stepfs.store.db import Prepared
from stepfs.store.errors import CorruptObject, StepfsError
from stepfs.store.objects import chunk_bytes, inline_and_base, inline_bytes

# (``ws`` arguments are ``store.workspace.Workspace``s; not imported: publish
# calls this module at a commit's end, and workspace imports publish.)
C, OC, L, O = schema.chunks, schema.object_chunks, schema.layers, schema.objects
log = logging.getLogger("stepfs.store")

#: Files bigger than this are left as they are (a delta pays for small edits
#: of text, and a big file's edited chunks are few anyway).
MAX_FILE = 8 << 20
#: A delta replaces a chunk only if it stores at most this fraction of it.
#: Deltas are against the chain's root, so they grow as a file drifts from
#: it; past this the chunk stays whole and roots the next ones (measured:
#: a line edited per step of a 100 KB file adds 60-700 bytes per step).
MAX_RATIO = 0.2
#: The same for a small inline object: a zstd frame costs about ten bytes
#: of its own, so a delta of a 100-byte file cannot reach a fifth; it is
#: kept when it saves a quarter of the row's bytes (measured: a version
#: number changed in 8 lines of a 384-byte file stores 49 bytes against 88).
MAX_RATIO_INLINE = 0.75
#: Inline objects smaller than this are left as they are.
MIN_INLINE = 32


# Precompiled (db.Prepared): a commit's pass runs these for every file it
# modified; built per call they cost about 7 ms a
# file on a loaded machine (SQLAlchemy's per-statement work).
_CHUNK_LIST = Prepared(select(OC.c.cid, OC.c.offset, C.c.size).join(C, C.c.cid == OC.c.cid)
                       .where(OC.c.oid == bindparam("oid")).order_by(OC.c.seq))
_CHUNK_ROW = Prepared(select(C.c.data, C.c.codec, C.c.size, C.c.base).where(C.c.cid == bindparam("cid")))
_IS_CHUNK_BASE = Prepared(select(exists().where(C.c.base == bindparam("cid"))))
_CHUNK_DELTA = Prepared(C.update().where(C.c.cid == bindparam("b_cid"), C.c.codec != bindparam("b_delta"))
                        .values(data=bindparam("b_data"), codec=bindparam("b_codec"), base=bindparam("b_base")))
_INLINE_ROW = Prepared(select(O.c.data, O.c.codec, O.c.size, O.c.base, O.c.is_base)
                       .where(O.c.oid == bindparam("oid")))
_MARK_BASE = Prepared(O.update().where(O.c.oid == bindparam("b_oid")).values(is_base=bindparam("b_mark")))
_INLINE_DELTA = Prepared(O.update().where(O.c.oid == bindparam("b_oid"), O.c.codec != bindparam("b_delta"))
                         .values(data=bindparam("b_data"), codec=bindparam("b_codec"), base=bindparam("b_base")))
_ChunkRow = namedtuple("_ChunkRow", "data codec size base")
_InlineRow = namedtuple("_InlineRow", "data codec size base is_base")


def _chunk_list(conn, oid: str) -> list[tuple[str, int, int]]:
    return [tuple(r) for r in _CHUNK_LIST.execute(conn, {"oid": oid})]


def _row(conn, cid: str):
    rows = _CHUNK_ROW.execute(conn, {"cid": cid})
    return _ChunkRow(*rows[0]) if rows else None


#: One re-encoding: ``chunk`` or ``inline`` row ``key`` becomes ``packed``,
#: a delta against ``base``; ``stored`` is what the row stores now.
Rewrite = namedtuple("Rewrite", "kind key packed base stored")


def plan_pair(conn, before_oid: str, after_oid: str, level: int = codec.DELTA_LEVEL) -> list[Rewrite]:
    """The chunks of ``after_oid`` that ``before_oid`` lacks, as deltas
    against it that pay (read only: :func:`apply` writes them)."""
    before = _chunk_list(conn, before_oid)
    if not before:
        return []
    shared = {cid for cid, _o, _s in before}
    out = []
    for cid, offset, size in _chunk_list(conn, after_oid):
        if cid in shared:
            continue
        row = _row(conn, cid)
        if row is None or row.codec == codec.DELTA or size < codec.MIN_SIZE:
            continue
        if _IS_CHUNK_BASE.execute(conn, {"cid": cid})[0][0]:
            continue  # a base stays a base
        end = offset + size
        best = max(before, key=lambda b: min(end, b[1] + b[2]) - max(offset, b[1]))
        base = best[0]
        brow = _row(conn, base)
        if brow is None:
            continue
        if brow.codec == codec.DELTA:
            base = brow.base
            brow = _row(conn, base)
            if brow is None or brow.codec == codec.DELTA:
                continue
        if base == cid:
            continue
        base_raw = chunk_bytes(conn, base, brow.data, brow.codec, brow.size, None)
        raw = chunk_bytes(conn, cid, row.data, row.codec, row.size, row.base)
        packed = codec.delta(raw, base_raw, level)
        if len(packed) > len(row.data) * MAX_RATIO:
            continue
        out.append(Rewrite("chunk", cid, packed, base, len(row.data)))
    return out


def _inline_row(conn, oid: str):
    rows = _INLINE_ROW.execute(conn, {"oid": oid})
    return _InlineRow(*rows[0]) if rows else None


def plan_inline(conn, before_oid: str, after_oid: str, level: int = codec.DELTA_LEVEL) -> list[Rewrite]:
    """Inline object ``after_oid`` as a delta against ``before_oid`` (or
    its base) if that pays: a list of one :class:`Rewrite`, or empty."""
    row = _inline_row(conn, after_oid)
    if row is None or row.data is None or row.codec == codec.DELTA or row.size < MIN_INLINE or row.is_base:
        return []  # (a base stays a base)
    base = before_oid
    brow = _inline_row(conn, base)
    if brow is not None and brow.codec == codec.DELTA and brow.data is not None:
        try:  # its base, found by prefix (format 10)
            base = inline_and_base(conn, before_oid, brow.data, brow.codec, brow.size, brow.base)[1]
        except CorruptObject:
            return []
        brow = _inline_row(conn, base)
    if brow is None or brow.data is None or brow.codec == codec.DELTA or base == after_oid:
        return []
    base_raw = inline_bytes(conn, base, brow.data, brow.codec, brow.size, None)
    raw = inline_bytes(conn, after_oid, row.data, row.codec, row.size, None)
    packed = codec.delta(raw, base_raw, level)
    if len(packed) > len(row.data) * MAX_RATIO_INLINE:
        return []
    return [Rewrite("inline", after_oid, packed, base, len(row.data))]


def apply(conn, rewrites: list[Rewrite]) -> tuple[int, int]:
    """Write ``rewrites`` through ``conn`` (a write transaction), each only
    if its rules still hold there: the row is not a delta (nor, for a
    chunk, some delta's base; for an object, ``is_base``), and its base
    exists and is not a delta.  They were planned on a snapshot that may be
    older (gc may have deleted the base since, another pass made a row a
    delta); a delta's bytes depend only on the two keys' contents, which
    never change.  Returns ``(rows rewritten, stored bytes saved)``."""
    done = saved = 0
    for rw in rewrites:
        if rw.kind == "chunk":
            row, brow = _row(conn, rw.key), _row(conn, rw.base)
            if (row is None or row.codec == codec.DELTA or len(row.data) != rw.stored or brow is None
                    or brow.codec == codec.DELTA or _IS_CHUNK_BASE.execute(conn, {"cid": rw.key})[0][0]):
                continue
            _CHUNK_DELTA.execute(conn, {"b_cid": rw.key, "b_delta": codec.DELTA, "b_data": rw.packed,
                                        "b_codec": codec.DELTA, "b_base": rw.base})
        else:
            row, brow = _inline_row(conn, rw.key), _inline_row(conn, rw.base)
            if (row is None or row.data is None or row.codec == codec.DELTA or row.is_base
                    or len(row.data) != rw.stored or brow is None or brow.data is None
                    or brow.codec == codec.DELTA):
                continue
            if not brow.is_base:
                _MARK_BASE.execute(conn, {"b_oid": rw.base, "b_mark": True})
            _INLINE_DELTA.execute(conn, {"b_oid": rw.key, "b_delta": codec.DELTA, "b_data": rw.packed,
                                         "b_codec": codec.DELTA, "b_base": rw.base})
        done += 1
        saved += rw.stored - len(rw.packed)
    return done, saved


def deltify_pair(conn, before_oid: str, after_oid: str, level: int = codec.DELTA_LEVEL) -> tuple[int, int]:
    """:func:`plan_pair` and :func:`apply` through ``conn`` (a write
    transaction).  Returns ``(chunks rewritten, stored bytes saved)``."""
    return apply(conn, plan_pair(conn, before_oid, after_oid, level))


def deltify_inline(conn, before_oid: str, after_oid: str, level: int = codec.DELTA_LEVEL) -> tuple[int, int]:
    """:func:`plan_inline` and :func:`apply` through ``conn`` (a write
    transaction).  Returns ``(1, saved)`` or ``(0, 0)``."""
    return apply(conn, plan_inline(conn, before_oid, after_oid, level))


def deltify_layer(conn, number: int, level: int = codec.DELTA_LEVEL) -> tuple[int, int]:
    """Deltas for the files layer ``number`` modified, through ``conn`` (a
    write transaction).  Returns ``(rows rewritten, stored bytes saved)``."""
    pairs = entrytable.modified_files(conn, number)
    done = saved = 0
    for before_oid, after_oid, size, inline in pairs:
        if inline:
            n, s = deltify_inline(conn, before_oid, after_oid, level)
        elif size <= MAX_FILE:
            n, s = deltify_pair(conn, before_oid, after_oid, level)
        else:
            continue
        done += n
        saved += s
    return done, saved


def _mark_done(conn, number: int) -> None:
    M = schema.meta
    conn.execute(M.delete().where(M.c.key == "delta_through"))
    conn.execute(M.insert().values(key="delta_through", value=str(number)))


#: Rewrites written per write transaction by :func:`after_commit`.
APPLY_BATCH = 64


def after_commit(ws, number: int, go: Callable[[], bool] | None = None,
                 writing: ContextManager | None = None) -> tuple[int, int]:
    """Deltas for layer ``number`` once it is committed, after the commit
    lock is released (``store/deltawork.py``).  They are planned (read,
    decoded, compressed) in a read transaction, and written in short write
    transactions of up to :data:`APPLY_BATCH` rows that check each row's
    rules again (:func:`apply`; ``BEGIN IMMEDIATE``: gc's sweep, another
    pass or a commit runs wholly before or after one, so a delta never
    names a base gc deleted and no chain grows a second link); the last
    one raises ``meta.delta_through`` if the layer before was done.  A
    crash leaves some rows deltas and the rest whole; gc's pass does the
    layer again.  ``go``: asked before each file; False stops the pass
    there (what was planned is written; the rest is left to gc).
    ``writing``: held around each write transaction.  Only an encoding
    changes, so a failure is logged and the commit stands."""
    M = schema.meta
    done = saved = 0
    pending: list[Rewrite] = []

    def flush(last: bool) -> None:
        nonlocal done, saved
        with writing or nullcontext(), ws.db.write() as conn:
            n, s = apply(conn, pending)
            if last:
                start = int(conn.execute(select(M.c.value).where(M.c.key == "delta_through")).scalar() or 0)
                if start == number - 1:
                    _mark_done(conn, number)
        pending.clear()
        done += n
        saved += s

    try:
        stopped = False
        with ws.db.read() as conn:
            for before_oid, after_oid, size, inline in entrytable.modified_files(conn, number):
                if go is not None and not go():
                    stopped = True
                    break
                if inline:
                    pending += plan_inline(conn, before_oid, after_oid, codec.COMMIT_DELTA_LEVEL)
                elif size <= MAX_FILE:
                    pending += plan_pair(conn, before_oid, after_oid, codec.COMMIT_DELTA_LEVEL)
                if len(pending) >= APPLY_BATCH:
                    flush(False)
        if pending or not stopped:
            flush(not stopped)
        return done, saved
    except StepfsError as exc:
        log.warning("deltas of layer %d not made now (gc makes them): %s", number, exc)
        return done, saved


def deltify(ws) -> tuple[int, int]:
    """Deltas for every committed layer after ``meta.delta_through``, one
    transaction per layer (each records its progress).  Returns
    ``(chunks rewritten, stored bytes saved)``."""
    M = schema.meta
    with ws.db.read() as conn:
        start = int(conn.execute(select(M.c.value).where(M.c.key == "delta_through")).scalar() or 0)
        numbers = conn.execute(select(L.c.number).where(L.c.state == "committed", L.c.number > start)
                               .order_by(L.c.number)).scalars().all()
    done = saved = 0
    for number in numbers:
        with ws.db.write() as conn:
            n, s = deltify_layer(conn, number)
            done += n
            saved += s
            _mark_done(conn, number)
    return done, saved
