"""What a shared step costs on PostgreSQL and what it leaves behind
(store/shared/pgwrite.py, pgconnect.py, connecting.py; the lock in
remote.py), on a real server (tests/pgserver.py): a fixed number of
statements whatever the step's size, the server's facts read from the
session's start-up, an upload that changes no setting of the session, a
lock that ends with the step, a connection opened ahead that is closed
when nobody takes it."""

from __future__ import annotations

import time

from sqlalchemy import event

from pglock import _connect
from test_shared_history import _stage, _step, _ws
from stepfs.overlayfs.client import shared as client
from stepfs.store.shared.connecting import Connecting
from stepfs.store.shared.remote import LayerRecord, Remote, sha256_hex
from stepfs.store.shared.url import parse

WAIT = 30


def _count_statements(monkeypatch) -> list[str]:
    seen: list[str] = []
    real = Remote.__init__

    def init(self, url):
        real(self, url)
        event.listen(self.engine, "before_cursor_execute", lambda _c, _cu, statement, *_a: seen.append(statement))

    monkeypatch.setattr(Remote, "__init__", init)
    return seen


def test_a_step_costs_the_same_seven_statements_for_1_and_100_files(pg_url, tmp_path, monkeypatch):
    a = _ws(tmp_path / "a", {"f.txt": b"0\n"})
    client.attach(str(a), pg_url)
    seen = _count_statements(monkeypatch)
    counts = {}
    for n in (1, 100):
        _stage(a, {f"n{n}-{i}.txt": f"{n} {i}\n".encode() for i in range(n)})
        seen.clear()
        assert _step(a, f"{n} files")["published"]
        counts[n] = len(seen)
    # schema check, lock, head with own layers, upload, BEGIN, publish, COMMIT
    assert counts == {1: 7, 100: 7}, counts


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
