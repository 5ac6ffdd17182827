"""When the view's staged rows reach the store (view.py, "Staged rows and
crashes"), without a kernel.

Namespace and metadata changes, and a small file's close-write (its
content too), are recorded in memory and written in one transaction at the
next fsync, commit, discard, status request, unmount or timer tick.  A daemon that dies keeps the upper layer as
it was at the last of those: never a later change without an earlier one.
These views run with ``row_delay=None`` (no timer) so each test decides when
the store is written, except the one that tests the timer itself.
"""

from __future__ import annotations

import os
import stat as stat_mod
import threading
from types import SimpleNamespace

import pytest

from stepfs.overlayfs.core import rows as rows_mod
from stepfs.store import durable, staging
from viewkit import open_view, read_all, reopen, view_manifest, write_file


def rows(ws, view) -> dict[bytes, staging.StagedRow]:
    with ws.db.read() as conn:
        return {r.path: r for r in staging.load(conn, view.step)}


class Commits:
    """Counts database COMMITs (the durability seam); can make them fail."""

    def __init__(self, fail: bool = False):
        self.n = 0
        self.fail = fail

    def before(self, op: str, args: tuple) -> None:
        if op == "commit" and self.fail:
            raise OSError(5, "injected commit failure")

    def after(self, op: str, args: tuple) -> None:
        if op == "commit":
            self.n += 1


@pytest.fixture
def deferred(tmp_path):
    ws_dir = tmp_path / "ws"
    ws_dir.mkdir()
    (ws_dir / "old.txt").write_bytes(b"old\n")
    ws, view = open_view(tmp_path, row_delay=None)
    yield ws, view
    ws.close()


def test_metadata_changes_and_close_writes_reach_the_store_together(deferred):
    ws, view = deferred
    write_file(view, "/a", b"a\n")
    assert rows(ws, view) == {}  # the close recorded its content, nothing written yet
    assert read_all(view, "/a") == b"a\n"  # served from the recorded bytes
    view.sync_rows()
    assert set(rows(ws, view)) == {b"a"}
    view.chmod("/a", 0o600)
    view.mkdir("/d", 0o755)
    view.utimens("/old.txt", (1_000_000_000, 2_000_000_000))
    view.symlink("/d/l", "../a")
    write_file(view, "/d/b", b"b\n")
    assert set(rows(ws, view)) == {b"a"}  # recorded, not written yet
    assert stat_mod.S_IMODE(rows(ws, view)[b"a"].mode) == 0o644
    with durable.installed(Commits()) as commits:
        view.sync_rows()
    assert commits.n == 1  # the content, its row and every recorded row: one transaction
    got = rows(ws, view)
    assert set(got) == {b"a", b"d", b"d/b", b"d/l", b"old.txt"}
    assert stat_mod.S_IMODE(got[b"a"].mode) == 0o600
    assert got[b"old.txt"].mtime_ns == 2_000_000_000
    assert got[b"d/l"].target == b"../a"
    with ws.db.read() as conn:
        assert ws.objects.read_all(conn, got[b"d/b"].oid) == b"b\n"  # a stored object, not a placeholder
    assert view.upper.get("/d/b").oid == got[b"d/b"].oid
    assert read_all(reopen(view), "/d/b") == b"b\n"


def test_a_file_being_written_costs_no_transaction_at_its_close(deferred):
    """What ``tar -x`` does to every file: create, write, futimens, fchown,
    fchmod on the open descriptor, then close."""
    ws, view = deferred
    with durable.installed(Commits()) as commits:
        fh = view.create("/t.txt", 0o600, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        view.write(fh, b"tarred\n", 0)
        view.utimens("/t.txt", (view.UTIME_OMIT, 1_500_000_000_000_000_000))
        view.chown("/t.txt", os.getuid(), os.getgid())
        view.chmod("/t.txt", 0o644)
        view.flush(fh)
        view.release(fh)
        assert commits.n == 0
        view.sync_rows()
    assert commits.n == 1
    row = rows(ws, view)[b"t.txt"]
    assert (stat_mod.S_IMODE(row.mode), row.mtime_ns) == (0o644, 1_500_000_000_000_000_000)
    assert read_all(reopen(view), "/t.txt") == b"tarred\n"


def test_a_rewrite_recorded_twice_stores_the_last_bytes_and_an_identical_one_keeps_the_token(deferred):
    ws, view = deferred
    write_file(view, "/r", b"one\n")
    write_file(view, "/r", b"two\n")
    token = view.versions.node_token(view.upper.get("/r"))
    write_file(view, "/r", b"two\n")  # identical to the recorded bytes: nothing published
    assert view.versions.node_token(view.upper.get("/r")) == token
    view.sync_rows()
    write_file(view, "/r", b"two\n")  # identical to the stored object
    assert view.versions.node_token(view.upper.get("/r")) == token
    assert read_all(reopen(view), "/r") == b"two\n"


def test_a_crash_keeps_the_upper_layer_of_the_last_write(deferred):
    ws, view = deferred
    view.mkdir("/d", 0o755)
    write_file(view, "/d/f", b"f\n")
    view.sync_rows()  # what fsync, a step or the timer does
    expected = view_manifest(view)
    view.chmod("/d/f", 0o600)
    view.rename("/d", "/e")
    view.unlink("/old.txt")
    view.symlink("/l", "e/f")
    write_file(view, "/e/f", b"changed\n")
    after = reopen(view)  # SIGKILL: the five recorded changes are lost together
    assert view_manifest(after) == expected
    assert stat_mod.S_IMODE(after.getattr("/d/f")["st_mode"]) == 0o644


def test_coalesced_removals_and_recreations_leave_the_rows_of_the_view(deferred):
    ws, view = deferred
    view.mkdir("/t", 0o755)
    write_file(view, "/t/x", b"x\n")
    view.unlink("/t/x")
    view.rmdir("/t")
    view.mkdir("/t", 0o700)
    view.symlink("/t/y", "nowhere")
    view.rename("/old.txt", "/t/old")
    view.mkdir("/t/sub", 0o755)
    view.rename("/t/sub", "/t/sub2")
    expected = view_manifest(view)
    view.sync_rows()
    got = rows(ws, view)
    assert {p: r.kind for p, r in got.items()} == {
        b"t": "dir", b"t/y": "symlink", b"t/old": "file", b"t/sub2": "dir", b"old.txt": "whiteout",
    }
    assert view_manifest(reopen(view)) == expected


def test_fsync_writes_the_recorded_rows(deferred):
    ws, view = deferred
    view.chmod("/old.txt", 0o640)
    fh = view.open("/old.txt", os.O_RDONLY)
    view.fsync(fh, False)
    view.release(fh)
    assert stat_mod.S_IMODE(rows(ws, view)[b"old.txt"].mode) == 0o640
    assert stat_mod.S_IMODE(reopen(view).getattr("/old.txt")["st_mode"]) == 0o640


def test_commit_discard_and_close_write_the_recorded_rows(deferred):
    ws, view = deferred
    view.mkdir("/n", 0o755)
    number = view.commit(message="mkdir only")
    assert number >= 1 and os.path.isdir(os.path.join(ws.path, "n"))
    view.mkdir("/gone", 0o755)
    assert view.discard(["/gone"]) == ["/gone"]
    assert b"gone" not in rows(ws, view)
    view.symlink("/kept", "n")
    view.close()  # unmount
    assert rows(ws, view)[b"kept"].kind == "symlink"


def test_a_failed_write_keeps_the_rows_recorded(deferred):
    ws, view = deferred
    view.mkdir("/m", 0o755)
    with durable.installed(Commits(fail=True)), pytest.raises(OSError):
        view.sync_rows()
    assert rows(ws, view) == {}
    view.sync_rows()  # the store can write again: nothing was dropped
    assert rows(ws, view)[b"m"].kind == "dir"


def test_the_timer_writes_recorded_rows(tmp_path, monkeypatch):
    # The timer's clock stands still until the test moves it: on a busy
    # machine a real 10 ms delay could pass before ``armed`` is checked, or
    # between the mkdir and the chmod that must find the timer armed.
    now = [0.0]
    monkeypatch.setattr(rows_mod, "time", SimpleNamespace(monotonic=lambda: now[0]))
    ws, view = open_view(tmp_path, row_delay=0.01)
    timer = view.rows.timer
    thread = timer._thread
    assert not timer.armed and thread.is_alive()
    view.mkdir("/later", 0o755)
    assert timer.armed
    now[0] += 1  # the timer's thread sees it due at its next wake-up (at most 10 ms)
    assert timer.wait_fired(1, timeout=10)  # the timer has run (an event, not a sleep)
    assert rows(ws, view)[b"later"].kind == "dir"
    assert not timer.armed
    # The next change arms the same thread again.
    view.mkdir("/later2", 0o755)
    view.chmod("/later2", 0o700)  # while armed: no second arming
    assert timer.armed and timer.fired == 1
    now[0] += 1
    assert timer.wait_fired(2, timeout=10)
    assert timer._thread is thread and thread.is_alive()
    assert rows(ws, view)[b"later2"].mode & 0o777 == 0o700
    assert timer.fired == 2
    view.close()
    thread.join(timeout=10)
    assert not thread.is_alive()  # close ends it
    ws.close()


def test_a_view_closed_while_the_timer_is_armed_writes_its_rows_once(tmp_path):
    ws, view = open_view(tmp_path, row_delay=60)
    view.mkdir("/pending", 0o755)
    assert view.rows.timer.armed
    view.close()
    assert not view.rows.timer.armed
    assert rows(ws, view)[b"pending"].kind == "dir"
    ws.close()


def test_row_delay_zero_writes_each_change_at_once(tmp_path):
    ws, view = open_view(tmp_path)  # the default for library callers
    view.mkdir("/now", 0o755)
    assert rows(ws, view)[b"now"].kind == "dir"
    assert view.rows.timer is None
    ws.close()


def test_recorded_content_is_written_once_it_reaches_its_bound(deferred, monkeypatch):
    ws, view = deferred
    monkeypatch.setattr(rows_mod, "PENDING_CONTENT_MAX", 100)
    write_file(view, "/small", b"s" * 50)
    assert rows(ws, view) == {}
    write_file(view, "/more", b"m" * 50)  # 100 bytes held: written at once
    assert set(rows(ws, view)) == {b"small", b"more"}
    assert view.rows.pending.content_bytes == 0


class HeldWrite:
    """Holds the timer's batch inside its transaction (with the view's
    lock released, as the timer writes it) until :meth:`release`."""

    def __init__(self, monkeypatch):
        self.inside, self.go = threading.Event(), threading.Event()
        real = rows_mod.PendingRows.write

        def write(batch, *args, **kw):
            self.inside.set()
            assert self.go.wait(10)
            return real(batch, *args, **kw)

        monkeypatch.setattr(rows_mod.PendingRows, "write", write)

    def start(self, view) -> threading.Thread:
        thread = threading.Thread(target=view.rows._timed_sync)
        thread.start()
        assert self.inside.wait(10)
        return thread

    def release(self, thread: threading.Thread) -> None:
        self.go.set()
        thread.join(10)
        assert not thread.is_alive()


def test_requests_go_on_while_the_timer_writes_and_its_ids_reach_later_rows(deferred, monkeypatch):
    """The timer writes its batch without the view's lock: a change made
    meanwhile goes to the next batch, and a row it records for a file whose
    content the batch is storing names the stored object, not the placeholder."""
    ws, view = deferred
    write_file(view, "/a", b"a\n")
    placeholder = view.upper.get("/a").oid
    held = HeldWrite(monkeypatch)
    thread = held.start(view)
    view.chmod("/a", 0o600)  # the lock is free: this does not wait for the batch
    view.mkdir("/d", 0o755)
    assert read_all(view, "/a") == b"a\n"  # the batch's bytes are still served
    held.release(thread)
    oid = view.upper.get("/a").oid
    assert oid != placeholder and rows(ws, view)[b"a"].oid == oid
    assert stat_mod.S_IMODE(rows(ws, view)[b"a"].mode) == 0o644  # the chmod waits for the next batch
    assert b"d" not in rows(ws, view)
    view.sync_rows()
    got = rows(ws, view)
    assert (got[b"a"].oid, stat_mod.S_IMODE(got[b"a"].mode)) == (oid, 0o600)
    assert got[b"d"].kind == "dir"
    assert read_all(reopen(view), "/a") == b"a\n"


def test_a_timer_batch_that_fails_goes_back_in_front_of_later_changes(deferred, monkeypatch):
    ws, view = deferred
    view.mkdir("/m", 0o755)
    write_file(view, "/m/f", b"f\n")
    view.symlink("/gone", "m/f")
    held = HeldWrite(monkeypatch)
    with durable.installed(Commits(fail=True)):
        thread = held.start(view)
        view.chmod("/m", 0o700)  # recorded after the batch: must win over it
        view.unlink("/gone")  # and a removal after the batch's put
        write_file(view, "/g", b"g\n")
        held.release(thread)
    assert rows(ws, view) == {}
    assert view.upper.get("/m/f").oid.split(".")[1].startswith("p")  # still a placeholder
    view.sync_rows()
    got = rows(ws, view)
    assert set(got) == {b"m", b"m/f", b"g"}
    assert stat_mod.S_IMODE(got[b"m"].mode) == 0o700
    after = reopen(view)
    assert read_all(after, "/m/f") == b"f\n" and read_all(after, "/g") == b"g\n"


def test_a_sync_while_the_timer_writes_waits_for_its_batch(deferred, monkeypatch):
    """fsync, a step or status write everything recorded: the timer's
    batch first, then the rest, in that order."""
    ws, view = deferred
    view.mkdir("/x", 0o755)
    held = HeldWrite(monkeypatch)
    thread = held.start(view)
    view.rename("/x", "/y")
    syncing = threading.Thread(target=view.sync_rows)
    syncing.start()
    syncing.join(0.2)
    assert syncing.is_alive()  # it waits for the batch
    held.release(thread)
    syncing.join(10)
    assert set(rows(ws, view)) == {b"y"}
