"""``stepfs gc-history``: the objects a step uploaded but never named in a
layer (killed or cut off in between) are deleted; every object a layer of
any history names is kept; gc waits for a step in progress (real
PostgreSQL: tests/pgserver.py)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from conftest import manifest, stepfs
from test_shared_cli import _ok, _stage, _workspace

from stepfs.store.shared import gc, reads
from stepfs.store.shared import tables as T
from stepfs.store.shared.remote import Remote, sha256_hex
from stepfs.store.shared.url import parse


def _count(url: str, table) -> int:
    from sqlalchemy import func, select

    with Remote.open(parse(url)) as remote, remote.read() as conn:
        return conn.execute(select(func.count()).select_from(table)).scalar()


def _advisory_lock_waited_for(remote: Remote) -> bool:
    from sqlalchemy import text

    with remote.read() as conn:
        return bool(conn.execute(text("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"))
                    .scalar())


def _wait_for_a_waiting_advisory_lock(remote: Remote, deadline_s: float = 60) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if _advisory_lock_waited_for(remote):
            return
        time.sleep(0.05)
    raise AssertionError("gc never waited for the objects' lock")


def test_gc_history_deletes_only_what_no_layer_names(pg_url, tmp_path):
    a = _workspace(tmp_path / "a", {"kept.txt": b"kept\n"})
    _ok(stepfs("sync", a, "--history", pg_url))
    _stage(a, {"second.txt": b"second\n"})
    _ok(stepfs("step", a, "-m", "two"))
    # A step cut off after its upload: objects no layer names (one sharing a chunk with a named one).
    orphans = [b"orphan one\n" * 100, b"orphan two\n"]
    with Remote.open(parse(pg_url)) as remote:
        remote.put_objects([(sha256_hex(o), [o]) for o in orphans])
        remote.put_objects([(sha256_hex(b"kept\n" + b"tail"), [b"kept\n", b"tail"])])
    before = _count(pg_url, T.objects)
    res = _ok(stepfs("gc-history", "--history", pg_url, "--json"))
    assert res["objects"] == 3 and res["chunks"] == 3  # "kept\n" is named by a layer's own object
    assert res["bytes"] == len(orphans[0]) + len(orphans[1]) + len(b"tail")
    assert _count(pg_url, T.objects) == before - 3
    assert _ok(stepfs("verify-history", "--history", pg_url, "--json"))["ok"] is True
    clone = Path(_ok(stepfs("clone", pg_url, tmp_path / "c", "--json"))["workspace"])
    assert manifest(clone) == manifest(a)
    again = _ok(stepfs("gc-history", "--history", pg_url, "--json"))
    assert (again["objects"], again["chunks"]) == (0, 0)
    text = _ok(stepfs("gc-history", "--history", pg_url))
    assert text.startswith("removed 0 object(s)")


def test_gc_waits_for_a_step_between_its_upload_and_its_layer(pg_url, tmp_path):
    a = _workspace(tmp_path / "a", {"x.txt": b"x\n"})
    _ok(stepfs("sync", a, "--history", pg_url))
    data = b"uploaded, layer not yet published\n"
    done: list = []
    with Remote.open(parse(pg_url)) as stepper, stepper.lock():
        stepper.put_objects([(sha256_hex(data), [data])])

        def run_gc():
            with Remote.open(parse(pg_url)) as remote:
                done.append(gc.collect(remote))

        t = threading.Thread(target=run_gc)
        t.start()
        _wait_for_a_waiting_advisory_lock(stepper)  # gc is queued behind the step
        assert not done
    t.join(timeout=60)
    assert done and done[0].objects == 1  # once the step let go (here without publishing), it is garbage


def test_gc_history_refuses_an_sqlite_history(tmp_path):
    url = f"sqlite:///{tmp_path}/h.db?name=proj"
    res = stepfs("gc-history", "--history", url)
    assert res.returncode == 20 and "PostgreSQL" in res.stderr.decode()


def test_cat_racing_a_prune_and_gc_history_gets_its_bytes(pg_url, tmp_path):
    """``cat`` reads a path's entry, then its object: a prune that drops the
    layer in between runs gc-history, which waits for the read instead of
    sweeping the object under it (it used to fail with exit code 12)."""
    a = _workspace(tmp_path / "a", {"f.txt": b"v0\n"})
    _ok(stepfs("sync", a, "--history", pg_url))
    for v in (1, 2, 3):
        _stage(a, {"f.txt": b"v%d\n" % v})
        _ok(stepfs("step", a, "-m", f"v{v}"))
    pruning: list = []
    with Remote.open(parse(pg_url)) as remote:
        assert reads.file_bytes(remote, 2, "f.txt") == b"v2\n"
        real = remote.read_object

        def read_object(digest: str) -> bytes:
            # Between the entry and its bytes: layers 0-2 dropped, their objects collected.
            prune = threading.Thread(target=lambda: pruning.append(
                stepfs("prune", "--history", pg_url, "--keep-last", "1", "--json")))
            pruning.append(prune)
            prune.start()
            end = time.monotonic() + 60
            while prune.is_alive() and not _advisory_lock_waited_for(remote) and time.monotonic() < end:
                time.sleep(0.05)
            return real(digest)

        remote.read_object = read_object
        assert reads.file_bytes(remote, 2, "f.txt") == b"v2\n"
    pruning[0].join(timeout=60)
    res = _ok(pruning[1])
    assert res["pruned"] == [0, 1, 2] and res["gc"]["objects"] >= 2  # v1 and v2: named by dropped layers alone
    gone = stepfs("cat", "--history", pg_url, "2", "f.txt")
    assert gone.returncode == 11, gone.stderr.decode()
    assert _ok(stepfs("verify-history", "--history", pg_url, "--json"))["ok"] is True
