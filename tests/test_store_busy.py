"""A write that waits out SQLite's busy timeout gets one sentence that names
the process holding the store's write lock (exit 21), never SQLAlchemy's
raw "database is locked", and writes nothing.  Kernel-free: the holder is a
plain process with SQLite's write lock or the commit lock."""

from __future__ import annotations

import fcntl
import os
import sqlite3
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

from stepfs.cli import exitcodes
from stepfs.cli.main import main as cli_main
from stepfs.store import db as db_mod
from stepfs.store import lockholders
from stepfs.store.errors import StoreBusy
from stepfs.store.paths import DB_NAME, STORE_DIR
from store_kit import open_workspace

# Holds SQLite's write lock (BEGIN IMMEDIATE) until its stdin closes.
HOLD_SQLITE = r"""
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("BEGIN IMMEDIATE")
print("held", flush=True)
sys.stdin.read()
conn.execute("ROLLBACK")
"""

# Holds the commit lock (flock) until its stdin closes.
HOLD_FLOCK = r"""
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.read()
"""


@contextmanager
def holder(script: str, path: Path):
    proc = subprocess.Popen([sys.executable, "-c", script, str(path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline() == b"held\n"
        yield proc.pid
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)


@pytest.fixture
def store(tmp_path, monkeypatch):
    """A workspace with a store, and a
    busy timeout short enough for a test."""
    ws = open_workspace(tmp_path / "ws", {"a.txt": ("file", 0o644, b"a\n")})
    ws.close()
    monkeypatch.setattr(db_mod, "BUSY_TIMEOUT_MS", 300)
    return tmp_path / "ws"


def _generation(db_path: Path) -> str:
    with sqlite3.connect(db_path) as conn:
        row = conn.execute("SELECT value FROM meta WHERE key = 'gc_generation'").fetchone()
    return row[0] if row else ""


def test_gc_waiting_out_the_write_lock_names_the_holder_and_writes_nothing(store, capsys):
    db_path = store / STORE_DIR / DB_NAME
    assert cli_main(["gc", str(store)]) == 0
    before = _generation(db_path)
    assert before  # gc numbers its runs: the one below must not have begun
    capsys.readouterr()
    with holder(HOLD_SQLITE, db_path) as pid:
        code = cli_main(["gc", str(store)])
    err = capsys.readouterr().err
    assert code == dict(exitcodes.CODES)[StoreBusy] == 21
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("stepfs: the store ") and "stayed busy" in lines[0]
    assert f"pid {pid} (" in lines[0]
    assert "database is locked" not in err and "internal error" not in err
    assert _generation(db_path) == before  # gc's generation write never happened
    assert cli_main(["gc", str(store)]) == 0  # and the same command works once the holder is gone
    assert _generation(db_path) != before


def test_write_holders_finds_the_commit_lock_and_the_sqlite_write_lock(store):
    db_path = str(store / STORE_DIR / DB_NAME)
    lock_path = str(store / STORE_DIR / "commit.lock")
    assert lockholders.write_holders(db_path, lock_path) == []
    with holder(HOLD_FLOCK, Path(lock_path)) as pid:
        assert lockholders.write_holders(db_path, lock_path) == [pid]
        assert lockholders.describe(pid).startswith(f"pid {pid} (")
    with holder(HOLD_SQLITE, Path(db_path)) as pid:
        assert lockholders.write_holders(db_path, lock_path) == [pid]
    assert lockholders.write_holders(db_path, lock_path) == []


def test_a_lock_this_process_holds_is_not_named(store):
    lock_path = str(store / STORE_DIR / "commit.lock")
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert lockholders.write_holders(str(store / STORE_DIR / DB_NAME), lock_path) == []
    finally:
        os.close(fd)


def test_busy_without_a_visible_holder_still_reads_as_one_sentence(tmp_path):
    err = db_mod.busy("/ws/.stepfs/store.db", str(tmp_path / "no-such.db"))
    assert isinstance(err, StoreBusy)
    assert "another process held its write lock" in str(err)
