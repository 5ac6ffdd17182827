"""Content-addressed objects: hash, chunk, deduplicate, read back, verify.

An object is immutable file content split into chunks, cut by content
(:mod:`store.chunking`: an insertion changes the chunks around it only, so
an edited file shares all its other chunks with the version before).
Chunks and objects are keyed by the hex XXH3-128 of their bytes; the object
id hashes the whole content, so it does not depend on how the content was
cut, and objects stored with fixed 1 MiB chunks read and verify as before.
XXH3 is fast but not collision-resistant against crafted input, and agents
write attacker-influenced text, so a key hit is never trusted: a chunk is
deduplicated only after a byte-for-byte comparison, and an object only when
its chunk list is identical (chunks being verified, equal chunk lists mean
equal bytes) or, cut otherwise, its bytes are.  A genuine collision gets a
suffixed key (``<hash>.1``), so different bytes are never merged.

Content of at most :data:`INLINE_MAX` bytes is stored in its object row
(format 7: ``objects.data`` and ``objects.codec``, no chunk rows): most
files of a source tree are that small, and a chunk row, its object_chunks
row and their index entries cost more than their bytes.

A put reads the content in bounded windows and handles each run of chunks
with one lookup of their keys and one multi-row insert of the new ones.

All functions take an open SQLAlchemy connection inside a transaction chosen
by the caller (``Database.write`` for puts); none commits on its own.
"""

from __future__ import annotations

import os
from typing import Callable, Iterator

import xxhash
from sqlalchemy import bindparam, case, select
from sqlalchemy.engine import Connection
from sqlalchemy.exc import NoResultFound

from stepfs.store import cardrows, chunking, codec, durable, schema
from stepfs.store.db import Prepared
from stepfs.store.errors import CorruptObject

Hasher = Callable[[bytes], str]

def xxh3_hex(data: bytes) -> str:
    """The digest function; tests swap in a deliberately weak one to force collisions."""
    return xxhash.xxh3_128_hexdigest(data)


def _key_family(column):
    """``column`` is ``:digest`` or ``:digest.<n>``: a range, so the primary
    key index answers it (``/`` is the byte after ``.``).  Binds ``digest``,
    ``lo`` (digest + ".") and ``hi`` (digest + "/")."""
    return (column == bindparam("digest")) | ((column > bindparam("lo")) & (column < bindparam("hi")))


def _family_params(digest: str) -> dict:
    return {"digest": digest, "lo": digest + ".", "hi": digest + "/"}


# Statements of the put and read paths, built once: every close-write and
# every read of a staged file runs them, and building a statement costs
# more than SQLite takes to run it.
_C, _O, _OC = schema.chunks, schema.objects, schema.object_chunks
# The hot ones run through ``db.Prepared`` (no per-execution SQLAlchemy
# work): their values and columns are plain str, int and bytes.
_CHUNK_FAMILY = select(_C.c.cid, case((_C.c.size == bindparam("size"), _C.c.data), else_=None),
                       _C.c.codec, _C.c.size, _C.c.base).where(_key_family(_C.c.cid))
_CHUNK_INSERT = Prepared(_C.insert(), ["cid", "size", "data", "codec", "base"])
_CHUNKS_BY_KEY = Prepared(select(_C.c.cid, _C.c.data, _C.c.codec, _C.c.size, _C.c.base)
                          .where(_C.c.cid.in_(bindparam("cids", expanding=True))))
_CHUNK_ROW = Prepared(select(_C.c.data, _C.c.codec, _C.c.size, _C.c.base).where(_C.c.cid == bindparam("cid")))
_GENERATION = Prepared(select(schema.meta.c.value).where(schema.meta.c.key == bindparam("key")))
_OBJECT_TOUCH = Prepared(schema.objects.update().where(
    schema.objects.c.oid == bindparam("b_oid"), schema.objects.c.gen < bindparam("b_gen"))
    .values(gen=bindparam("b_gen")))
#: Chunks looked up and inserted per statement (well under SQLite's bound-variable limit).
_BATCH = 256
#: Zero runs at least this long and aligned in the file are left as holes.
_BLOCK = 4096
_OBJECT_FAMILY = Prepared(select(_O.c.oid, _O.c.size).where(_key_family(_O.c.oid)))
_OBJECT_CHUNK_LISTS = Prepared(
    select(_OC.c.oid, _OC.c.cid).where(_OC.c.oid.in_(bindparam("oids", expanding=True)))
    .order_by(_OC.c.oid, _OC.c.seq)
)
_OBJECT_INSERT = Prepared(_O.insert(), ["oid", "size", "gen"])
_OBJECT_READ = Prepared(
    select(_OC.c.cid, _OC.c.offset, _C.c.data, _C.c.codec, _C.c.size, _C.c.base)
    .select_from(_OC.outerjoin(_C, _C.c.cid == _OC.c.cid))
    .where(_OC.c.oid == bindparam("oid"))
    .order_by(_OC.c.seq)
)
_OBJECT_CHUNKS_INSERT = Prepared(_OC.insert(), ["oid", "seq", "offset", "cid"])
_OBJECT_SIZE = Prepared(select(_O.c.size).where(_O.c.oid == bindparam("oid")))
_OBJECT_INLINE = Prepared(select(_O.c.data, _O.c.codec, _O.c.size, _O.c.base).where(_O.c.oid == bindparam("oid")))
_OBJECT_FAMILY_INLINE = Prepared(select(_O.c.oid, _O.c.size, _O.c.data, _O.c.codec, _O.c.base)
                                 .where(_key_family(_O.c.oid)))
_OBJECT_INSERT_INLINE = Prepared(_O.insert(), ["oid", "size", "gen", "data", "codec", "base"])
_OBJECTS_BY_KEY = Prepared(select(_O.c.oid).where(_O.c.oid.in_(bindparam("oids", expanding=True))))
#: Content up to this many bytes is stored inline in its object row (format 7).
INLINE_MAX = 2048
#: Bigger contents up to this many bytes are chunked in one batch by
#: ``ObjectStore.put_many`` (held in memory whole anyway); bigger ones one by one.
BATCHED_CHUNKED_MAX = 1 << 20


def _free_key(digest: str, taken: list[str]) -> str:
    """The first unused key of ``digest``'s family: ``digest``, ``digest.1``, …"""
    used = set(taken)
    n = 0
    while (digest if n == 0 else f"{digest}.{n}") in used:
        n += 1
    return digest if n == 0 else f"{digest}.{n}"


def generation(conn: Connection) -> int:
    """The current gc generation (meta ``gc_generation``; 0 before any gc)."""
    rows = _GENERATION.execute(conn, {"key": "gc_generation"})
    return int(rows[0][0]) if rows else 0


def chunk_bytes(conn: Connection, cid: str, data, codec_: int, size: int, base: str | None) -> bytes:
    """The decoded bytes of chunk ``cid`` from its row's fields (a delta's
    base read too).  Raises :class:`CorruptObject` for undecodable data."""
    return cardrows.decode_chunk(lambda c: _chunk_row(conn, c), cid, data, codec_, size, base)


def _chunk_row(conn: Connection, cid: str) -> tuple | None:
    rows = _CHUNK_ROW.execute(conn, {"cid": cid})
    return tuple(rows[0]) if rows else None


def _fetch(conn: Connection):
    def fetch(sql: str, params: tuple = ()) -> list:
        return conn.exec_driver_sql(sql, params).fetchall()
    return fetch


def inline_bytes(conn: Connection, oid: str, data, codec_: int | None, size: int, base,
                 hasher: Hasher | None = None) -> bytes:
    """The decoded bytes of inline object ``oid`` from its row's fields (a
    delta's base object read too, found by its prefix ``base``, format 10;
    ``hasher`` tells apart objects sharing it).  Raises :class:`CorruptObject`."""
    return inline_and_base(conn, oid, data, codec_, size, base, hasher)[0]


def inline_and_base(conn: Connection, oid: str, data, codec_: int | None, size: int, base,
                    hasher: Hasher | None = None) -> tuple[bytes, str | None]:
    """:func:`inline_bytes` and the key of the delta's base (None: no delta)."""
    digest = oid.split(".", 1)[0]
    check = (lambda d: hasher(d) == digest) if hasher is not None else None
    return cardrows.inline_with_base(_fetch(conn), oid, data, codec_, size, base, check)


def _insert_chunks(conn: Connection, cids: list[str], pieces: list) -> None:
    """Insert new chunk rows of ``pieces`` (keys ``cids``), compressed in
    one call (``codec.compress_many``)."""
    rows = [{"cid": cid, "size": len(piece), "data": data, "codec": how, "base": None}
            for cid, piece, (how, data) in zip(cids, pieces, codec.compress_many(pieces))]
    _CHUNK_INSERT.executemany(conn, rows)


def _equal_streams(a: Iterator[bytes], b: Iterator[bytes]) -> bool:
    """Whether two streams of byte pieces, cut differently, hold the same bytes."""
    x = y = memoryview(b"")
    while True:
        if not x:
            x = memoryview(next(a, b""))
        if not y:
            y = memoryview(next(b, b""))
        if not x or not y:
            return not x and not y
        n = min(len(x), len(y))
        if bytes(x[:n]) != bytes(y[:n]):
            return False
        x, y = x[n:], y[n:]


class ObjectStore:
    """Puts and gets objects through a caller-supplied connection.

    New content is cut by :class:`chunking.ContentChunker` unless a
    ``chunk_size`` asks for fixed-size chunks (version-1 writers; tests).
    """

    def __init__(self, hasher: Hasher = xxh3_hex, chunk_size: int | None = None, chunker=None,
                 inline_max: int | None = None):
        self.hasher = hasher
        # A store cut by a chunker of its own (tests of chunking) inlines
        # nothing unless asked: its small contents are there to be chunked.
        if inline_max is None:
            inline_max = INLINE_MAX if chunk_size is None and chunker is None else -1
        self.inline_max = inline_max
        if chunker is None:
            chunker = chunking.FixedChunker(chunk_size) if chunk_size else chunking.ContentChunker()
        self.chunker = chunker

    # -- writing ------------------------------------------------------------

    def put_bytes(self, conn: Connection, data: bytes) -> str:
        """Store ``data``; returns its object id."""
        data = bytes(data)
        oid, _size = self._put_stream(conn, lambda offset, n: data[offset:offset + n],
                                      lambda: iter((data,)))
        return oid

    def put_many(self, conn: Connection, contents: list[bytes]) -> list[str]:
        """Store several contents; returns their object ids, in order.  The
        small (inline) ones take one lookup of their keys and one multi-row
        insert in all, instead of a lookup, a generation read and an insert
        each (a clone puts thousands); bigger ones up to
        :data:`BATCHED_CHUNKED_MAX` are chunked in one batch too
        (:meth:`_put_chunked_many`), the rest go through
        :meth:`put_bytes`.  A key found goes through :meth:`put_bytes`
        too (its family is compared byte for byte), and so does a content
        of the same key as another here but other bytes.  The lookup is of the exact keys only: a content whose
        ``digest`` key is gone but ``digest.N`` holds it is stored again
        under ``digest`` (a second copy; bytes are never merged)."""
        out: list[str | None] = [None] * len(contents)
        small: dict[str, tuple[int, bytes]] = {}
        chunked: dict[str, tuple[int, bytes]] = {}
        repeats: list[tuple[int, int]] = []  # (index, index of the first content of its key)
        for i, data in enumerate(contents):
            if len(data) > self.inline_max:
                if self.hasher is not xxh3_hex or len(data) > BATCHED_CHUNKED_MAX:
                    out[i] = self.put_bytes(conn, data)
                    continue
                family = chunked  # the key is the whole content's XXH3-128, as _put_stream's
            else:
                family = small
            digest = self.hasher(data)
            if digest in small or digest in chunked:
                first = small[digest][0] if digest in small else chunked[digest][0]
                repeats.append((i, first))  # put below, once the first is in
                continue
            family[digest] = (i, data)
        gen = None
        for family in (small, chunked):
            keys = list(family)
            for j in range(0, len(keys), _BATCH):
                for (oid,) in _OBJECTS_BY_KEY.execute(conn, {"oids": keys[j:j + _BATCH]}):
                    i, data = family.pop(oid)
                    out[i] = self.put_bytes(conn, data)
        if chunked:
            gen = generation(conn)
            self._put_chunked_many(conn, chunked, gen, out)
        if small:
            gen = generation(conn) if gen is None else gen
            rows = []
            encoded = codec.compress_many([data for _i, data in small.values()])
            for (digest, (i, data)), (how, packed) in zip(small.items(), encoded):
                rows.append({"oid": digest, "size": len(data), "gen": gen, "data": bytes(packed), "codec": how,
                             "base": None})
                out[i] = digest
            _OBJECT_INSERT_INLINE.executemany(conn, rows)
        for i, first in repeats:
            same = contents[i] == contents[first]  # else a collision: its own key, from put_bytes
            out[i] = out[first] if same else self.put_bytes(conn, contents[i])
        return out  # type: ignore[return-value]

    def _put_chunked_many(self, conn: Connection, contents: dict[str, tuple[int, bytes]], gen: int,
                          out: list) -> None:
        """:meth:`put_many`'s contents too big to be inline, none of whose
        keys is stored: cut as :meth:`_put_stream` cuts them, their chunks
        put in runs of :data:`_BATCH` (:meth:`_put_chunks`), their object and
        chunk-list rows in one insert each, instead of five statements per
        content (a mount's row write stores every small file closed since
        the last one).  ``out[i]`` gets content ``i``'s object id."""
        cut: list[tuple[str, int, int]] = []  # (key, index in out, number of chunks)
        pieces: list[memoryview] = []
        for digest, (i, data) in contents.items():
            mine = [p for window in chunking.windows(lambda offset, n, d=data: d[offset:offset + n], self.chunker)
                    for p in window]
            cut.append((digest, i, len(mine)))
            pieces += mine
        cids: list[tuple[str, int]] = []
        for j in range(0, len(pieces), _BATCH):
            cids += self._put_chunks(conn, pieces[j:j + _BATCH])
        objects, lists, at = [], [], 0
        for digest, i, n in cut:
            pos = 0
            for seq, (cid, length) in enumerate(cids[at:at + n]):
                lists.append({"oid": digest, "seq": seq, "offset": pos, "cid": cid})
                pos += length
            at += n
            objects.append({"oid": digest, "size": pos, "gen": gen})
            out[i] = digest
        _OBJECT_INSERT.executemany(conn, objects)
        _OBJECT_CHUNKS_INSERT.executemany(conn, lists)

    def put_fd(self, conn: Connection, fd: int) -> tuple[str, int]:
        """Store the whole content of the open file ``fd`` (read with pread).

        Returns ``(oid, size)``; the size is what was read, so a file cut
        short meanwhile gives a consistent (shorter) object.  The file must
        not change meanwhile; the caller holds whatever lock guarantees that.
        """
        def reread() -> Iterator[bytes]:
            offset = 0
            while piece := os.pread(fd, 1 << 20, offset):
                offset += len(piece)
                yield piece

        return self._put_stream(conn, lambda offset, n: os.pread(fd, n, offset), reread)

    def _put_stream(self, conn: Connection, read, reread) -> tuple[str, int]:
        """Chunk, dedupe and store the content ``read(offset, n)`` returns;
        ``reread()`` streams the same bytes again (only needed when an object
        of the same hash and size but another chunk list exists)."""
        if self.inline_max >= 0:
            head = bytes(read(0, self.inline_max + 1))
            if len(head) <= self.inline_max:
                return self._put_inline(conn, head), len(head)
        streaming = self.hasher is xxh3_hex
        whole = xxhash.xxh3_128() if streaming else None
        pieces: list[bytes] = []
        cids: list[tuple[str, int]] = []
        for window in chunking.windows(read, self.chunker):
            for piece in window:
                if whole is not None:
                    whole.update(piece)
                else:
                    pieces.append(bytes(piece))
            for i in range(0, len(window), _BATCH):
                cids += self._put_chunks(conn, window[i:i + _BATCH])
        whole_hash = whole.hexdigest() if whole is not None else self.hasher(b"".join(pieces))
        size = sum(length for _, length in cids)
        return self._put_object(conn, whole_hash, cids, size, reread), size

    def _put_chunks(self, conn: Connection, batch: list[memoryview]) -> list[tuple[str, int]]:
        """Put a run of chunks with one lookup and one insert for the common
        cases: bytes never seen (their key is free: keys are taken in family
        order, and gc never deletes a plain key while a suffixed one lives) and bytes stored already (compared
        byte for byte).  A key that names other bytes -- a collision, with a
        stored chunk or within the run -- takes the per-chunk path."""
        digests = [self.hasher(piece) if self.hasher is xxh3_hex else self.hasher(bytes(piece)) for piece in batch]
        stored = {cid: chunk_bytes(conn, cid, data, how, size, base) for cid, data, how, size, base
                  in _CHUNKS_BY_KEY.execute(conn, {"cids": sorted(set(digests))})}
        fresh: dict[str, memoryview] = {}
        new: list[str] = []  # keys of fresh pieces not inserted yet
        out: list[tuple[str, int]] = []
        for piece, digest in zip(batch, digests):
            have = stored.get(digest)
            # Compared as bytes: comparing a memoryview goes item by item.
            if have is not None and len(have) == len(piece) and bytes(have) == bytes(piece):
                cid = digest
            elif have is None and digest not in fresh:
                fresh[digest] = piece
                new.append(digest)
                cid = digest
            elif have is None and bytes(fresh[digest]) == bytes(piece):
                cid = digest
            else:
                if new:  # the family query must see this run's new rows
                    _insert_chunks(conn, new, [fresh[k] for k in new])
                    new = []
                cid = self._put_chunk(conn, bytes(piece))
            out.append((cid, len(piece)))
        if new:
            _insert_chunks(conn, new, [fresh[k] for k in new])
        return out

    def _put_chunk(self, conn: Connection, data: bytes) -> str:
        digest = self.hasher(data)
        # One query for the key and all its collision suffixes (a flood of
        # crafted colliding chunks must not turn every put into a linear
        # probe); only same-size candidates' bytes are fetched and compared.
        family = conn.execute(_CHUNK_FAMILY, {"size": len(data), **_family_params(digest)}).all()
        for cid, stored, how, size, base in family:
            if stored is not None and chunk_bytes(conn, cid, stored, how, size, base) == data:
                return cid
        # New bytes, or a real collision: take the first free suffix.
        cid = _free_key(digest, [row[0] for row in family])
        _insert_chunks(conn, [cid], [data])
        return cid

    def _put_object(self, conn: Connection, digest: str, cids: list[tuple[str, int]], size: int,
                    reread=None) -> str:
        taken = _OBJECT_FAMILY.execute(conn, _family_params(digest))
        same_size = [oid for oid, osize in taken if osize == size]
        if same_size:
            # Chunks being verified byte for byte, equal chunk lists mean equal bytes.
            lists: dict[str, list[str]] = {oid: [] for oid in same_size}
            for oid, cid in _OBJECT_CHUNK_LISTS.execute(conn, {"oids": same_size}):
                lists[oid].append(cid)
            wanted = [cid for cid, _ in cids]
            for oid in same_size:
                if lists[oid] == wanted:
                    return self._touch(conn, oid)
            # The same hash and size cut otherwise (stored by a fixed-size
            # writer) or a collision: only the bytes tell.
            if reread is not None:
                for oid in same_size:
                    if _equal_streams(self.iter_chunks(conn, oid), reread()):
                        return self._touch(conn, oid)
        oid = _free_key(digest, [oid for oid, _ in taken])
        _OBJECT_INSERT.executemany(conn, [{"oid": oid, "size": size, "gen": generation(conn)}])
        rows, pos = [], 0
        for seq, (cid, length) in enumerate(cids):
            rows.append({"oid": oid, "seq": seq, "offset": pos, "cid": cid})
            pos += length
        _OBJECT_CHUNKS_INSERT.executemany(conn, rows)
        return oid

    def _put_inline(self, conn: Connection, data: bytes) -> str:
        """Store small content in its object row (or find it stored, inline
        or, put before format 7, as chunks: compared byte for byte)."""
        digest = self.hasher(data)
        taken = _OBJECT_FAMILY_INLINE.execute(conn, _family_params(digest))
        for oid, size, stored, how, base in taken:
            if size != len(data):
                continue
            if stored is not None:
                try:
                    same = inline_bytes(conn, oid, stored, how, size, base, self.hasher) == data
                except CorruptObject:
                    same = False  # damaged: never a match (verify reports it)
            else:
                same = _equal_streams(self.iter_chunks(conn, oid), iter((data,)))
            if same:
                return self._touch(conn, oid)
        oid = _free_key(digest, [row[0] for row in taken])
        how, encoded = codec.compress(data)
        _OBJECT_INSERT_INLINE.executemany(conn, [{"oid": oid, "size": len(data), "gen": generation(conn),
                                                  "data": bytes(encoded), "codec": how, "base": None}])
        return oid

    def _inline(self, conn: Connection, oid: str, verify: bool = True) -> tuple[bool, bytes | None]:
        """``(object exists, its bytes if stored inline)``; raises
        :class:`CorruptObject` for inline bytes that do not decode or (with
        ``verify``) do not hash to the key."""
        rows = _OBJECT_INLINE.execute(conn, {"oid": oid})
        if not rows:
            return False, None
        stored, how, size, base = rows[0]
        if stored is None:
            return True, None
        data = inline_bytes(conn, oid, stored, how, size, base, self.hasher)
        if len(data) != size or (verify and self.hasher(data) != oid.split(".", 1)[0]):
            raise CorruptObject(f"object {oid} is corrupt; run 'stepfs verify' for a full report.")
        return True, data

    @staticmethod
    def _touch(conn: Connection, oid: str) -> str:
        """An existing object put again: it belongs to the current gc
        generation from now on, so a gc that started before cannot collect
        it while the caller still holds only its id (``store/gc.py``)."""
        _OBJECT_TOUCH.execute(conn, {"b_oid": oid, "b_gen": generation(conn)})
        return oid

    # -- reading ------------------------------------------------------------

    @staticmethod
    def exists(conn: Connection, oid: str) -> bool:
        return bool(_OBJECT_SIZE.execute(conn, {"oid": oid}))

    @staticmethod
    def size(conn: Connection, oid: str) -> int:
        """Raises ``NoResultFound`` for an unknown object (as ``scalar_one``)."""
        rows = _OBJECT_SIZE.execute(conn, {"oid": oid})
        if len(rows) != 1:
            raise NoResultFound(f"no object {oid}")
        return rows[0][0]

    @staticmethod
    def chunk_ids(conn: Connection, oid: str) -> list[str]:
        rows = conn.execute(
            select(schema.object_chunks.c.cid)
            .where(schema.object_chunks.c.oid == oid)
            .order_by(schema.object_chunks.c.seq)
        )
        return [r.cid for r in rows]

    def iter_chunks(self, conn: Connection, oid: str, verify: bool = True) -> Iterator[bytes]:
        """Yield the object's bytes chunk by chunk; with ``verify`` each chunk
        is re-hashed and :class:`CorruptObject` raised on a mismatch, so
        corrupt bytes are never served.  A missing chunk row or a gap in the
        offsets raises too (even without ``verify``): a short read would
        otherwise pass for the file's content."""
        _exists, inline = self._inline(conn, oid, verify)
        if inline is not None:
            if inline:
                yield inline
            return
        yield from cardrows.object_chunks(_OBJECT_READ.iterate(conn, {"oid": oid}), oid,
                                          lambda c: _chunk_row(conn, c), self.hasher, verify)

    def read_range(self, conn: Connection, oid: str, offset: int, size: int) -> bytes:
        """Up to ``size`` bytes of the object from ``offset``; only the chunks
        that overlap the range are read, each verified like :meth:`iter_chunks`."""
        if size <= 0:
            return b""
        end = offset + size
        exists, inline = self._inline(conn, oid)
        if not exists:
            raise CorruptObject(f"object {oid} is missing; run 'stepfs verify' for a full report.")
        if inline is not None:
            return inline[offset:end]
        oc, ch = schema.object_chunks, schema.chunks
        rows = conn.execute(
            select(oc.c.offset, ch.c.cid, ch.c.data, ch.c.codec, ch.c.size, ch.c.base)
            .join(ch, ch.c.cid == oc.c.cid)
            .where(oc.c.oid == oid, oc.c.offset < end, oc.c.offset + ch.c.size > offset)
            .order_by(oc.c.seq)
        )
        out = []
        for row in rows.all():
            data = chunk_bytes(conn, row.cid, row.data, row.codec, row.size, row.base)
            if self.hasher(data) != row.cid.split(".", 1)[0]:
                raise CorruptObject(f"chunk {row.cid} of object {oid} is corrupt; run 'stepfs verify' for a full report.")
            lo = max(offset - row.offset, 0)
            out.append(data[lo:end - row.offset])
        return b"".join(out)

    def read_all(self, conn: Connection, oid: str) -> bytes:
        return b"".join(self.iter_chunks(conn, oid))

    def holds(self, conn: Connection, oid: str, fd: int) -> bool:
        """Whether the open file ``fd`` holds exactly the content of object
        ``oid``: its size first, then byte for byte against the stored
        chunks (each verified, :class:`CorruptObject` on damage), never by
        hash alone (crafted input can collide).  Reads the file with
        ``pread``; the caller keeps it from changing meanwhile or accepts
        the race."""
        if os.fstat(fd).st_size != self.size(conn, oid):
            return False

        def stream() -> Iterator[bytes]:
            offset = 0
            while piece := os.pread(fd, 1 << 20, offset):
                offset += len(piece)
                yield piece

        return _equal_streams(self.iter_chunks(conn, oid), stream())

    def write_to_fd(self, conn: Connection, oid: str, fd: int) -> int:
        """Write the object into the empty file ``fd``, leaving holes where it
        has zeros: all-zero chunks, and the zero runs a chunk starts or ends
        with (whole blocks of them), so a sparse file stays sparse however
        its chunks were cut.  Returns the size."""
        pos = 0
        for data in self.iter_chunks(conn, oid):
            n = len(data)
            if not n:
                continue
            # Most chunks neither start nor end with a zero: no strip (a copy) then.
            lead = 0 if data[0] else n - len(data.lstrip(b"\0"))
            if lead < n:
                trail = 0 if data[-1] else n - len(data.rstrip(b"\0"))
                start = max(pos, (pos + lead) // _BLOCK * _BLOCK)
                end = min(pos + n, -(-(pos + n - trail) // _BLOCK) * _BLOCK)
                view = memoryview(data)[start - pos:end - pos]
                done = 0
                while done < len(view):
                    done += durable.pwrite(fd, view[done:], start + done)
            pos += n
        os.ftruncate(fd, pos)
        return pos

    def verify(self, conn: Connection, oid: str) -> list[str]:
        """Problems with one object (empty list: intact): every chunk
        re-hashed, the chunk sizes summed, and the whole content re-hashed
        against the object id (which catches chunks listed in the wrong
        order or a wrong chunk listed, each chunk being intact)."""
        problems = []
        total = 0
        streaming = self.hasher is xxh3_hex
        whole = xxhash.xxh3_128() if streaming else None
        pieces: list[bytes] = []
        try:
            for data in self.iter_chunks(conn, oid):
                total += len(data)
                if whole is not None:
                    whole.update(data)
                else:
                    pieces.append(data)
        except CorruptObject as exc:
            return [str(exc)]
        if total != self.size(conn, oid):
            problems.append(f"object {oid} has {total} bytes in its chunks, {self.size(conn, oid)} recorded.")
        digest = whole.hexdigest() if whole is not None else self.hasher(b"".join(pieces))
        if digest != oid.split(".", 1)[0]:
            problems.append(f"object {oid} does not hash to its id: its chunk list is damaged.")
        return problems
