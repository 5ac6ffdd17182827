"""A shared layer's whole state with every file's bytes, for a clone.

On PostgreSQL it is ONE query, read through a server-side cursor: each
path's newest entry at or below the layer (``DISTINCT ON``, the
``stepfs_entries_path`` index) joined to its object's chunks, in path
order, so the first files can be written while the server still sends the
rest and memory holds a batch, not the tree.  An SQLite history file
reads the state, then the objects a batch at a time (``Remote``'s reads).

Every chunk is checked against its hash and every object against its
hash and size (:class:`CorruptObject` otherwise), as ``Remote`` does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from stepfs.store.errors import CorruptObject
from stepfs.store.shared import tables as T
from stepfs.store.shared.remote import Remote, sha256_hex

#: A batch handed to the caller: at most this many paths or (about) bytes.
BATCH_PATHS = 1000
BATCH_BYTES = 16 << 20
#: Rows the server-side cursor fetches per round trip.
FETCH_ROWS = 2000

_STATE_PG = f"""
WITH s AS (
  SELECT DISTINCT ON (path) path, after_kind, after_mode, after_object, after_target, after_xattrs, after_mtime_ns
  FROM {T.entries.name} WHERE history = %(h)s AND layer <= %(n)s ORDER BY path, layer DESC
)
SELECT s.path, s.after_kind, s.after_mode, s.after_object, s.after_target, s.after_xattrs, s.after_mtime_ns,
       o.size, oc.seq, c.hash, c.data
FROM s
LEFT JOIN {T.objects.name} o ON o.hash = s.after_object
LEFT JOIN {T.object_chunks.name} oc ON oc.object = s.after_object
LEFT JOIN {T.chunks.name} c ON c.hash = oc.chunk
WHERE s.after_kind IS NOT NULL
ORDER BY s.path, oc.seq
"""


@dataclass
class PathState:
    """A path's state as of the layer; ``data`` is a file's whole content."""

    path: bytes
    kind: str
    mode: int
    digest: str | None
    target: bytes | None
    xattrs: bytes | None
    mtime_ns: int | None
    data: bytes | None = None


def batches(remote: Remote, number: int) -> Iterator[list[PathState]]:
    """Every path existing as of shared layer ``number``, in path order,
    in batches (see the module doc)."""
    if remote.url.dialect == "postgresql":
        yield from _batches_pg(remote, number)
    else:
        yield from _batches_read(remote, number)


def _damaged(remote: Remote, digest: str, why: str) -> CorruptObject:
    return CorruptObject(f"object {digest} of the shared history {remote.url.display} is {why}.")


def _batches_pg(remote: Remote, number: int) -> Iterator[list[PathState]]:
    out: list[PathState] = []
    size = 0
    cur: PathState | None = None
    pieces: list[bytes] = []
    want = 0

    def finish() -> None:
        nonlocal size
        if cur.digest is not None:
            data = b"".join(pieces)
            if len(data) != want or sha256_hex(data) != cur.digest:
                raise _damaged(remote, cur.digest, "missing or damaged")
            cur.data = data
            size += len(data)
        out.append(cur)

    with remote.tx() as conn:  # a server-side cursor lives in a transaction
        result = conn.exec_driver_sql(_STATE_PG, {"h": remote.name, "n": number},
                                      execution_options={"stream_results": True, "max_row_buffer": FETCH_ROWS})
        for rows in result.partitions(FETCH_ROWS):
            for path, kind, mode, digest, target, xattrs, mtime, osize, seq, chash, data in rows:
                path = bytes(path)
                if cur is None or path != cur.path:
                    if cur is not None:
                        finish()
                        if len(out) >= BATCH_PATHS or size >= BATCH_BYTES:
                            yield out
                            out, size = [], 0
                    cur = PathState(path, kind, mode, digest if kind == "file" else None,
                                    None if target is None else bytes(target),
                                    None if xattrs is None else bytes(xattrs), mtime)
                    pieces, want = [], osize or 0
                    if cur.digest is not None and osize is None:
                        raise _damaged(remote, digest, "missing")
                if seq is None or cur.digest is None:
                    continue  # no chunk: an empty file, or not a file
                if seq != len(pieces) or data is None or sha256_hex(data) != chash:
                    raise _damaged(remote, digest, f"damaged at chunk {seq}")
                pieces.append(bytes(data))
        if cur is not None:
            finish()
    if out:
        yield out


def _batches_read(remote: Remote, number: int) -> Iterator[list[PathState]]:
    states = remote.state_at(number)
    todo = [PathState(p, r["after_kind"], r["after_mode"], r["after_object"] if r["after_kind"] == "file" else None,
                      r["after_target"], r["after_xattrs"], r["after_mtime_ns"])
            for p, r in sorted(states.items()) if r["after_kind"] is not None]
    for i in range(0, len(todo), BATCH_PATHS):
        batch = todo[i:i + BATCH_PATHS]
        got = remote.read_objects(sorted({s.digest for s in batch if s.digest is not None}))
        for s in batch:
            if s.digest is not None:
                s.data = got[s.digest]
        yield batch
