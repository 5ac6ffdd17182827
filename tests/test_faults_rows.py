"""Fault injection on the staged-row paths (issue 18's fault pass over #19's
code): the close-write's own transaction, the pending rows and the small
close-writes that wait for them without SQL (``overlayfs/core/rows.py``,
``cas.py``).  Kernel-free.

The documented outcome (FORMAT.md, "staged"; the failsafe): a close whose
transaction fails reports the error and keeps the old content; a row write
that fails leaves the store as the upper layer was at one earlier moment
(never part of a batch, never a placeholder id), turns the view read-only,
keeps serving what it holds in memory and fails ``fsync``; a new view sees
the last batch that was written.

The store's failures are injected where SQLite reports them: at the
``durable.commit`` seam, as the ``DBAPIError`` SQLAlchemy raises for a
failed COMMIT (SQLITE_IOERR, SQLITE_FULL), and as a real full filesystem
(a small tmpfs) for SQLITE_FULL inside the transaction.
"""

from __future__ import annotations

import os
import sqlite3

import pytest
import sqlalchemy.exc
from sqlalchemy import select

from crashkit import fork_run, tmpfs
from stepfs.overlayfs.core import cas as cas_mod
from stepfs.overlayfs.core.errors import ReadOnly
from stepfs.overlayfs.core.view import Overlay
from stepfs.store import durable, schema, staging, verify
from stepfs.store.errors import StoreFull, StoreUnavailable
from stepfs.store.workspace import Workspace

SQLITE_IOERR, SQLITE_FULL = 10, 13
CODES = {"EIO": SQLITE_IOERR, "ENOSPC": SQLITE_FULL}


class FailCommit:
    """The ``n``-th COMMIT of a writing transaction fails as SQLite's
    would (``code``): SQLAlchemy's ``OperationalError`` around it."""

    def __init__(self, code: int, n: int = 1):
        self.code, self.n, self.seen = code, n, 0

    def before(self, op: str, args: tuple) -> None:
        if op != "commit":
            return
        self.seen += 1
        if self.seen == self.n:
            orig = sqlite3.OperationalError("disk I/O error" if self.code == SQLITE_IOERR
                                            else "database or disk is full")
            orig.sqlite_errorcode = self.code
            raise sqlalchemy.exc.OperationalError("COMMIT", {}, orig)

    def after(self, op: str, args: tuple) -> None:
        pass


class KillAtCommit:
    """SIGKILL this process at the ``n``-th COMMIT (before it happens)."""

    def __init__(self, n: int = 1):
        self.n, self.seen = n, 0

    def before(self, op: str, args: tuple) -> None:
        if op == "commit":
            self.seen += 1
            if self.seen == self.n:
                os.kill(os.getpid(), 9)

    def after(self, op: str, args: tuple) -> None:
        pass


def _read(view: Overlay, path: str, agent: str = "") -> bytes:
    fh = view.open(path, os.O_RDONLY, agent=agent) if agent else view.open(path, os.O_RDONLY)
    try:
        return view.read(fh, 1 << 20, 0)
    finally:
        view.release(fh)


def _write(view: Overlay, path: str, data: bytes, create: bool = False) -> int:
    fh = view.create(path, 0o644) if create else view.open(path, os.O_WRONLY | os.O_TRUNC)
    view.write(fh, data, 0)
    return fh


def _rows(ws: Workspace) -> dict[bytes, tuple]:
    with ws.db.read() as conn:
        return {r.path: (r.kind, r.oid, r.size) for r in conn.execute(select(schema.staged))}


def _assert_sound(ws: Workspace) -> None:
    """No staged row names an object the store does not have (a
    placeholder or a rolled-back put), and the database is intact."""
    with ws.db.read() as conn:
        assert conn.exec_driver_sql("PRAGMA integrity_check").scalar() == "ok"
        for r in conn.execute(select(schema.staged)):
            if r.oid is not None:
                assert ws.objects.exists(conn, r.oid), (r.path, r.oid)
    assert verify.verify(ws).ok


def _ws(tmp_path):
    ws_path = tmp_path / "ws"
    ws_path.mkdir()
    (ws_path / "a.txt").write_bytes(b"workspace a\n")
    return ws_path, Workspace.open(str(ws_path), create=True)


# -- a close whose own transaction fails -------------------------------------------


@pytest.mark.parametrize("code", CODES, ids=list(CODES))
@pytest.mark.parametrize("case", ["workspace-file", "created-file", "staged-file", "big-file"])
def test_a_close_whose_transaction_fails_at_its_commit_keeps_the_old_content(tmp_path, code, case):
    ws_path, ws = _ws(tmp_path)
    try:
        view = Overlay(ws, str(tmp_path / "mnt"))
        path, old = "/a.txt", b"workspace a\n"
        if case == "created-file":
            path, old = "/n.txt", b""
            view.release(view.create(path, 0o644))
        elif case == "staged-file":
            view.release(_write(view, path, b"staged before\n"))
            view.flush(view.open(path, os.O_RDONLY))
            old = b"staged before\n"
        view.sync_rows()
        rows_before = _rows(ws)
        new = b"x" * (2 << 20) if case == "big-file" else b"the new bytes, not kept\n"
        fh = _write(view, path, new)
        with durable.installed(FailCommit(CODES[code])):
            with pytest.raises(StoreFull if code == "ENOSPC" else StoreUnavailable):
                view.flush(fh)
        # The writer got the error; every other agent still sees the old file.
        assert view.readonly_reason is not None
        assert view.getattr(path, agent="other")["st_size"] == len(old)
        assert _read(view, path, agent="other") == old
        with pytest.raises(ReadOnly):
            view.mkdir("/later", 0o755)
        view.release(fh)  # nothing is published after the failed close
        assert _read(view, path, agent="other") == old
        assert _rows(ws) == rows_before
        _assert_sound(ws)
        view.close()
        again = Overlay(ws, str(tmp_path / "mnt"))  # the next mount
        try:
            assert _read(again, path) == old
            assert again.readonly_reason is None
        finally:
            again.close()
    finally:
        ws.close()


def test_a_failed_close_keeps_the_rows_it_would_have_superseded(tmp_path):
    """A chmod recorded before a close whose transaction fails (a big file:
    stored at its close) is still the path's latest change, written with
    the next batch once the store can write again."""
    ws_path, ws = _ws(tmp_path)
    try:
        view = Overlay(ws, str(tmp_path / "mnt"), row_delay=60.0)
        view.chmod("/a.txt", 0o600)  # recorded, not written (the timer is a minute away)
        fh = _write(view, "/a.txt", b"x" * (2 << 20))
        with durable.installed(FailCommit(SQLITE_IOERR)):
            with pytest.raises(StoreUnavailable):
                view.flush(fh)
        view.release(fh)
        assert view.getattr("/a.txt", agent="other")["st_mode"] & 0o777 == 0o600
        assert view.rows.pending.rows.get(b"a.txt") is not None
        view.close()  # writes what is pending (the disk is healthy again)
        with ws.db.read() as conn:
            (row,) = staging.load(conn, staging.open_step(conn, str(tmp_path / "mnt")))
        assert row.path == b"a.txt" and row.mode & 0o777 == 0o600
        again = Overlay(ws, str(tmp_path / "mnt"))
        try:
            assert _read(again, "/a.txt") == b"workspace a\n"
        finally:
            again.close()
    finally:
        ws.close()


# -- the pending rows -------------------------------------------------------------------


@pytest.mark.parametrize("code", CODES, ids=list(CODES))
def test_a_pending_row_write_failing_at_its_commit_loses_no_earlier_batch(tmp_path, code):
    ws_path, ws = _ws(tmp_path)
    try:
        view = Overlay(ws, str(tmp_path / "mnt"), row_delay=60.0)
        fh = _write(view, "/b.txt", b"batch one\n", create=True)
        view.flush(fh)
        view.release(fh)
        view.sync_rows()  # batch one is in the store
        written = _rows(ws)
        assert set(written) == {b"b.txt"}
        # Batch two: a small close recorded without SQL, a mkdir, a chmod.
        fh = view.open("/b.txt", os.O_WRONLY | os.O_TRUNC)
        view.write(fh, b"batch two\n", 0)
        view.flush(fh)  # no SQL: its bytes wait with the rows
        view.release(fh)
        view.mkdir("/d", 0o755)
        view.chmod("/a.txt", 0o600)
        assert view.rows.pending
        with durable.installed(FailCommit(CODES[code])):
            with pytest.raises(StoreFull if code == "ENOSPC" else StoreUnavailable):
                view.sync_rows()  # what an fsync or the timer runs
        # Nothing of batch two reached the store; batch one is intact.
        assert _rows(ws) == written
        _assert_sound(ws)
        # The view is read-only and still serves what it holds.
        assert view.readonly_reason is not None
        assert _read(view, "/b.txt") == b"batch two\n"
        with pytest.raises(ReadOnly):
            _write(view, "/c.txt", b"refused\n", create=True)
        # The unmount writes the batch again, whole (the disk is healthy again).
        view.close()
        again = Overlay(ws, str(tmp_path / "mnt"))
        try:
            assert _read(again, "/b.txt") == b"batch two\n"
            assert again.getattr("/d")["st_mode"] & 0o777 == 0o755
            assert again.getattr("/a.txt")["st_mode"] & 0o777 == 0o600
            _assert_sound(ws)
        finally:
            again.close()
    finally:
        ws.close()


def test_a_crash_at_the_pending_rows_commit_recovers_to_the_earlier_batch(tmp_path):
    ws_path, ws = _ws(tmp_path)
    view = Overlay(ws, str(tmp_path / "mnt"), row_delay=60.0)
    fh = _write(view, "/b.txt", b"batch one\n", create=True)
    view.flush(fh)
    view.release(fh)
    view.sync_rows()
    written = _rows(ws)
    view.close()
    ws.close()

    def body() -> None:
        w = Workspace.open(str(ws_path))
        v = Overlay(w, str(tmp_path / "mnt"), row_delay=60.0)
        f = v.open("/b.txt", os.O_WRONLY | os.O_TRUNC)
        v.write(f, b"batch two\n", 0)
        v.flush(f)
        v.release(f)
        v.mkdir("/d", 0o755)
        with durable.installed(KillAtCommit()):
            v.sync_rows()

    assert fork_run(body) == "killed"
    with Workspace.open(str(ws_path)) as ws:
        assert _rows(ws) == written
        _assert_sound(ws)
        view = Overlay(ws, str(tmp_path / "mnt"))
        try:
            assert _read(view, "/b.txt") == b"batch one\n"
            assert {p for _op, p in view.staged_paths()} == {"/b.txt"}
        finally:
            view.close()


@pytest.mark.timeout(120)
def test_a_disk_filling_before_the_pending_rows_are_written_fails_them_whole(tmp_path, monkeypatch):
    """A real SQLITE_FULL inside the rows' transaction: the close was
    recorded while there was room, the filesystem filled before the write."""
    monkeypatch.setattr(cas_mod, "RECORD_FREE_MIN", 1 << 20)  # the tmpfs is small: record below 64 MiB free
    with tmpfs(tmp_path / "small", size="24m") as fs:
        ws_path = fs / "ws"
        ws_path.mkdir()
        (ws_path / "a.txt").write_bytes(b"workspace a\n")
        with Workspace.open(str(ws_path), create=True) as ws:
            view = Overlay(ws, "/faults/mnt", row_delay=60.0)
            names = [f"/f{i}.bin" for i in range(8)]
            for name in names:  # created and closed once: staged, in the store
                fh = view.create(name, 0o644)
                view.write(fh, b"0", 0)
                view.flush(fh)
                view.release(fh)
            view.sync_rows()
            written = _rows(ws)
            for name in names:  # recorded: bytes in memory, no SQL
                fh = view.open(name, os.O_WRONLY | os.O_TRUNC)
                view.write(fh, os.urandom(200_000), 0)
                view.flush(fh)
                view.release(fh)
            assert len(view.rows.pending.contents) == len(names)
            held = {name: _read(view, name) for name in names}
            st = os.statvfs(ws_path)
            with open(ws_path / "ballast.bin", "wb") as f:  # another program fills the disk
                f.write(b"\xa5" * (st.f_bavail * st.f_frsize - 300_000))
            with pytest.raises(StoreFull):
                view.sync_rows()
            assert _rows(ws) == written
            assert "full" in view.readonly_reason
            assert {name: _read(view, name) for name in names} == held
            _assert_sound(ws)
            view.close()
        os.unlink(ws_path / "ballast.bin")
        with Workspace.open(str(ws_path)) as ws:
            assert _rows(ws) == written
            _assert_sound(ws)


def test_no_placeholder_id_reaches_the_store(tmp_path):
    """The rows that name recorded content are written with the stored id."""
    ws_path, ws = _ws(tmp_path)
    try:
        view = Overlay(ws, str(tmp_path / "mnt"), row_delay=60.0)
        fh = _write(view, "/b.txt", b"one\n", create=True)
        view.flush(fh)
        view.release(fh)
        for data in (b"two\n", b"three\n"):
            fh = view.open("/b.txt", os.O_WRONLY | os.O_TRUNC)
            view.write(fh, data, 0)
            view.flush(fh)
            view.release(fh)
        view.link("/c.txt", "/b.txt")
        view.sync_rows()
        with ws.db.read() as conn:
            rows = staging.load(conn, view.step)
            assert {r.path for r in rows} == {b"b.txt", b"c.txt"}
            for r in rows:
                assert ".p" not in r.oid and ws.objects.read_all(conn, r.oid) == b"three\n"
        _assert_sound(ws)
    finally:
        ws.close()
