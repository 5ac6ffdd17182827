"""Where a store's bytes go (``stepfs du``, the bytes on change cards),
store side, no FUSE.

A chunk's bytes are *stored* bytes (``length(data)``: compressed, or a
delta), counted once: for the first layer (in number order) whose entries
reach it, through their objects and a delta's base.  So the bytes of a
layer are what that layer added to the store, and the layers' bytes add up
to what history holds.  The same chunk reached only by open steps is
counted as ``staged``, only by conflicts as ``conflicts``, and by nothing
as ``garbage`` (what ``stepfs gc`` would free).
"""

from __future__ import annotations

import os

from sqlalchemy import select

from stepfs.store import entrytable, schema
from stepfs.store.cardrows import Rows
from stepfs.store.units import human  # noqa: F401  (its callers' name for it)
from stepfs.store.workspace import Workspace

C, OC = schema.chunks, schema.object_chunks
#: Object ids per ``IN`` list.
_BATCH = 5000


def _chunks_of(conn, oids: set[str]) -> dict[str, list[str]]:
    """``{oid: [cid, ...]}`` with each delta's base listed after it."""
    return Rows.over(conn).chunks_of(oids)


def _stored(conn) -> dict[str, int]:
    """Stored bytes of every chunk."""
    return Rows.over(conn).stored()


def added_bytes(conn, numbers: list[int] | None = None) -> dict[int, int]:
    """Stored bytes each committed layer added (module doc), for
    ``numbers`` (default: every one); ``cardrows.Rows.added_bytes``."""
    return Rows.over(conn).added_bytes(numbers)


def usage(ws: Workspace) -> dict:
    """The store's bytes: on disk, by layer, by top-level directory, staged,
    conflicts, garbage, free pages."""
    from stepfs.store import gc

    with ws.db.read() as conn:
        sizes = _stored(conn)
        rows = entrytable.committed_object_refs(conn)
        staged = set(conn.execute(select(schema.staged.c.oid).where(schema.staged.c.oid.is_not(None))).scalars())
        conflicts = set(conn.execute(select(schema.conflicts.c.oid)
                                     .where(schema.conflicts.c.oid.is_not(None))).scalars())
        oids = {x for r in rows for x in (r.before_oid, r.after_oid) if x} | staged | conflicts
        chunks = _chunks_of(conn, oids)
        page = conn.exec_driver_sql("PRAGMA page_size").scalar()
        free = conn.exec_driver_sql("PRAGMA freelist_count").scalar() * page
    seen: set[str] = set()
    by_layer: dict[int, int] = {}
    by_dir: dict[str, int] = {}

    def take(oid: str | None) -> int:
        total = 0
        for cid in chunks.get(oid, ()) if oid else ():
            if cid not in seen:
                seen.add(cid)
                total += sizes.get(cid, 0)
        return total

    for layer, path, b, a in rows:
        n = take(b) + take(a)
        by_layer[layer] = by_layer.get(layer, 0) + n
        top = os.fsdecode(bytes(path).split(b"/", 1)[0]) + ("/" if b"/" in bytes(path) else "")
        by_dir[top] = by_dir.get(top, 0) + n
    staged_bytes = sum(take(o) for o in sorted(staged))
    conflict_bytes = sum(take(o) for o in sorted(conflicts))
    garbage = sum(n for cid, n in sizes.items() if cid not in seen)
    return {
        "store": ws.db.label, "disk_bytes": gc.store_bytes(ws), "free_page_bytes": free,
        "chunk_bytes": sum(sizes.values()), "history_bytes": sum(by_layer.values()),
        "layers": {str(k): v for k, v in sorted(by_layer.items())},
        "top_level": dict(sorted(by_dir.items(), key=lambda kv: -kv[1])),
        "staged_bytes": staged_bytes, "conflict_bytes": conflict_bytes, "garbage_bytes": garbage,
    }
