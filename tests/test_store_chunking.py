"""Content-defined chunking: stable cuts, dedupe of edited content, objects
cut either way read back.

Kernel-free tier: no FUSE, no mounts.
"""

from __future__ import annotations

import os
import random

import pytest
from sqlalchemy import func, select

from store_kit import object_to_file
from stepfs.store import chunking, schema
from stepfs.store.db import Database
from stepfs.store.objects import ObjectStore, xxh3_hex

MiB = 1 << 20


def text(size: int, seed: int) -> bytes:
    """Source-like text: 100-byte lines of words (compressible, repetitive)."""
    rng = random.Random(seed)
    words = [b"def", b"return", b"self", b"value", b"import", b"for", b"in", b"if", b"x", b"name", b"data"]
    lines = []
    total = 0
    while total < size:
        line = b" ".join(rng.choice(words) for _ in range(20))[:99].ljust(99) + b"\n"
        lines.append(line)
        total += len(line)
    return b"".join(lines)[:size]


def pieces(data: bytes, chunker=None) -> list[bytes]:
    chunker = chunker or chunking.ContentChunker()
    out, pos = [], 0
    for n in chunker.cut(data):
        out.append(data[pos:pos + n])
        pos += n
    return out


def windowed(data: bytes, chunker) -> list[bytes]:
    read = lambda offset, n: data[offset:offset + n]  # noqa: E731
    return [bytes(p) for window in chunking.windows(read, chunker) for p in window]


def count(conn, table) -> int:
    return conn.execute(select(func.count()).select_from(table)).scalar_one()


def chunk_bytes(conn) -> int:
    return conn.execute(select(func.coalesce(func.sum(schema.chunks.c.size), 0))).scalar_one()


@pytest.fixture
def db(tmp_path):
    d = Database.open(str(tmp_path / "store.db"))
    yield d
    d.close()


def test_an_insertion_changes_only_the_chunks_around_it():
    original = random.Random(3).randbytes(10 * MiB)
    cut = 5 * MiB + 12345
    edited = original[:cut] + b"a few inserted bytes" + original[cut:]
    before, after = pieces(original), pieces(edited)
    assert b"".join(after) == edited
    new = [p for p in after if p not in set(before)]
    # Everything but the chunk(s) around the insertion is shared.
    assert 1 <= len(new) <= 2, [len(p) for p in new]
    assert sum(map(len, new)) <= 2 * chunking.MAX_SIZE
    assert len(after) - len(new) >= len(before) - 2


def test_cuts_respect_the_size_bounds_and_cover_the_content():
    data = random.Random(5).randbytes(4 * MiB + 77)
    lengths = chunking.ContentChunker().cut(data)
    assert sum(lengths) == len(data)
    assert all(n <= chunking.MAX_SIZE for n in lengths)
    assert all(n >= chunking.MIN_SIZE for n in lengths[:-1])
    # Content-defined, not fixed: the cuts are not all maximal.
    assert len(set(lengths)) > 10


def test_cuts_are_deterministic_and_independent_of_the_window():
    data = random.Random(11).randbytes(3 * MiB + 5) + bytes(MiB) + text(MiB, 2)
    whole = pieces(data)
    assert pieces(data) == whole
    for window in (chunking.MAX_SIZE + 1, 300_000, MiB, 8 * MiB):
        chunker = chunking.ContentChunker(window=window)
        assert windowed(data, chunker) == whole, window


def test_a_window_must_exceed_the_largest_chunk():
    with pytest.raises(ValueError):
        chunking.ContentChunker(window=chunking.MAX_SIZE)


def test_the_pure_python_chunker_cuts_the_same_way():
    """The fallback for machines without pyfastcdc's compiled wheel gives
    the same chunks, so dedupe works across machines sharing a store."""
    from pyfastcdc.py import FastCDC as Slow

    data = random.Random(17).randbytes(200_000)
    fast = chunking.ContentChunker(1024, 4096, 16384).cut(data)
    slow = [c.length for c in Slow(4096, min_size=1024, max_size=16384).cut_buf(data)]
    assert fast == slow


def test_edited_text_file_stores_little_new(db):
    """The growth target at the store level: a one-line insertion into a
    10 MB text file adds well under 1 MB of chunk bytes."""
    objects = ObjectStore()
    original = text(10_000_000, 1)
    line = 30_000
    edited = original[:line * 100 + 9] + b"inserted words " + original[line * 100 + 9:]
    with db.write() as conn:
        first = objects.put_bytes(conn, original)
        stored = chunk_bytes(conn)
        second = objects.put_bytes(conn, edited)
        added = chunk_bytes(conn) - stored
        assert objects.read_all(conn, first) == original
        assert objects.read_all(conn, second) == edited
        assert objects.verify(conn, second) == []
    assert 0 < added < 2 * chunking.MAX_SIZE


def test_put_fd_over_several_windows_matches_put_bytes(db, tmp_path):
    chunker = chunking.ContentChunker(window=chunking.MAX_SIZE + 4096)
    objects = ObjectStore(chunker=chunker)
    data = random.Random(23).randbytes(2 * MiB) + text(MiB, 3)
    src = tmp_path / "src"
    src.write_bytes(data)
    fd = os.open(src, os.O_RDONLY)
    try:
        with db.write() as conn:
            oid, size = objects.put_fd(conn, fd)
            assert objects.put_bytes(conn, data) == oid
            ids = objects.chunk_ids(conn, oid)
    finally:
        os.close(fd)
    assert size == len(data)
    assert ids == [xxh3_hex(p) for p in pieces(data)]
    with db.read() as conn:
        assert objects.read_all(conn, oid) == data
        assert objects.read_range(conn, oid, MiB - 10, 100_000) == data[MiB - 10:MiB - 10 + 100_000]


def test_objects_stored_with_fixed_chunks_read_verify_and_dedupe(db, tmp_path):
    """Stores written before content-defined chunking keep working: their
    objects read and verify, and the same content put again is recognised
    by its bytes (no second object), though it is cut otherwise now."""
    old, new = ObjectStore(chunk_size=MiB), ObjectStore()
    data = random.Random(29).randbytes(3 * MiB + 1000)
    with db.write() as conn:
        oid = old.put_bytes(conn, data)
        assert len(old.chunk_ids(conn, oid)) == 4
    with db.read() as conn:
        assert new.read_all(conn, oid) == data
        assert new.verify(conn, oid) == []
        assert new.read_range(conn, oid, MiB - 5, 10) == data[MiB - 5:MiB + 5]
    with db.write() as conn:
        assert new.put_bytes(conn, data) == oid
        assert count(conn, schema.objects) == 1
    out = tmp_path / "out"
    fd = os.open(out, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with db.read() as conn:
            assert new.write_to_fd(conn, oid, fd) == len(data)
    finally:
        os.close(fd)
    assert out.read_bytes() == data


def test_same_hash_and_size_but_other_bytes_is_a_new_object():
    """An object of the same (weak) hash and size, cut otherwise, is only
    reused when its bytes are equal."""
    db = Database.memory()
    old = ObjectStore(hasher=lambda data: "k", chunk_size=4)
    new = ObjectStore(hasher=lambda data: "k", chunker=chunking.FixedChunker(3))
    with db.write() as conn:
        a = old.put_bytes(conn, b"abcdefgh")
        b = new.put_bytes(conn, b"abcdefgX")
        c = new.put_bytes(conn, b"abcdefgh")
        assert (a, b, c) == ("k", "k.1", "k")
        assert new.read_all(conn, b) == b"abcdefgX"
    db.close()


def test_collisions_inside_one_run_of_chunks_never_merge_different_bytes():
    """Many small content-defined chunks per window and an 8-bit hash: keys
    collide within one batched lookup and insert all the time."""
    db = Database.memory()
    weak = lambda data: xxh3_hex(data)[:2]  # noqa: E731
    objects = ObjectStore(hasher=weak, chunker=chunking.ContentChunker(64, 256, 1024, window=64 * 1024))
    rng = random.Random(31)
    blobs = [rng.randbytes(rng.randrange(0, 40_000)) for _ in range(40)]
    blobs += [blobs[3], blobs[7], blobs[3][:20_000] + b"edit" + blobs[3][20_000:]]
    with db.write() as conn:
        oids = [objects.put_bytes(conn, b) for b in blobs]
    oid_of: dict[bytes, str] = {}
    for blob, oid in zip(blobs, oids):
        assert oid_of.setdefault(blob, oid) == oid, "identical bytes got two ids"
    assert len(set(oid_of.values())) == len(oid_of), "different bytes share an id"
    with db.read() as conn:
        stored = [bytes(d) for (d,) in conn.execute(select(schema.chunks.c.data))]
        assert len(stored) == len(set(stored)), "identical chunk bytes stored twice"
        assert sum("." in cid for cid in conn.execute(select(schema.chunks.c.cid)).scalars()) > 10
        for blob, oid in oid_of.items():
            assert objects.read_all(conn, oid) == blob
            assert objects.verify(conn, oid) == []
    db.close()


def test_zero_runs_inside_a_chunk_stay_holes(db, tmp_path):
    """A content-defined chunk can straddle the end of data and the start
    of a zero run; the zeros it ends with are still written as a hole."""
    data = random.Random(37).randbytes(100_000) + bytes(3 * MiB)
    objects = ObjectStore()
    with db.write() as conn:
        oid = objects.put_bytes(conn, data)
    out = tmp_path / "out"
    st = object_to_file(db, objects, oid, out)
    assert out.read_bytes() == data
    assert st.st_blocks * 512 <= 100_000 + 64 * 1024


def test_without_the_compiled_chunker_the_pure_python_one_is_used_and_logged_once(monkeypatch, caplog):
    import sys

    from pyfastcdc.py import FastCDC as Slow

    monkeypatch.setitem(sys.modules, "pyfastcdc.cy", None)  # as on a machine with no wheel
    chunking._load_fastcdc.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="stepfs.store"):
            data = random.Random(41).randbytes(50_000)
            lengths = chunking.ContentChunker(1024, 4096, 16384).cut(data)
            chunking.ContentChunker(1024, 4096, 16384).cut(data)
        assert chunking._load_fastcdc() is Slow
        assert sum(lengths) == len(data) and len(lengths) > 3
        logged = [r.getMessage() for r in caplog.records if r.name == "stepfs.store"]
        assert len(logged) == 1 and "pure-Python" in logged[0]
    finally:
        chunking._load_fastcdc.cache_clear()
