"""Object store: round trips, dedupe, sparse output, forced collisions, corruption.

Kernel-free tier: no FUSE, no mounts.  Corruption is made with the plain
``sqlite3`` module, as a damaged disk or a foreign writer would leave it.
"""

from __future__ import annotations

import os
import random
import sqlite3

import pytest
from sqlalchemy import event, func, select

from store_kit import object_to_file
from stepfs.store import chunking, schema
from stepfs.store.db import Database
from stepfs.store.errors import CorruptObject
from stepfs.store import keys
from stepfs.store.objects import ObjectStore, xxh3_hex

MiB = 1 << 20


def weak_hasher(data: bytes) -> str:
    """8 bits of XXH3: every 256 distinct blobs share a key on average."""
    return xxh3_hex(data)[:2]


def count(conn, table) -> int:
    return conn.execute(select(func.count()).select_from(table)).scalar_one()


@pytest.fixture
def db(tmp_path):
    d = Database.open(str(tmp_path / "store.db"))
    yield d
    d.close()


def sparse_blob() -> bytes:
    """Three default-size chunks: zeros, data, zeros (plus a short zero tail)."""
    middle = bytes(random.Random(7).randbytes(MiB))
    return bytes(MiB) + middle + bytes(MiB) + bytes(100)


CONTENTS = {
    "empty": b"",
    "small": b"hello, world\n",
    "one-chunk-exact": bytes(range(256)) * (MiB // 256),
    "multi-chunk": random.Random(1).randbytes(2 * MiB + 12345),
    "sparse": sparse_blob(),
}


@pytest.mark.parametrize("name", sorted(CONTENTS))
def test_round_trip_put_bytes_and_put_fd(db, tmp_path, name):
    data = CONTENTS[name]
    objects = ObjectStore()
    src = tmp_path / "src"
    src.write_bytes(data)
    with db.write() as conn:
        oid = objects.put_bytes(conn, data)
        fd = os.open(src, os.O_RDONLY)
        try:
            oid_fd, size = objects.put_fd(conn, fd)
        finally:
            os.close(fd)
    # Streaming and one-shot hashing name the same content the same way.
    assert (oid_fd, size) == (oid, len(data))
    with db.read() as conn:
        assert objects.read_all(conn, oid) == data
        assert objects.size(conn, oid) == len(data)
        assert objects.verify(conn, oid) == []
        out = tmp_path / "out"
        fd = os.open(out, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            assert objects.write_to_fd(conn, oid, fd) == len(data)
        finally:
            os.close(fd)
    assert out.read_bytes() == data


def test_write_to_fd_leaves_zero_chunks_as_holes(db, tmp_path):
    data = sparse_blob()
    objects = ObjectStore()
    with db.write() as conn:
        oid = objects.put_bytes(conn, data)
    out = tmp_path / "out"
    st = object_to_file(db, objects, oid, out)
    assert st.st_size == len(data)
    # Only the data chunk is allocated (allow a few blocks of metadata slack).
    assert st.st_blocks * 512 <= MiB + 64 * 1024
    assert out.read_bytes() == data


def test_all_zero_object_is_written_as_one_hole(db, tmp_path):
    objects = ObjectStore()
    with db.write() as conn:
        oid = objects.put_bytes(conn, bytes(5 * MiB))
        # Zeros have no content-defined cut: maximal chunks, all equal, one chunk row.
        assert count(conn, schema.chunks) == 1
        assert objects.chunk_ids(conn, oid) == [objects.chunk_ids(conn, oid)[0]] * (5 * MiB // chunking.MAX_SIZE)
    fd = os.open(tmp_path / "out", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with db.read() as conn:
            assert objects.write_to_fd(conn, oid, fd) == 5 * MiB
        st = os.fstat(fd)
    finally:
        os.close(fd)
    assert (st.st_size, st.st_blocks) == (5 * MiB, 0)


def test_identical_content_is_stored_once(db):
    objects = ObjectStore(chunk_size=4)
    with db.write() as conn:
        first = objects.put_bytes(conn, b"abcdabcdXY")
        chunks, objs = count(conn, schema.chunks), count(conn, schema.objects)
        assert (chunks, objs) == (2, 1)  # "abcd" twice is one chunk
        assert objects.put_bytes(conn, b"abcdabcdXY") == first
        # A different object sharing chunks adds only its own new chunk.
        other = objects.put_bytes(conn, b"abcdXYZ")
        assert other != first
        assert count(conn, schema.objects) == 2
        assert count(conn, schema.chunks) == 3
        assert objects.read_all(conn, other) == b"abcdXYZ"


def test_forced_collisions_never_merge_different_bytes():
    """With an 8-bit hash, 10,000 random blobs collide all the time; every
    one must come back byte-exact and different bytes never share an id."""
    db = Database.memory()
    objects = ObjectStore(hasher=weak_hasher, chunk_size=16)
    rng = random.Random(20240601)
    blobs = [rng.randbytes(rng.randrange(0, 48)) for _ in range(9000)]
    blobs += [rng.choice(blobs) for _ in range(1000)]  # exact repeats must dedupe
    rng.shuffle(blobs)
    with db.write() as conn:
        oids = [objects.put_bytes(conn, b) for b in blobs]
    oid_of: dict[bytes, str] = {}
    for blob, oid in zip(blobs, oids):
        assert oid_of.setdefault(blob, oid) == oid, "identical bytes got two ids"
    assert len(set(oid_of.values())) == len(oid_of), "different bytes share an id"
    distinct_chunks = {b[i : i + 16] for b in oid_of for i in range(0, len(b), 16)}
    with db.read() as conn:
        assert count(conn, schema.objects) == len(oid_of)
        assert count(conn, schema.chunks) == len(distinct_chunks)
        # Collisions really happened (suffixed keys exist).
        assert sum("." in cid for cid in conn.execute(select(schema.chunks.c.cid)).scalars()) > 1000
        for blob, oid in oid_of.items():
            assert objects.read_all(conn, oid) == blob
    db.close()


def test_a_colliding_put_costs_a_few_statements_not_a_probe_per_collision():
    db = Database.memory()
    objects = ObjectStore(hasher=lambda data: "k", chunk_size=64)  # everything collides
    with db.write() as conn:
        for i in range(50):
            objects.put_bytes(conn, b"blob %d" % i)
    statements: list[str] = []
    event.listen(db.engine, "before_cursor_execute", lambda *a: statements.append(a[2]))
    with db.write() as conn:
        oid = objects.put_bytes(conn, b"one more colliding blob")
        assert objects.read_all(conn, oid) == b"one more colliding blob"
        assert oid == "k.50"
    # BEGIN and PRAGMA of the transaction, 2 chunk + 3 object statements, the read.
    assert len(statements) <= 10, statements


def test_put_fd_records_the_bytes_it_read_when_the_file_shrinks(db, tmp_path):
    path = tmp_path / "shrinking"
    path.write_bytes(b"0123456789ab")
    fd = os.open(path, os.O_RDONLY)
    calls = []

    def hasher(data: bytes) -> str:
        # Called once per chunk while put_fd streams: cut the file short
        # after the first chunk, as a concurrent writer would.
        if not calls:
            os.truncate(path, 6)
        calls.append(data)
        return xxh3_hex(data)

    objects = ObjectStore(hasher=hasher, chunk_size=4)
    try:
        with db.write() as conn:
            oid, size = objects.put_fd(conn, fd)
            assert size == 6
            assert objects.size(conn, oid) == 6
            assert objects.verify(conn, oid) == []
            assert objects.read_all(conn, oid) == b"012345"
    finally:
        os.close(fd)


def _corrupt(path, sql: str, *args) -> None:
    # Keys are stored as bytes (format 7, store/keys.py).
    args = tuple(keys.to_db(a) if isinstance(a, str) else a for a in args)
    raw = sqlite3.connect(path)
    try:
        raw.execute(sql, args)
        raw.commit()
    finally:
        raw.close()


def test_flipped_byte_is_detected(tmp_path):
    path = str(tmp_path / "store.db")
    db = Database.open(path)
    objects = ObjectStore(chunk_size=8)
    data = b"first8bysecond8bthird"
    with db.write() as conn:
        oid = objects.put_bytes(conn, data)
        victim = objects.chunk_ids(conn, oid)[1]
        stored = conn.execute(select(schema.chunks.c.data).where(schema.chunks.c.cid == victim)).scalar_one()
    flipped = bytearray(stored)
    flipped[3] ^= 0x01
    _corrupt(path, "UPDATE chunks SET data = ? WHERE cid = ?", bytes(flipped), victim)
    with db.read() as conn:
        problems = objects.verify(conn, oid)
        assert len(problems) == 1 and victim in problems[0]
        chunks = objects.iter_chunks(conn, oid)
        assert next(chunks) == data[:8]  # the intact first chunk is served
        with pytest.raises(CorruptObject):
            next(chunks)
        with pytest.raises(CorruptObject):
            objects.read_all(conn, oid)
    db.close()


def test_missing_chunk_is_detected_not_served_short(tmp_path):
    path = str(tmp_path / "store.db")
    db = Database.open(path)
    objects = ObjectStore(chunk_size=4)
    with db.write() as conn:
        oid = objects.put_bytes(conn, b"aaaabbbbcccc")
        victim = objects.chunk_ids(conn, oid)[1]
    # Plain sqlite3 has foreign keys off: the damage a foreign writer can do.
    _corrupt(path, "DELETE FROM chunks WHERE cid = ?", victim)
    with db.read() as conn:
        with pytest.raises(CorruptObject):
            objects.read_all(conn, oid)
        with pytest.raises(CorruptObject):
            list(objects.iter_chunks(conn, oid, verify=False))
        assert objects.verify(conn, oid) != []
    db.close()


def test_verify_rehashes_the_whole_object(tmp_path):
    """Intact chunks listed in the wrong order read back as the wrong bytes;
    only the object hash tells."""
    path = str(tmp_path / "store.db")
    db = Database.open(path)
    objects = ObjectStore(chunk_size=4)
    with db.write() as conn:
        oid = objects.put_bytes(conn, b"aaaabbbbcccc")
        first, second, _ = objects.chunk_ids(conn, oid)
        assert objects.verify(conn, oid) == []
    _corrupt(path, "UPDATE object_chunks SET cid = ? WHERE oid = ? AND seq = 0", second, oid)
    _corrupt(path, "UPDATE object_chunks SET cid = ? WHERE oid = ? AND seq = 1", first, oid)
    with db.read() as conn:
        problems = objects.verify(conn, oid)
        assert len(problems) == 1 and "does not hash to its id" in problems[0]
    db.close()


def test_verify_with_a_custom_hasher():
    db = Database.memory()
    objects = ObjectStore(hasher=weak_hasher, chunk_size=4)
    with db.write() as conn:
        oids = [objects.put_bytes(conn, b"blob %d" % i) for i in range(100)]
        assert any("." in oid for oid in oids)  # the suffixed ids are verified too
        assert all(objects.verify(conn, oid) == [] for oid in oids)
    db.close()


def test_put_many_stores_each_content_once_and_never_merges_colliding_bytes(db):
    """``put_many`` (a clone's batch): the same ids ``put_bytes`` would
    give, a repeated content stored once, colliding keys kept apart (a
    weak hasher forces them), a key already stored compared byte for byte,
    a content too big to be inline chunked as ``put_bytes`` does."""
    objects = ObjectStore(hasher=weak_hasher)
    blobs = [b"blob %d\n" % i for i in range(600)]  # ~2 per key of 256
    big = random.Random(3).randbytes(3 * MiB)
    with db.write() as conn:
        before = objects.put_bytes(conn, blobs[5])
        batch = [*blobs, blobs[7], big, blobs[5], b""]
        oids = objects.put_many(conn, batch)
        assert [objects.read_all(conn, oid) for oid in oids] == batch
        assert oids[5] == oids[-2] == before and oids[7] == oids[600]
        assert len(set(oids)) == len(set(batch))
        assert count(conn, schema.objects) == len(set(batch))
        assert oids == [objects.put_bytes(conn, b) for b in batch]  # put again: found, not stored anew
        assert count(conn, schema.objects) == len(set(batch))


def test_put_many_chunks_small_contents_in_one_batch_as_put_bytes_would(db):
    """The contents too big to be inline but small enough to batch (a
    mount's row write of small closed files): the ids, chunk lists and
    bytes ``put_bytes`` gives, in a fixed number of statements whatever
    their count; a repeated content stored once, a stored one found."""
    rng = random.Random(5)
    blobs = [rng.randbytes(rng.randint(2049, 40_000)) for _ in range(300)]
    objects = ObjectStore()
    statements = []
    with db.write() as conn:
        stored = objects.put_bytes(conn, blobs[3])
        raw = conn.connection.dbapi_connection  # statements run on its cursors (db.Prepared)
        raw.set_trace_callback(statements.append)
        batch = [*blobs, blobs[9]]
        try:
            oids = objects.put_many(conn, batch)
        finally:
            raw.set_trace_callback(None)
        # (the trace shows each row of an executemany: count the lookups)
        lookups = [st for st in statements if st.lstrip().upper().startswith("SELECT")]
        assert 0 < len(lookups) <= 10  # not a few per content
        assert oids[3] == stored and oids[9] == oids[-1]
        assert oids == [xxh3_hex(b) for b in batch]
        assert [objects.read_all(conn, oid) for oid in oids] == batch
        assert count(conn, schema.objects) == len(blobs)
    with db.write() as conn:
        assert oids == [objects.put_bytes(conn, b) for b in batch]  # found, not stored anew
        assert count(conn, schema.objects) == len(blobs)
