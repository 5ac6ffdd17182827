"""gc and prune on a live mount (real FUSE): gc racing staged writes, copy-ups
and commits loses nothing, and what a step deleted is gone after it."""

from __future__ import annotations

import json
import os
import threading

import pytest

from stepfs.cli.retention import run_gc
from conftest import manifest, stepfs
from sqlalchemy import select

from stepfs.store import schema, verify
from stepfs.store.workspace import Workspace

pytestmark = pytest.mark.mount


def temp(i: int) -> bytes:
    return b"".join(b"temp file of round %d, line %d\n" % (i, k) for k in range(2000))


def test_gc_racing_staged_writes_copy_ups_and_commits(workspace, mount):
    for i in range(60):
        (workspace / f"w{i}.txt").write_bytes(b"workspace file %d\n" % i * 100)
    m = mount(workspace)
    errors: list[str] = []
    done = threading.Event()
    expected: dict[str, bytes] = {}

    def writer() -> None:
        try:
            for i in range(30):
                tmp = m.path(f"tmp{i}")
                tmp.write_bytes(temp(i))  # staged, then deleted: garbage
                tmp.unlink()
                keep = m.path(f"keep{i % 5}.txt")
                # Odd rounds write what the last round's temp file held: a
                # put of bytes gc may be collecting right now.
                data = temp(i - 1) if i % 2 else b"keep %d\n" % i
                keep.write_bytes(data)
                expected[keep.name] = data
                # Copy-ups: the object is put first, its row written up to
                # ROW_DELAY later (gc's quiesce makes the daemon write it).
                os.chmod(m.path(f"w{2 * i}.txt"), 0o600)
                os.chmod(m.path(f"w{2 * i + 1}.txt"), 0o600)
                if i % 4 == 3:
                    r = stepfs("step", m.mountpoint, "-m", f"round {i}")
                    if r.returncode not in (0, 6):
                        errors.append(f"step {i}: {r.stderr.decode()}")
                for name, data in expected.items():
                    if m.path(name).read_bytes() != data:
                        errors.append(f"round {i}: {name} reads other bytes")
        except OSError as exc:
            errors.append(f"writer: {exc}")
        finally:
            done.set()

    t = threading.Thread(target=writer)
    t.start()
    runs = 0
    try:
        with Workspace.open(str(workspace)) as ws:
            while not done.is_set() or runs < 2:
                run_gc(ws)  # what 'stepfs gc' runs, in a tight loop
                runs += 1
    finally:
        t.join(timeout=120)
    r = stepfs("gc", m.mountpoint, "--json")  # and the command itself
    assert r.returncode == 0, r.stderr.decode()
    assert not errors, errors
    r = stepfs("step", m.mountpoint, "-m", "last")
    assert r.returncode in (0, 6), r.stderr.decode()
    r = stepfs("gc", m.mountpoint, "--json")
    report = json.loads(r.stdout)
    assert r.returncode == 0 and report["objects"] >= 0
    for name, data in expected.items():
        assert (workspace / name).read_bytes() == data
        assert m.path(name).read_bytes() == data
    assert not any(p.name.startswith("tmp") for p in workspace.iterdir())
    for i in range(60):
        assert os.stat(workspace / f"w{i}.txt").st_mode & 0o777 == 0o600
    with Workspace.open(str(workspace)) as ws:
        result = verify.verify(ws)
        assert result.ok, result.problems
        # No temp file's bytes survived its step and the last gc.
        with ws.db.read() as conn:
            live = {bytes(ws.objects.read_all(conn, oid)) for oid in conn.execute(
                select(schema.objects.c.oid)).scalars()}
    never_kept = {temp(i) for i in range(1, 30, 2)}  # odd rounds' temp files never reached a layer
    assert not never_kept & live
    assert temp(28) in live  # keep3.txt holds it (round 29)
    assert runs >= 10


def test_prune_and_rollback_through_a_live_mount(workspace, mount):
    (workspace / "f.txt").write_text("v0\n")
    m = mount(workspace)
    trees = {}
    for i in range(1, 7):
        m.path("f.txt").write_text(f"v{i}\n")
        m.path(f"n{i}").write_text(f"new {i}\n")
        r = stepfs("step", m.mountpoint, "-m", f"s{i}")
        assert r.returncode == 0, r.stderr.decode()
        trees[i] = manifest(workspace)
    r = stepfs("prune", m.mountpoint, "--keep-last", "3", "--json")
    assert r.returncode == 0, r.stderr.decode()
    assert json.loads(r.stdout)["keep_from"] == 4
    r = stepfs("rollback", m.mountpoint, "2")
    assert r.returncode == 11 and b"pruned" in r.stderr
    r = stepfs("rollback", m.mountpoint, "4")
    assert r.returncode == 0, r.stderr.decode()
    assert manifest(workspace) == trees[4]
    assert m.path("f.txt").read_text() == "v4\n" and not m.path("n5").exists()
    assert m.path(".stepfs", "layers", "5", "n5").read_text() == "new 5\n"
    with Workspace.open(str(workspace)) as ws:
        assert verify.verify(ws).ok


def test_mount_keep_last_prunes_after_each_step_and_warns_over_the_size(workspace, mount):
    (workspace / "f.txt").write_text("v0\n")
    m = mount(workspace, keep_last=3, warn_size=1)  # any store is over 1 byte
    stderr = b""
    for i in range(1, 6):
        m.path("f.txt").write_text(f"v{i}\n")
        r = stepfs("step", m.mountpoint, "-m", f"s{i}")
        assert r.returncode == 0, r.stderr.decode()
        stderr = r.stderr
    assert b"warning: store size" in stderr and b"over the 1 B set at mount" in stderr
    assert "warning: store size" in m.path(".stepfs", "status").read_text()
    r = stepfs("log", m.mountpoint, "--json")
    assert [layer["number"] for layer in json.loads(r.stdout)["layers"]] == [5, 4, 3]
    r = stepfs("cat", m.mountpoint, "1", "f.txt")
    assert r.returncode == 11 and b"layer 1 was pruned; the oldest layer kept is 3" in r.stderr
    r = stepfs("cat", m.mountpoint, "3", "f.txt")
    assert r.returncode == 0 and r.stdout == b"v3\n"
    r = stepfs("mount", workspace, workspace.parent / "other", "--keep-last", "0")
    assert r.returncode == 13 and b"--keep-last must be at least 1" in r.stderr
