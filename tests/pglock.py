"""Catch a shared publish inside its transaction on a real PostgreSQL
server: another connection holds the history's row locked, so the
publish's compare-and-swap (the first part of its one statement) waits on
the server, its transaction open, until the holder lets go.  What the
test does meanwhile (terminate the publishing backend, kill the client
process) happens at that point and nowhere else.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import psycopg

from stepfs.store.shared.url import parse

WAIT = 60


def _connect(url: str) -> psycopg.Connection:
    u = parse(url).engine_url()
    return psycopg.connect(dbname=u.database, host=u.query["host"], user=u.username, autocommit=True)


@contextmanager
def head_row_locked(url: str):
    """The history's row locked (``FOR UPDATE``) until the block ends."""
    conn = _connect(url)
    try:
        conn.execute("BEGIN")
        got = conn.execute("SELECT head FROM stepfs_histories WHERE name = %s FOR UPDATE", (parse(url).name,)).fetchone()
        assert got is not None, "the history does not exist"
        yield conn
        conn.execute("ROLLBACK")
    finally:
        conn.close()


def waiting_publisher(url: str) -> int:
    """The pid of the backend whose publish waits on the locked row."""
    deadline = time.monotonic() + WAIT
    with _connect(url) as conn:
        while time.monotonic() < deadline:
            row = conn.execute("SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                               "AND wait_event_type = 'Lock' AND query LIKE '%%UPDATE stepfs_histories%%'").fetchone()
            if row is not None:
                return row[0]
            time.sleep(0.01)
    raise AssertionError(f"no publish waited on the history's row within {WAIT} s")


def terminate(url: str, pid: int) -> None:
    with _connect(url) as conn:
        assert conn.execute("SELECT pg_terminate_backend(%s)", (pid,)).fetchone()[0]
