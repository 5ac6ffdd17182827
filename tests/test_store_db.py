"""Store database: format check, pragmas, transactions (kernel-free tier)."""

from __future__ import annotations

import os
import sqlite3
import threading

import pytest
from sqlalchemy import event, func, select, text

from stepfs.store import db as db_mod
from stepfs.store import chunking, schema, staging
from stepfs.store.db import Database
from stepfs.store.objects import ObjectStore
from stepfs.store.errors import StoreFormatError
from store_kit import drop_format_6


def meta_rows(db: Database) -> dict[str, str]:
    with db.read() as conn:
        return dict(conn.execute(select(schema.meta.c.key, schema.meta.c.value)).all())


def set_meta(path: str, key: str, value: str) -> None:
    raw = sqlite3.connect(path)
    try:
        raw.execute("UPDATE meta SET value = ? WHERE key = ?", (value, key))
        raw.commit()
    finally:
        raw.close()


def open_fds_to(path: str) -> list[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == path:
                out.append(fd)
        except OSError:
            continue
    return out


def test_new_store_has_meta_rows_and_every_table(tmp_path):
    path = str(tmp_path / "store.db")
    db = Database.open(path)
    facts = meta_rows(db)
    assert facts["format_version"] == str(schema.FORMAT_VERSION) == "11"
    assert facts["hash_algorithm"] == schema.HASH_ALGORITHM == "xxh3_128"
    assert facts["chunk_size"] == str(schema.CHUNK_SIZE) == str(chunking.MAX_SIZE)
    db.close()
    raw = sqlite3.connect(path)
    names = {r[0] for r in raw.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    raw.close()
    assert names == {t.name for t in schema.metadata.sorted_tables}


def test_reopen_keeps_data(tmp_path):
    path = str(tmp_path / "store.db")
    db = Database.open(path)
    with db.write() as conn:
        conn.execute(schema.meta.insert().values(key="probe", value="kept"))
    db.close()
    db = Database.open(path, create=False)
    assert meta_rows(db)["probe"] == "kept"
    db.close()


def test_newer_format_is_refused(tmp_path):
    path = str(tmp_path / "store.db")
    Database.open(path).close()
    set_meta(path, "format_version", str(schema.FORMAT_VERSION + 1))
    with pytest.raises(StoreFormatError, match="newer stepfs"):
        Database.open(path)


def as_version_5(path: str) -> None:
    """Turn a new store into what format 5 looked like (store_kit.drop_format_6)."""
    raw = sqlite3.connect(path)
    try:
        drop_format_6(raw)
        raw.execute("UPDATE meta SET value = '5' WHERE key = 'format_version'")
        raw.commit()
    finally:
        raw.close()


def as_version_3(path: str) -> None:
    """Turn a new store into what format 3 looked like (no staged.scratch*)."""
    as_version_5(path)
    raw = sqlite3.connect(path)
    try:
        raw.execute("ALTER TABLE staged DROP COLUMN scratch")
        raw.execute("ALTER TABLE staged DROP COLUMN scratch_sum")
        raw.execute("UPDATE meta SET value = '3' WHERE key = 'format_version'")
        raw.commit()
    finally:
        raw.close()


def test_version_2_store_is_upgraded_keeping_its_data(tmp_path):
    """Format 3 only adds kinds (the version alone); format 4 adds the
    by-reference columns of staged rows."""
    path = str(tmp_path / "store.db")
    db = Database.open(path)
    with db.write() as conn:
        conn.execute(schema.meta.insert().values(key="probe", value="kept"))
    db.close()
    as_version_3(path)
    set_meta(path, "format_version", "2")
    db = Database.open(path, create=False)
    facts = meta_rows(db)
    assert facts["format_version"] == str(schema.FORMAT_VERSION) and facts["probe"] == "kept"
    db.close()


def test_version_3_store_is_upgraded_to_5_keeping_staged_rows(tmp_path):
    """Format 4: staged rows may reference a scratch file; old rows keep
    their object and reference none."""
    path = str(tmp_path / "store.db")
    db = Database.open(path)
    with db.write() as conn:
        oid = ObjectStore().put_bytes(conn, b"old content")
        step = staging.open_step(conn, "/mnt")
        staging.put(conn, step, staging.StagedRow(path=b"f", kind="file", mode=0o100644, oid=oid, size=11))
    db.close()
    as_version_3(path)
    raw = sqlite3.connect(path)
    columns = {r[1] for r in raw.execute("PRAGMA table_info(staged)")}
    raw.close()
    assert "scratch" not in columns
    db = Database.open(path, create=False)
    assert meta_rows(db)["format_version"] == str(schema.FORMAT_VERSION)
    with db.read() as conn:
        [row] = staging.load(conn, step)
    assert (row.oid, row.scratch, row.scratch_sum) == (oid, None, None)
    db.close()


def test_version_5_store_is_upgraded_to_6_keeping_its_objects(tmp_path):
    """Format 6: chunk codecs (old chunks stay raw and read as before),
    object gc generations (0 for old objects), pruned layers."""
    path = str(tmp_path / "store.db")
    db = Database.open(path)
    text = b"a line of text that compresses well\n" * 4000
    with db.write() as conn:
        from stepfs.store.objects import ObjectStore as OS

        oid = OS().put_bytes(conn, text)
        conn.execute(schema.chunks.update().values(codec=0, data=text, base=None))  # as a v5 writer stored it
    db.close()
    as_version_5(path)
    raw = sqlite3.connect(path)
    assert "codec" not in {r[1] for r in raw.execute("PRAGMA table_info(chunks)")}
    raw.close()
    db = Database.open(path, create=False)
    assert meta_rows(db)["format_version"] == str(schema.FORMAT_VERSION)
    store = ObjectStore()
    with db.read() as conn:
        assert store.read_all(conn, oid) == text
        assert conn.execute(select(schema.objects.c.gen)).scalars().all() == [0]
    with db.write() as conn:  # new chunks are compressed
        other = store.put_bytes(conn, text + b"more")
        assert store.read_all(conn, other) == text + b"more"
        assert conn.execute(select(func.max(schema.chunks.c.codec))).scalar() == 1
    db.close()
    assert "chunks_base" in index_names(path)


def index_names(path: str) -> set[str]:
    raw = sqlite3.connect(path)
    try:
        return {r[0] for r in raw.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
    finally:
        raw.close()


def test_version_4_store_is_upgraded_to_5_with_the_layers_state_index(tmp_path):
    """Format 5 adds the index on layers (state, number); the layers stay."""
    path = str(tmp_path / "store.db")
    db = Database.open(path)
    with db.write() as conn:
        conn.execute(schema.layers.insert().values(number=1, state="pending", kind="step", created_ns=1))
    db.close()
    assert "layers_state_number" in index_names(path)
    as_version_5(path)
    raw = sqlite3.connect(path)
    raw.execute("DROP INDEX layers_state_number")
    raw.execute("UPDATE meta SET value = '4' WHERE key = 'format_version'")
    raw.commit()
    raw.close()
    db = Database.open(path, create=False)
    assert meta_rows(db)["format_version"] == str(schema.FORMAT_VERSION)
    with db.read() as conn:
        assert conn.execute(select(schema.layers.c.number, schema.layers.c.state)).all() == [(1, "pending")]
    db.close()
    assert "layers_state_number" in index_names(path)
    raw = sqlite3.connect(path)
    plan = raw.execute("EXPLAIN QUERY PLAN SELECT min(number) FROM layers WHERE state = 'pending'").fetchall()
    raw.close()
    assert "layers_state_number" in str(plan)  # the commit's pending check is a lookup


def test_unknown_hash_algorithm_is_refused(tmp_path):
    path = str(tmp_path / "store.db")
    Database.open(path).close()
    set_meta(path, "hash_algorithm", "md5")
    with pytest.raises(StoreFormatError, match="md5"):
        Database.open(path)


@pytest.mark.parametrize("version", ["one", "", "0", "-3"])
def test_unreadable_format_version_is_refused(tmp_path, version):
    path = str(tmp_path / "store.db")
    Database.open(path).close()
    set_meta(path, "format_version", version)
    with pytest.raises(StoreFormatError, match="format version"):
        Database.open(path)


def test_missing_table_is_refused(tmp_path):
    path = str(tmp_path / "store.db")
    Database.open(path).close()
    raw = sqlite3.connect(path)
    raw.execute("DROP TABLE conflicts")
    raw.commit()
    raw.close()
    with pytest.raises(StoreFormatError, match="conflicts"):
        Database.open(path)


def test_foreign_sqlite_database_is_refused_and_left_alone(tmp_path):
    path = str(tmp_path / "other.db")
    raw = sqlite3.connect(path)
    raw.execute("CREATE TABLE notes (body TEXT)")
    raw.execute("INSERT INTO notes VALUES ('mine')")
    raw.commit()
    raw.close()
    with pytest.raises(StoreFormatError, match="not a stepfs store"):
        Database.open(path)
    raw = sqlite3.connect(path)
    names = [r[0] for r in raw.execute("SELECT name FROM sqlite_master")]
    raw.close()
    assert names == ["notes"]


@pytest.mark.parametrize(
    "content",
    [os.urandom(8192), b"just some text\n" * 10, b"SQLite format 3\0" + bytes(range(256)) * 32],
    ids=["random", "text", "sqlite-header-then-garbage"],
)
def test_non_sqlite_file_is_refused_with_store_format_error(tmp_path, content):
    path = str(tmp_path / "store.db")
    with open(path, "wb") as f:
        f.write(content)
    with pytest.raises(StoreFormatError, match="not a stepfs store"):
        Database.open(path)
    with open(path, "rb") as f:
        assert f.read() == content  # never "repaired" or overwritten


def test_refused_store_leaves_no_open_file(tmp_path):
    path = str(tmp_path / "store.db")
    with open(path, "wb") as f:
        f.write(b"not a database at all" * 100)
    with pytest.raises(StoreFormatError):
        Database.open(path)
    assert open_fds_to(path) == []


def test_empty_file_without_create_is_refused(tmp_path):
    path = str(tmp_path / "store.db")
    open(path, "wb").close()
    with pytest.raises(StoreFormatError, match="no stepfs store"):
        Database.open(path, create=False)


@pytest.mark.parametrize("dirname", ["a?b", "50%25 done", "x#y", "sp ace"])
def test_store_path_is_taken_literally(tmp_path, dirname):
    """A path is a file name, not a URL: '?', '%', '#' must not be parsed."""
    where = tmp_path / dirname
    where.mkdir()
    path = str(where / "store.db")
    db = Database.open(path)
    with db.write() as conn:
        conn.execute(schema.meta.insert().values(key="probe", value="here"))
    db.close()
    assert sorted(os.listdir(tmp_path)) == [dirname]
    assert os.path.isfile(path)
    assert meta_rows(Database.open(path, create=False))["probe"] == "here"


def test_racing_creator_finds_the_store_already_made(tmp_path, monkeypatch):
    """Two processes opening a new store at once: the second looked before
    the first created the tables, then waits for the write lock.  It must
    open the store the first made, not fail on the meta rows."""
    path = str(tmp_path / "store.db")
    Database.open(path).close()  # the winner
    real_inspect = db_mod.inspect
    calls = []

    class Stale:
        """What the loser saw before the winner committed: no tables."""

        def get_table_names(self):
            return []

    def stale_once(bind):
        calls.append(bind)
        return Stale() if len(calls) == 1 else real_inspect(bind)

    monkeypatch.setattr(db_mod, "inspect", stale_once)
    db = Database.open(path)
    assert meta_rows(db)["format_version"] == str(schema.FORMAT_VERSION)
    db.close()


def test_memory_database_works():
    db = Database.memory()
    assert meta_rows(db)["format_version"] == str(schema.FORMAT_VERSION)
    with db.write() as conn:
        conn.execute(schema.meta.insert().values(key="probe", value="x"))
    assert meta_rows(db)["probe"] == "x"
    db.close()


def pragma(conn, name: str):
    return conn.exec_driver_sql(f"PRAGMA {name}").scalar()


def test_file_store_pragmas(tmp_path):
    db = Database.open(str(tmp_path / "store.db"))
    with db.read() as conn:
        assert pragma(conn, "journal_mode") == "wal"
        assert pragma(conn, "busy_timeout") == db_mod.BUSY_TIMEOUT_MS
        assert pragma(conn, "mmap_size") == 0
        assert pragma(conn, "foreign_keys") == 1
    with db.write() as conn:
        assert pragma(conn, "synchronous") == 1  # NORMAL: staging
    with db.write(durable=True) as conn:
        assert pragma(conn, "synchronous") == 2  # FULL: layer transactions
    with db.write() as conn:
        assert pragma(conn, "synchronous") == 1  # a pooled connection forgets FULL
    db.close()


def test_transactions_begin_immediate_for_writes_only(tmp_path):
    db = Database.open(str(tmp_path / "store.db"))
    seen: list[str] = []
    event.listen(db.engine, "before_cursor_execute", lambda *a: seen.append(a[2]))
    with db.write() as conn:
        conn.execute(select(schema.meta.c.value))
    assert "BEGIN IMMEDIATE" in seen
    seen.clear()
    with db.read() as conn:
        conn.execute(select(schema.meta.c.value))
    assert "BEGIN" in seen and "BEGIN IMMEDIATE" not in seen
    db.close()


def test_concurrent_read_then_write_transactions_do_not_fail_busy(tmp_path):
    """Deferred transactions that read, then write, fail with SQLITE_BUSY
    under concurrency; BEGIN IMMEDIATE makes the second wait instead."""
    path = str(tmp_path / "store.db")
    db = Database.open(path)
    with db.write() as conn:
        conn.execute(schema.meta.insert().values(key="counter", value="0"))
    rounds, errors = 100, []
    start = threading.Barrier(2)

    def bump() -> None:
        try:
            start.wait()
            for _ in range(rounds):
                with db.write() as conn:
                    value = int(conn.execute(
                        select(schema.meta.c.value).where(schema.meta.c.key == "counter")).scalar_one())
                    conn.execute(text("UPDATE meta SET value = :v WHERE key = 'counter'"), {"v": str(value + 1)})
        except Exception as exc:  # collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=bump) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    assert meta_rows(db)["counter"] == str(2 * rounds)
    db.close()


def test_big_staging_writes_leave_checkpoints_to_the_next_durable_commit(tmp_path):
    """A close-write that stages many pages appends them to the WAL and
    returns (no checkpoint, no fsync of store.db); the next durable commit
    checkpoints them into the database file."""
    path = tmp_path / "store.db"
    db = Database.open(str(path))
    try:
        main_size = path.stat().st_size
        with db.write() as conn:  # ~2,000 pages: past SQLite's default threshold of 1,000
            conn.execute(schema.chunks.insert(), [{"cid": f"c{i}", "size": 4096, "data": os.urandom(4096)}
                                                  for i in range(2000)])
        assert path.stat().st_size == main_size
        with db.write(durable=True) as conn:
            conn.execute(schema.meta.insert().values(key="test", value="x"))
        assert path.stat().st_size > main_size + 2000 * 4096
    finally:
        db.close()


def test_a_new_connection_does_not_wait_for_a_running_writer(tmp_path):
    """The connection set-up's pragmas never need the write lock (setting
    auto_vacuum on an existing file would wait for it: the busy timeout)."""
    import time

    path = str(tmp_path / "store.db")
    db = Database.open(path)
    other = None
    try:
        with db.write() as conn:
            conn.execute(schema.meta.insert().values(key="probe", value="held"))
            started = time.monotonic()
            other = Database.open(path, create=False)  # connects while the write lock is held
            with other.read() as c2:
                c2.execute(select(schema.meta.c.value)).all()
            # Far below the busy timeout it would have waited (30 s), and
            # long enough for a connection set-up on a loaded machine.
            assert time.monotonic() - started < db_mod.BUSY_TIMEOUT_MS / 1000 / 2
    finally:
        if other is not None:
            other.close()
        db.close()
