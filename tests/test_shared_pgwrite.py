"""What a shared step costs on PostgreSQL and what it leaves behind
(store/shared/pgwrite.py, pgconnect.py, connecting.py; the lock in
remote.py), on a real server (tests/pgserver.py): a fixed number of
statements whatever the step's size, the server's facts read from the
session's start-up, an upload that changes no setting of the session, a
lock that ends with the step, a connection opened ahead that is closed
when nobody takes it."""

from __future__ import annotations

import os
import time

import psycopg

from pglock import _connect
from test_shared_history import _stage, _step, _ws
from stepfs.overlayfs.client import shared as client
from stepfs.store.shared.connecting import Connecting
from stepfs.store.shared.remote import RIDE_BYTES, LayerRecord, Remote, sha256_hex
from stepfs.store.shared.url import parse

WAIT = 30


class _Trips:
    """What the driver sends: every statement, and the round trips they take
    (a statement alone, or a pipeline of several, waits once for the server)."""

    def __init__(self, monkeypatch):
        self.statements: list[str] = []
        self.piped: list[bool] = []  # each statement: sent in a pipeline
        self.round_trips = 0
        real_execute, real_pipeline = psycopg.Cursor.execute, psycopg.Connection.pipeline
        trips = self

        def execute(cur, query, *args, **kwargs):
            trips.statements.append(" ".join(str(query).split()))
            trips.piped.append(cur.connection._pipeline is not None)
            if cur.connection._pipeline is None:
                trips.round_trips += 1
            return real_execute(cur, query, *args, **kwargs)

        def pipeline(conn):
            trips.round_trips += 1
            return real_pipeline(conn)

        monkeypatch.setattr(psycopg.Cursor, "execute", execute)
        monkeypatch.setattr(psycopg.Connection, "pipeline", pipeline)

    def clear(self) -> None:
        self.statements.clear()
        self.piped.clear()
        self.round_trips = 0


def test_a_step_costs_the_same_four_round_trips_for_1_and_100_files(pg_url, tmp_path, monkeypatch):
    a = _ws(tmp_path / "a", {"f.txt": b"0\n"})
    client.attach(str(a), pg_url)
    trips = _Trips(monkeypatch)
    counts = {}
    for n in (1, 100):
        _stage(a, {f"n{n}-{i}.txt": f"{n} {i}\n".encode() for i in range(n)})
        trips.clear()
        assert _step(a, f"{n} files")["published"]
        counts[n] = (len(trips.statements), trips.round_trips)
    # schema check; lock with head and own layers; the upload (its own
    # transaction), BEGIN and publish; COMMIT alone, once the publish answered
    assert counts == {1: (9, 4), 100: (9, 4)}, counts
    st = trips.statements
    assert "pg_advisory_lock" in st[1] and "stepfs_histories" in st[2] and trips.piped[1:3] == [True, True]
    assert st[3] == "BEGIN" and "stepfs_object_chunks" in st[4] and st[5] == "COMMIT"
    assert st[6] == "BEGIN" and "UPDATE stepfs_histories" in st[7] and trips.piped[3:8] == [True] * 5
    assert st[8] == "COMMIT" and not trips.piped[8]


def test_a_big_upload_goes_ahead_of_the_publish_on_its_own(pg_url, tmp_path, monkeypatch):
    a = _ws(tmp_path / "a", {"f.txt": b"0\n"})
    client.attach(str(a), pg_url)
    big = os.urandom(RIDE_BYTES + 1)  # no two chunks alike: all of it is sent
    _stage(a, {"big.bin": big})
    trips = _Trips(monkeypatch)
    assert _step(a, "big")["published"]
    puts = [i for i, st in enumerate(trips.statements) if "stepfs_object_chunks" in st]
    assert len(puts) == 1 and not trips.piped[puts[0]]  # its own round trip, ahead of the publish's
    r = Remote.open(parse(pg_url))
    try:
        head = r.head()
        row = [e for e in r.entries(head) if e["path"] == b"big.bin"][0]
        assert r.read_object(row["after_object"]) == big
    finally:
        r.close()


def test_the_dialect_reads_the_server_from_the_session_start(pg_url):
    with Remote.open(parse(pg_url)) as r, r.read() as conn:
        num = int(conn.exec_driver_sql("SHOW server_version_num").scalar())
        assert r.engine.dialect.server_version_info[:2] == (num // 10000, num % 10000 if num >= 100000 else num // 100 % 100)
        assert r.engine.dialect._backslash_escapes is False  # standard_conforming_strings is on


def test_an_upload_leaves_the_session_s_durability_as_the_server_sets_it(pg_url):
    db = parse(pg_url).engine_url().database
    with _connect(pg_url) as admin:
        admin.execute(f'ALTER DATABASE "{db}" SET synchronous_commit = on')
    with Remote.open(parse(pg_url)) as r:
        r.create(LayerRecord(0, "baseline", 1, "m", "", "", {}, "w" * 32, "/ws", "host", None), [])
        data = b"uploaded without waiting for the disk\n"
        r.put_objects([(sha256_hex(data), [data])])
        with r.read() as conn:
            # set_config(..., true) lasted for the upload's own transaction only:
            # the publish that follows commits as the server is configured.
            assert conn.exec_driver_sql("SHOW synchronous_commit").scalar() == "on"
        assert r.read_object(sha256_hex(data)) == data


def test_the_lock_ends_with_the_step(pg_url, tmp_path):
    a = _ws(tmp_path / "a", {"f.txt": b"0\n"})
    client.attach(str(a), pg_url)
    _stage(a, {"f.txt": b"1\n"})
    _step(a, "one")
    with _connect(pg_url) as other:
        got = other.execute("SELECT pg_try_advisory_lock(hashtext(%s))", ("stepfs:" + parse(pg_url).name,)).fetchone()
        assert got == (True,)


def _sessions(url: str) -> int:
    with _connect(url) as c:
        return c.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                         "AND pid <> pg_backend_pid()").fetchone()[0]


def _until(cond) -> bool:
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return False


def test_a_connection_opened_ahead_is_used_only_for_its_url_and_never_left_open(pg_url):
    url = parse(pg_url)
    Remote.open(url).close()  # the schema made
    other = parse(pg_url.replace("name=proj", "name=other"))
    with Connecting(url) as early:
        r = early.remote(url)
        try:
            assert r.url == url and r.head() is None
        finally:
            r.close()
    with Connecting(url) as early:  # a wrong guess: the right history opened instead
        r = early.remote(other)
        try:
            assert r.url == other
        finally:
            r.close()
    with Connecting(url):
        pass  # nobody took it
    assert _until(lambda: _sessions(pg_url) == 0), _sessions(pg_url)


def test_a_guess_that_cannot_connect_fails_only_the_step_that_takes_it(tmp_path):
    bad = parse(f"postgresql://stepfs@/nowhere?host={tmp_path}&name=proj")
    with Connecting(bad) as early:
        try:
            early.remote(bad)
        except Exception as exc:
            assert "cannot be reached" in str(exc)
        else:
            raise AssertionError("a server that does not exist answered")
