"""Integrity check of a store (``stepfs verify``), store side, no FUSE.

What is checked, each problem named in one sentence:

* SQLite's own ``PRAGMA integrity_check`` and ``PRAGMA foreign_key_check``;
* every chunk: its bytes re-hashed against its key, its recorded size;
* every object: its chunks exist, their offsets are contiguous, their sizes
  add up to the object's size, and the whole content re-hashes to the key;
* every layer: no layer is left ``pending`` (recovery ran when the store was
  opened, so one left means recovery failed), the intent checksum of every
  committed layer still verifies, and every object an entry names exists;
* every staged row's and conflict's object exists.

Read-only: everything is read in one snapshot; nothing is repaired.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable

import xxhash
from sqlalchemy import func, select
from sqlalchemy.exc import DBAPIError

from stepfs.store import codec, entrytable, refs, schema
from stepfs.store.entrylist import ListDamaged
from stepfs.store.errors import CorruptObject
from stepfs.store.objects import chunk_bytes, inline_and_base, xxh3_hex
from stepfs.store.workspace import Workspace

C, O, OC = schema.chunks, schema.objects, schema.object_chunks
L = schema.layers

#: Stop listing problems of one kind after this many (the count stays exact).
MAX_LISTED = 50


@dataclass
class Report:
    problems: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    _per_kind: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems

    def add(self, kind: str, text: str) -> None:
        n = self._per_kind.get(kind, 0) + 1
        self._per_kind[kind] = n
        if n <= MAX_LISTED:
            self.problems.append(text)
        elif n == MAX_LISTED + 1:
            self.problems.append(f"(more {kind} problems not listed)")


def verify(ws: Workspace, progress: Callable[[int, int | None], None] | None = None,
           workspace: bool = False) -> Report:
    """Check the whole store of ``ws``; never raises for a problem found
    (a part SQLite itself cannot read is reported as a problem too).
    ``progress(done, total)`` is called as chunks and objects are checked.
    ``workspace``: also compare every committed path of the workspace with
    the head layer (``store.wscheck``)."""
    report = Report()
    if workspace:
        from stepfs.store.wscheck import check_workspace

        try:
            report.counts["workspace paths"] = check_workspace(ws, report.add)
        except DBAPIError as exc:
            report.add("sqlite", f"SQLite could not read the layers to check the workspace: {getattr(exc, 'orig', exc)}")
    with ws.db.read() as conn:
        state: dict = {"bad_chunks": set(), "chunk_sizes": {}, "objects": set(), "done": 0, "store_dir": ws.store_dir,
                       "progress": progress or (lambda done, total: None)}
        try:
            state["total"] = (conn.execute(select(func.count()).select_from(C)).scalar_one()
                              + conn.execute(select(func.count()).select_from(O)).scalar_one())
        except DBAPIError:
            state["total"] = None
        for what, check in (("the database's integrity", _sqlite), ("the chunks", _chunks),
                            ("the objects", _objects), ("the entry lists", _lists), ("the layers", _layers),
                            ("the line counts", _line_counts), ("the references", _references)):
            try:
                check(conn, report, ws.objects.hasher, state)
            except DBAPIError as exc:
                report.add("sqlite", f"SQLite could not check {what}: {getattr(exc, 'orig', exc)}")
            except (ListDamaged, KeyError) as exc:  # reported by _lists already
                report.add("layer", f"could not check {what}: {exc}")
    return report


def _tick(state: dict) -> None:
    state["done"] += 1
    if state["done"] % 64 == 0 or state["done"] == state["total"]:
        state["progress"](state["done"], state["total"])


def _sqlite(conn, report: Report, _hasher, _state) -> None:
    for (line,) in conn.exec_driver_sql("PRAGMA integrity_check").all():
        if line != "ok":
            report.add("sqlite", f"SQLite integrity check: {line}")
    for row in conn.exec_driver_sql("PRAGMA foreign_key_check").all():
        report.add("reference", f"table {row[0]} row {row[1]} names a missing row of {row[2]}")


def _chunks(conn, report: Report, hasher, state: dict) -> None:
    n = 0
    for cid, size, data, how, base in conn.execute(select(C.c.cid, C.c.size, C.c.data, C.c.codec, C.c.base)):
        n += 1
        _tick(state)
        state["chunk_sizes"][cid] = size
        try:
            # A delta is decoded with its base: both are checked by the hash.
            data = chunk_bytes(conn, cid, data, how, size, base)
        except CorruptObject as exc:
            state["bad_chunks"].add(cid)
            report.add("chunk", str(exc))
            continue
        state["chunk_sizes"][cid] = len(data)
        if hasher(data) != cid.split(".", 1)[0]:
            state["bad_chunks"].add(cid)
            report.add("chunk", f"chunk {cid} is corrupt: its bytes no longer hash to its key")
        elif len(data) != size:
            state["bad_chunks"].add(cid)
            report.add("chunk", f"chunk {cid} holds {len(data)} bytes, {size} recorded")
    report.counts["chunks"] = n


def _objects(conn, report: Report, hasher, state: dict) -> None:
    lists: dict[str, list[tuple[int, int, str]]] = {}
    for oid, seq, offset, cid in conn.execute(
        select(OC.c.oid, OC.c.seq, OC.c.offset, OC.c.cid).order_by(OC.c.oid, OC.c.seq)
    ):
        lists.setdefault(oid, []).append((seq, offset, cid))
    n = 0
    bases: set[str] = set()
    marked: set[str] = set()
    for oid, size, inline, how, base, is_base in conn.execute(
            select(O.c.oid, O.c.size, O.c.data, O.c.codec, O.c.base, O.c.is_base)):
        n += 1
        _tick(state)
        state["objects"].add(oid)
        if is_base:
            marked.add(oid)
        if inline is not None:
            found = _check_inline(conn, report, hasher, oid, size, (inline, how, base), lists.get(oid, []))
            if found is not None:  # the base its prefix names (format 10)
                bases.add(found)
            continue
        _check_object(conn, report, hasher, oid, size, lists.get(oid, []), state["chunk_sizes"], state["bad_chunks"])
    for base in sorted(bases - marked):  # it could be made a delta itself: a chain of two
        report.add("object", f"object {base} is a delta's base but not marked is_base")
    report.counts["objects"] = n


def _layers(conn, report: Report, _hasher, _state) -> None:
    from stepfs.store.publish import intent_checksum  # publish imports workspace; keep this module light

    layers = conn.execute(select(L.c.number, L.c.state, L.c.intent_sum, L.c.step).order_by(L.c.number)).all()
    for number, state, checksum, step in layers:
        if state == "pending":
            report.add("layer", f"layer {number} is still pending: recovery could not finish publishing it")
        if state == "committed" and number != 0:
            if intent_checksum(entrytable.layer_entries(conn, number), step) != checksum:
                report.add("layer", f"layer {number}'s entries no longer match its intent checksum")
    report.counts["layers"] = len(layers)


def _lists(conn, report: Report, _hasher, _state) -> None:
    for problem in entrytable.list_problems(conn):
        report.add("layer", problem)


def _line_counts(conn, report: Report, _hasher, _state) -> None:
    from stepfs.store import linecounts

    for problem in linecounts.problems(conn):
        report.add("layer", problem)


def _references(conn, report: Report, _hasher, state: dict) -> None:
    objects = state["objects"]
    for layer, path, before, after in entrytable.object_refs(conn):
        for which, oid in (("before", before), ("after", after)):
            if oid is not None and oid not in objects:
                report.add("reference", f"layer {layer} path {bytes(path)!r}: {which} object {oid} is missing")
    for step, path, oid in conn.execute(select(schema.staged.c.step, schema.staged.c.path, schema.staged.c.oid)):
        if oid is not None and oid not in objects:
            report.add("reference", f"open step {step} path {bytes(path)!r}: object {oid} is missing")
    S = schema.staged
    for step, path, name, want, size in conn.execute(
            select(S.c.step, S.c.path, S.c.scratch, S.c.scratch_sum, S.c.size).where(S.c.scratch.is_not(None))):
        # A file staged by reference (store/refs.py): its scratch file must
        # still hold what was closed.
        where = f"open step {step} path {bytes(path)!r}: scratch file {name}"
        try:
            fd = os.open(os.path.join(refs.scratch_dir(state["store_dir"], step), name),
                         os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            report.add("reference", f"{where} cannot be read ({exc.strerror})")
            continue
        try:
            if os.fstat(fd).st_size != size or refs.content_sum(fd) != want:
                report.add("reference", f"{where} no longer holds the content that was closed")
        finally:
            os.close(fd)
    for cid_, path, oid in conn.execute(select(schema.conflicts.c.id, schema.conflicts.c.path, schema.conflicts.c.oid)):
        if oid is not None and oid not in objects:
            report.add("reference", f"conflict #{cid_} ({bytes(path)!r}): object {oid} is missing")
    report.counts["staged"] = conn.execute(select(func.count()).select_from(schema.staged)).scalar_one()


def _check_inline(conn, report: Report, hasher, oid: str, size: int, row, chunk_list) -> str | None:
    """An object stored in its row (format 7): decodes (a delta with its
    base, which must be an inline object that is no delta, found by the
    prefix ``base`` names: format 10), has its size, hashes to its key,
    and lists no chunks.  Returns the key of a delta's base found."""
    stored, how, base = row
    if chunk_list:
        report.add("object", f"object {oid} is stored inline and also lists chunks")
    if (how == codec.DELTA) != (base is not None):
        report.add("object", f"object {oid} has codec {how} and base {base}: a base belongs to a delta alone")
        return None
    try:
        data, found = inline_and_base(conn, oid, stored, how, size, base, hasher)
    except CorruptObject as exc:
        report.add("object", str(exc))
        return None
    if len(data) != size:
        report.add("object", f"object {oid} holds {len(data)} bytes inline, {size} recorded")
    elif hasher(data) != oid.split(".", 1)[0]:
        report.add("object", f"object {oid} is corrupt: its content no longer hashes to its key")
    return found


def _check_object(conn, report: Report, hasher, oid: str, size: int, chunk_list: list[tuple[int, int, str]],
                  chunk_sizes: dict[str, int], bad_chunks: set[str]) -> None:
    pos = 0
    for expected_seq, (seq, offset, cid) in enumerate(chunk_list):
        if seq != expected_seq or offset != pos:
            report.add("object", f"object {oid} has a gap or overlap in its chunk list at chunk {seq}")
            return
        if cid not in chunk_sizes:
            report.add("object", f"object {oid} names missing chunk {cid}")
            return
        if cid in bad_chunks:
            report.add("object", f"object {oid} contains corrupt chunk {cid}")
            return
        pos += chunk_sizes[cid]
    if pos != size:
        report.add("object", f"object {oid} has {pos} bytes in its chunks, {size} recorded")
        return
    if len(chunk_list) == 1 and chunk_list[0][2].split(".", 1)[0] == oid.split(".", 1)[0]:
        return  # one verified chunk whose key is the object's: the whole hash is checked
    streaming = hasher is xxh3_hex
    whole = xxhash.xxh3_128() if streaming else None
    parts: list[bytes] = []
    for _seq, _off, cid in chunk_list:
        row = conn.execute(select(C.c.data, C.c.codec, C.c.size, C.c.base).where(C.c.cid == cid)).one()
        data = chunk_bytes(conn, cid, *row)
        if streaming:
            whole.update(data)
        else:
            parts.append(data)
    digest = whole.hexdigest() if streaming else hasher(b"".join(parts))
    if digest != oid.split(".", 1)[0]:
        report.add("object", f"object {oid} is corrupt: its content no longer hashes to its key")
