"""The store under kills, corruption of the intent, collisions and concurrency
(kernel-free).

* SIGKILL of a process in the middle of database transactions (at a chosen
  SQL statement, and at arbitrary moments): ``PRAGMA integrity_check`` is ok
  and every layer's objects exist.
* A torn, truncated or garbage intent record is treated as not committed.
* Eight writer threads and eight readers: no busy errors with ``BEGIN
  IMMEDIATE``, counts match; the same test with deferred transactions shows
  the errors (the test is sensitive).
"""

from __future__ import annotations

import os
import random
import signal
import sqlite3
import threading
import time
from dataclasses import replace

import pytest
from sqlalchemy import event, func, select, update
from sqlalchemy.exc import OperationalError

from crashkit import (  # noqa: F401  (fast_tmp is a fixture)
    Counter, KillAt, check_recovered, commit, copy_template, crash_commit, fast_tmp, fork_run, make_template,
    staged_rows,
)
from stepfs.overlayfs.core.view import Overlay
from stepfs.store import durable, schema, staging, verify
from stepfs.store.db import Database
from stepfs.store.objects import ObjectStore
from stepfs.store.workspace import Workspace
from stepfs.store.records import Entry, State
from store_kit import drop_format_6, rewrite_layer

# -- SIGKILL inside database transactions ---------------------------------------------


def _workload(ws_path, progress_fd: int | None = None, kill_at_statement: int | None = None) -> None:
    """Forever: write files through an overlay (staging transactions) and
    commit a layer every few files (publish transactions)."""
    ws = Workspace.open(str(ws_path))
    if kill_at_statement is not None:
        seen = [0]

        @event.listens_for(ws.db.engine, "before_cursor_execute")
        def _count(*_args):
            seen[0] += 1
            if seen[0] == kill_at_statement:
                os.kill(os.getpid(), signal.SIGKILL)

    view = Overlay(ws, "/kill/mnt")
    rng = random.Random(7)
    for i in range(10_000):
        path = f"/f{i % 23}.bin"
        fh = view.create(path, 0o644) if i < 23 else view.open(path, os.O_WRONLY | os.O_TRUNC)
        view.write(fh, rng.randbytes(rng.randrange(1, 200_000)), 0)
        view.flush(fh)
        view.release(fh)
        if i % 5 == 4:
            view.commit(f"commit {i}")
        if progress_fd is not None:
            os.write(progress_fd, b".")


def _assert_store_sound(ws_path) -> int:
    """Returns the number of committed layers after recovery."""
    with Workspace.open(str(ws_path)) as ws:  # recovery first
        with ws.db.read() as conn:
            assert conn.exec_driver_sql("PRAGMA integrity_check").scalar() == "ok"
            states = list(conn.execute(select(schema.layers.c.state)).scalars())
        assert "pending" not in states
        report = verify.verify(ws)
        assert report.ok, report.problems  # every layer's and staged row's objects exist and re-hash
        return states.count("committed")


@pytest.mark.timeout(120)
def test_sigkill_at_sql_statements_inside_transactions_keeps_the_store_sound(fast_tmp):
    layers = []
    for n, statement in enumerate((5, 40, 157, 400, 1203, 2411)):
        ws_path = fast_tmp / f"s{n}"
        ws_path.mkdir()
        Workspace.open(str(ws_path), create=True).close()
        assert fork_run(lambda: _workload(ws_path, kill_at_statement=statement)) == "killed"
        layers.append(_assert_store_sound(ws_path))
    assert layers[0] == 1 and layers[-1] > 2, layers  # kills before and among several commits


@pytest.mark.timeout(120)
def test_sigkill_at_arbitrary_moments_keeps_the_store_sound(fast_tmp):
    """The parent kills the worker after it reported some progress: the kill
    lands wherever the worker is, usually inside SQLite or a publish."""
    for n, after in enumerate((1, 4, 9, 13)):
        ws_path = fast_tmp / f"a{n}"
        ws_path.mkdir()
        Workspace.open(str(ws_path), create=True).close()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(r)
                _workload(ws_path, progress_fd=w)
            finally:
                os._exit(3)
        os.close(w)
        got = 0
        while got < after:
            chunk = os.read(r, 1)
            assert chunk, "the worker died on its own"
            got += len(chunk)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(r)
        assert _assert_store_sound(ws_path) >= 1 + after // 5  # the layers reported done are there


# -- torn intents ---------------------------------------------------------------------------

def _torn(entries: list[Entry]) -> list[Entry]:
    """The first file's after state with mode 0o777."""
    i = next(i for i, e in enumerate(entries) if e.after.kind == "file")
    e = entries[i]
    return entries[:i] + [replace(e, after=replace(e.after, mode=0o777))] + entries[i + 1:]


TEAR = {
    "garbage checksum": lambda conn: conn.execute(
        update(schema.layers).where(schema.layers.c.number == 1).values(intent_sum="garbage")),
    "empty checksum": lambda conn: conn.execute(
        update(schema.layers).where(schema.layers.c.number == 1).values(intent_sum="")),
    # A layer's entries are lists (format 8): damaged by rewriting them.
    "truncated entries": lambda conn: rewrite_layer(conn, 1, lambda es: es[:-3]),
    "torn entry": lambda conn: rewrite_layer(conn, 1, lambda es: _torn(es)),
    "foreign entry": lambda conn: rewrite_layer(conn, 1, lambda es: es + [
        Entry(b"zz", State(None), State("dir", 0o755))]),
    "garbage list": lambda conn: conn.exec_driver_sql(
        "UPDATE layer_entries SET data = CAST(x'28b52ffd0058' || randomblob(40) AS BLOB) WHERE layer = 1"),
    "other step": lambda conn: conn.execute(
        update(schema.layers).where(schema.layers.c.number == 1).values(step=99)),
}


@pytest.mark.parametrize("tear", sorted(TEAR))
def test_a_torn_truncated_or_garbage_intent_is_not_committed(fast_tmp, tear):
    t = make_template(fast_tmp, 8)
    counter = Counter()
    with Workspace.open(str(copy_template(t, fast_tmp / "count")), recover=False) as ws, durable.installed(counter):
        commit(ws, t)
    intent = counter.durable_commits[0]  # the commit point: the first durable commit
    # A real pending intent: killed at the first call after the commit point.
    run = fast_tmp / "run"
    assert crash_commit(t, run, KillAt(intent + 1)) == "killed"
    with Workspace.open(str(run / "ws"), recover=False) as ws:
        with ws.db.read() as conn:
            assert conn.execute(select(schema.layers.c.state).where(schema.layers.c.number == 1)).scalar() == "pending"
        with ws.db.write() as conn:
            TEAR[tear](conn)
    # Recovery: the intent does not verify, so the layer never happened.
    assert check_recovered(run / "ws", t) == "OLD"
    with Workspace.open(str(run / "ws")) as ws:
        with ws.db.read() as conn:
            assert conn.execute(select(schema.layers.c.state).where(schema.layers.c.number == 1)).scalar() == "void"
        assert staged_rows(ws, t.step) == t.staged  # nothing lost: the step is still open
        # ... and it commits normally as the next layer.
        assert commit(ws, t) == 2


# -- concurrency ---------------------------------------------------------------------------------


def _hammer(db: Database, begin: str, seconds: float = 1.5, max_rounds: int = 150) -> dict:
    """Eight writers (read a count, then write) and eight readers on one store."""
    with db.write() as conn:
        steps = [staging.open_step(conn, f"/writer{i}") for i in range(8)]
    store = ObjectStore()
    done = {s: 0 for s in steps}
    errors: list[str] = []
    stop = threading.Event()
    deadline = time.monotonic() + seconds

    def writer(step: int) -> None:
        for n in range(max_rounds):
            if time.monotonic() > deadline:
                break
            try:
                with db.engine.connect() as conn:
                    conn.execution_options(stepfs_begin=begin, stepfs_durable=False)
                    with conn.begin():
                        have = conn.execute(select(func.count()).where(schema.staged.c.step == step)).scalar_one()
                        oid = store.put_bytes(conn, f"{step}:{have}".encode() * 50)
                        staging.put(conn, step, staging.StagedRow(path=b"f%d" % have, kind="file", mode=0o644,
                                                                  oid=oid, base="absent"))
                done[step] += 1
            except OperationalError as exc:
                errors.append(str(exc.orig))

    def reader() -> None:
        last = {s: 0 for s in steps}
        while not stop.is_set():
            try:
                with db.read() as conn:
                    for s in steps:
                        n = conn.execute(select(func.count()).where(schema.staged.c.step == s)).scalar_one()
                        assert n >= last[s], "a reader saw a count go backwards"
                        last[s] = n
            except OperationalError as exc:
                errors.append(str(exc.orig))

    writers = [threading.Thread(target=writer, args=(s,)) for s in steps]
    readers = [threading.Thread(target=reader) for _ in range(8)]
    for th in writers + readers:
        th.start()
    for th in writers:
        th.join()
    stop.set()
    for th in readers:
        th.join()
    with db.read() as conn:
        counts = {s: conn.execute(select(func.count()).where(schema.staged.c.step == s)).scalar_one() for s in steps}
    return {"done": done, "counts": counts, "errors": errors}


@pytest.mark.timeout(60)
def test_eight_writers_and_eight_readers_with_begin_immediate_never_see_busy(tmp_path):
    db = Database.open(str(tmp_path / "store.db"))
    result = _hammer(db, "BEGIN IMMEDIATE")
    assert result["errors"] == []
    assert result["counts"] == result["done"]  # every write that returned is there, once
    assert sum(result["done"].values()) > 8


@pytest.mark.timeout(60)
def test_the_same_with_deferred_transactions_shows_the_busy_errors(tmp_path):
    db = Database.open(str(tmp_path / "store.db"))
    result = _hammer(db, "BEGIN")
    assert result["errors"], "deferred read-then-write transactions never collided: the test is not sensitive"
    assert all("locked" in e or "busy" in e.lower() for e in result["errors"]), result["errors"][:3]
    assert result["counts"] == result["done"]  # the failed ones rolled back cleanly


# -- format upgrade -----------------------------------------------------------------------------


def test_a_format_1_store_with_a_pending_layer_is_upgraded_and_recovered(fast_tmp):
    """A version-1 store (no layers.step; the intent consumed the staged rows;
    the checksum has no step) left with a pending layer by a crash: opening it
    upgrades it in place and recovery finishes the layer."""
    from stepfs.store import publish
    from stepfs.store.layers import entries as load_entries

    t = make_template(fast_tmp, 8)
    counter = Counter()
    with Workspace.open(str(copy_template(t, fast_tmp / "count")), recover=False) as ws, durable.installed(counter):
        commit(ws, t)
    intent = counter.durable_commits[0]  # the commit point: the first durable commit
    run = fast_tmp / "run"
    assert crash_commit(t, run, KillAt(intent + 2)) == "killed"
    db = str(run / "ws" / ".stepfs" / "store.db")
    with Workspace.open(str(run / "ws"), recover=False) as ws, ws.db.read() as conn:
        v1_sum = publish.intent_checksum(load_entries(conn, 1))
    raw = sqlite3.connect(db)
    raw.execute("UPDATE layers SET intent_sum = ? WHERE number = 1", (v1_sum,))
    raw.execute("DELETE FROM staged WHERE step = ?", (t.step,))
    drop_format_6(raw)
    raw.execute("ALTER TABLE layers DROP COLUMN step")
    raw.execute("ALTER TABLE staged DROP COLUMN scratch")  # format 4
    raw.execute("ALTER TABLE staged DROP COLUMN scratch_sum")
    raw.execute("UPDATE meta SET value = '1' WHERE key = 'format_version'")
    raw.commit()
    raw.close()

    assert check_recovered(run / "ws", t) == "NEW"  # opens: upgrade, then recovery
    raw = sqlite3.connect(db)
    assert raw.execute("SELECT value FROM meta WHERE key = 'format_version'").fetchone() == (str(schema.FORMAT_VERSION),)
    assert raw.execute("SELECT number, state, step FROM layers ORDER BY number").fetchall() == [
        (0, "committed", None), (1, "committed", None)]
    raw.close()
