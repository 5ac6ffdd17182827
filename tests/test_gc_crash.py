"""gc and prune killed at every durability call (kernel-free, fork and kill):
afterwards the store verifies, every kept layer and the open step read as
before, and running the operation again finishes it."""

from __future__ import annotations

import shutil

import pytest

from crashkit import Counter, KillAt, fast_tmp, fork_run  # noqa: F401  (fast_tmp is a fixture)
from sqlalchemy import select

from stepfs.store import delta, durable, entrytable, gc, history, prune, publish, schema, staging, verify
from stepfs.store.workspace import Workspace
from store_kit import Stager, open_workspace


def body(i: int) -> bytes:
    return b"".join(b"v%d line %d of a text file\n" % (i, k) for k in range(3000))


def make(path) -> None:
    # Commits make their deltas themselves (format 7); here they leave them
    # to gc, as layers completed by recovery do, so gc's delta pass runs
    # and is killed at its durability calls too.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(delta, "after_commit", lambda ws, number: (0, 0))
        _make(path)


def _make(path) -> None:
    ws = open_workspace(path, {"a.txt": ("file", 0o644, body(0)), "b": ("file", 0o644, b"b0\n")})
    for i in range(1, 6):
        s = Stager(ws)
        s.file("a.txt", body(i))
        s.file(f"n{i}", b"new %d\n" % i * 500)
        if i == 3:
            s.whiteout("b")
        publish.commit_step(ws, s.step, message=f"s{i}", overwrite={r.path for r in s.rows()})
    s = Stager(ws, mountpoint="/open")
    s.file("tmp", b"garbage" * 5000)
    s.file("staged", b"staged bytes\n")
    with ws.db.write() as conn:
        staging.remove(conn, s.step, b"tmp")
        staging.discard(conn, s.step, b"staged", mount="/open")  # a conflict now
    s.file("staged2", body(99))
    ws.close()


def files_as_of(ws, numbers) -> dict:
    out = {}
    with ws.db.read() as conn:
        paths = sorted({bytes(r.path) for r in entrytable.all_rows(conn)})
        for n in numbers:
            for p in paths:
                state = history.state_at(conn, p, n)
                out[(n, p)] = ws.objects.read_all(conn, state.oid) if state and state.kind == "file" else state
        for step in (1, 2):
            for row in staging.load(conn, step):
                out[("staged", row.path)] = ws.objects.read_all(conn, row.oid) if row.oid else row.kind
        out["conflicts"] = sorted(ws.objects.read_all(conn, oid) for oid in conn.execute(
            select(schema.conflicts.c.oid)).scalars())
    return out


def operation(kind: str):
    if kind == "gc":
        return lambda ws: gc.collect(ws)
    return lambda ws: prune.prune(ws, keep_last=3)


@pytest.mark.parametrize("kind", ["gc", "prune"])
def test_kill_at_every_durability_call(fast_tmp, kind):
    template = fast_tmp / "template"
    template.mkdir()
    make(template / "ws")
    with Workspace.open(str(template / "ws")) as ws:
        kept = [3, 4, 5] if kind == "prune" else [0, 1, 2, 3, 4, 5]
        expected = files_as_of(ws, kept)
    probe = fast_tmp / "probe"
    shutil.copytree(template, probe)
    counter = Counter()
    with Workspace.open(str(probe / "ws")) as ws, durable.installed(counter):
        operation(kind)(ws)
    assert counter.n >= (3 if kind == "gc" else 1), counter.trace
    print(kind, "durability calls:", counter.trace)
    for k in range(1, counter.n + 1):
        run = fast_tmp / f"run{k}"
        shutil.copytree(template, run)

        def child() -> None:
            ws = Workspace.open(str(run / "ws"))
            with durable.installed(KillAt(k)):
                operation(kind)(ws)

        assert fork_run(child) == "killed", k
        with Workspace.open(str(run / "ws")) as ws:
            report = verify.verify(ws)
            assert report.ok, (k, report.problems)
            assert files_as_of(ws, kept) == expected, k
            operation(kind)(ws)  # repeated, it finishes
            gc.collect(ws)
            assert verify.verify(ws).ok
            assert files_as_of(ws, kept) == expected, k
        shutil.rmtree(run)
