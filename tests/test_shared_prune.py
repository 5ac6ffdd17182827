"""``stepfs prune --history URL``: retention on a shared history in a real
PostgreSQL server (tests/pgserver.py).  Every kept layer holds the same
bytes before and after (cat, diff, clone at it, rollback to it), pruned
numbers answer exit 11, a workspace behind the fold syncs from its result,
a step from a second workspace waits for the fold and lands on it, and a
prune killed at each of its points leaves the history before or after."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from sqlalchemy import func, select

from conftest import manifest, stepfs
from pglock import _connect, head_row_locked
from test_shared_cli import _ok, _stage, _workspace

from stepfs.store.shared import prune as shared_prune, tables as T
from stepfs.store.shared.remote import Remote
from stepfs.store.shared.url import parse
from stepfs.store.shared.verifying import verify as verify_history
from stepfs.store.workspace import Workspace

WAIT = 60


def _delete(ws: Path, *paths: str) -> None:
    from store_kit import Stager

    with Workspace.open(str(ws)) as w:
        st = Stager(w)
        for p in paths:
            st.whiteout(p)


def _step(ws: Path, message: str) -> int:
    return _ok(stepfs("step", ws, "-m", message, "--json"))["published"][-1]["shared"]


def _build(pg_url: str, tmp_path: Path) -> tuple[Path, Path]:
    """Two workspaces, a and b (a clone), and a history 0..6 made by both:
    files added, modified, deleted, re-added, a symlink and a directory."""
    a = _workspace(tmp_path / "a", {"keep.txt": b"keep\n", "gone.txt": b"gone soon\n", "edit.txt": b"v0\n"})
    (a / "src").mkdir()
    (a / "src" / "main.py").write_bytes(b"print(0)\n")
    _ok(stepfs("sync", a, "--history", pg_url))
    b = Path(_ok(stepfs("clone", pg_url, tmp_path / "b", "--json"))["workspace"])
    _stage(a, {"edit.txt": b"v1\n", "big.bin": bytes(range(256)) * 4000})
    assert _step(a, "one") == 1
    _delete(a, "gone.txt")
    assert _step(a, "two") == 2
    _stage(b, {"src/main.py": b"print(3)\n", "from_b.txt": b"b\n"})
    assert _step(b, "three from b") == 3
    _stage(a, {"edit.txt": b"v4\n", "gone.txt": b"back again\n"})
    assert _step(a, "four") == 4
    with Workspace.open(str(a)) as w:
        from store_kit import Stager

        Stager(w).symlink("link", "edit.txt")
    _delete(a, "big.bin")
    assert _step(a, "five") == 5
    _stage(a, {"edit.txt": b"v6\n"})
    assert _step(a, "six") == 6
    return a, b


def _states(url: str, numbers) -> dict[int, dict]:
    """Per layer: every path's (kind, mode, target, bytes) as of it."""
    out = {}
    with Remote.open(parse(url)) as remote:
        for n in numbers:
            out[n] = {p: (r["after_kind"], r["after_mode"], r["after_target"],
                          remote.read_object(r["after_object"]) if r["after_object"] else None)
                      for p, r in remote.state_at(n).items() if r["after_kind"] is not None}
    return out


def _rows(url: str) -> tuple:
    """What a prune changes: layer kinds and every entry row."""
    with Remote.open(parse(url)) as remote, remote.read() as conn:
        kinds = conn.execute(select(T.layers.c.number, T.layers.c.kind).order_by(T.layers.c.number)).all()
        entries = conn.execute(select(T.entries).order_by(T.entries.c.layer, T.entries.c.path)).all()
        fmt = conn.execute(select(T.meta.c.value).where(T.meta.c.key == "format_version")).scalar()
    return [tuple(r) for r in kinds], [tuple(r) for r in entries], fmt


def _objects(url: str) -> int:
    with Remote.open(parse(url)) as remote, remote.read() as conn:
        return conn.execute(select(func.count()).select_from(T.objects)).scalar()


def _verified(url: str) -> None:
    assert _ok(stepfs("verify-history", "--history", url, "--json"))["ok"] is True


# Two dozen CLI runs and as many steps, clones and rollbacks against the
# server: 113 s at load 5, against the suite's 120 s hang guard.
@pytest.mark.timeout(360)
def test_prune_keeps_every_kept_layer_and_answers_pruned(pg_url, tmp_path):
    a, b = _build(pg_url, tmp_path)
    before = _states(pg_url, range(7))
    clones_before = {n: manifest(Path(_ok(stepfs("clone", pg_url, tmp_path / f"before{n}", "--at", n,
                                                 "--json"))["workspace"])) for n in (4, 6)}
    diffs_before = {(o, n): _ok(stepfs("diff", "--history", pg_url, o, n)) for o, n in ((4, 6), (5, 6), (6, 4))}
    objects_before = _objects(pg_url)

    dry = _ok(stepfs("prune", "--history", pg_url, "--keep-last", "3", "--dry-run", "--json"))
    assert dry["dry_run"] is True and dry["keep_from"] == 4 and dry["pruned"] == [0, 1, 2, 3]
    assert _states(pg_url, range(7)) == before
    bad = stepfs("prune", a, "--history", pg_url, "--keep-last", "3")
    assert bad.returncode == 2 and "no workspace" in bad.stderr.decode()
    env_only = subprocess.run([sys.executable, "-m", "stepfs.cli.main", "prune", str(a), "--keep-last", "3",
                               "--no-gc", "--json"], capture_output=True, timeout=WAIT,
                              env={**os.environ, "STEPFS_HISTORY": pg_url})
    assert env_only.returncode == 0, env_only.stderr.decode()  # the workspace's own store, not the history
    assert _states(pg_url, range(7)) == before

    res = _ok(stepfs("prune", "--history", pg_url, "--keep-last", "3", "--json"))
    assert res["keep_from"] == 4 and res["pruned"] == [0, 1, 2, 3] and not res["dry_run"]
    # Named by the dropped layers alone, freed by gc-history (big.bin stays: layer 5 deletes it).
    dropped = [b"v0\n", b"v1\n", b"print(0)\n", b"gone soon\n"]
    assert res["gc"]["objects"] == 4 and res["gc"]["bytes"] == sum(map(len, dropped))
    assert _objects(pg_url) == objects_before - res["gc"]["objects"]
    after = _states(pg_url, range(4, 7))
    for n in range(4, 7):
        assert after[n] == before[n], n  # byte-identical
    _verified(pg_url)
    assert _rows(pg_url)[2] == "2"

    for argv in (["cat", "--history", pg_url, "2", "keep.txt"], ["show", "1", "--history", pg_url],
                 ["diff", "--history", pg_url, "3", "6"], ["clone", pg_url, tmp_path / "c3", "--at", "3"]):
        r = stepfs(*argv)
        assert r.returncode == 11, (argv, r.stderr.decode())
        assert "was pruned" in r.stderr.decode() and "oldest layer kept is 4" in r.stderr.decode()
        assert r.stderr.decode().count("\n") == 1
    assert not (tmp_path / "c3").exists() or not any((tmp_path / "c3").iterdir())
    r = stepfs("rollback", a, "2", "--history", pg_url)
    assert r.returncode == 11 and "cannot roll back past the oldest kept layer" in r.stderr.decode()
    r = stepfs("rollback", a, "99", "--history", pg_url)
    assert r.returncode == 11 and "does not exist" in r.stderr.decode() and "past" not in r.stderr.decode()
    assert _ok(stepfs("cat", "--history", pg_url, "4", "edit.txt")) == "v4\n"
    for (o, n), text in diffs_before.items():
        assert _ok(stepfs("diff", "--history", pg_url, o, n)) == text
    log = _ok(stepfs("log", "--history", pg_url, "--json"))
    assert [r["number"] for r in log["layers"]] == [6, 5, 4]
    show = _ok(stepfs("show", "4", "--history", pg_url, "--json"))  # K: everything up to 4
    assert {f["path"] for f in show["files"]} >= {"keep.txt", "edit.txt", "gone.txt", "src/main.py", "from_b.txt"}
    for n in (4, 6):
        got = Path(_ok(stepfs("clone", pg_url, tmp_path / f"after{n}", "--at", n, "--json"))["workspace"])
        assert manifest(got) == clones_before[n]
    again = _ok(stepfs("prune", "--history", pg_url, "--keep-last", "3", "--json"))
    assert again["keep_from"] is None

    # Both workspaces keep stepping on the folded history; rollback to K works.
    assert _ok(stepfs("sync", b, "--json"))["head"] == 6
    assert manifest(b) == manifest(a)
    _stage(b, {"from_b.txt": b"b again\n"})
    assert _step(b, "seven from b") == 7
    res = _ok(stepfs("rollback", a, "4", "--history", pg_url, "--json"))
    assert res["shared"] == 8
    assert manifest(a) == clones_before[4]
    _verified(pg_url)
    for ws in (a, b):
        assert stepfs("verify", ws).returncode == 0


def test_keep_within_and_max_size(pg_url, tmp_path):
    a = _workspace(tmp_path / "a", {"f.txt": b"0\n"})
    _ok(stepfs("sync", a, "--history", pg_url))
    for i in range(1, 4):
        _stage(a, {"f.txt": (b"%d\n" % i) * 50_000})
        _step(a, f"s{i}")
    r = _ok(stepfs("prune", "--history", pg_url, "--keep-within", "1h", "--json"))
    assert r["keep_from"] is None  # everything is recent
    size = 2 * 100_000 + 1000  # room for the two newest versions of f.txt, not three
    r = _ok(stepfs("prune", "--history", pg_url, "--max-size", str(size), "--json"))
    assert r["keep_from"] == 2 and r["pruned"] == [0, 1]
    assert _ok(stepfs("cat", "--history", pg_url, "2", "f.txt")) == "2\n" * 50_000
    with Remote.open(parse(pg_url)) as remote, remote.read() as conn:
        assert shared_prune.referenced_bytes(conn, remote.name, 2) <= size
        created = dict(conn.execute(select(T.layers.c.number, T.layers.c.created_ns)).all())
        assert shared_prune.choose(conn, remote.name, keep_within_ns=10, now_ns=created[3] + 5) == 3
        assert shared_prune.choose(conn, remote.name, keep_within_ns=10, now_ns=created[3] + 10**12) == 3  # the head
        assert shared_prune.choose(conn, remote.name, keep_within_ns=created[3] - created[2],
                                   now_ns=created[3]) is None  # 2 is the oldest kept already
        assert shared_prune.choose(conn, remote.name, keep_last=1, keep_within_ns=created[3] - created[2],
                                   now_ns=created[3]) is None  # kept if either rule keeps it
    _verified(pg_url)


def test_a_workspace_behind_the_fold_syncs_from_its_result(pg_url, tmp_path):
    a, b = _build(pg_url, tmp_path)  # b last synced at 3 (its own step)
    c = Path(_ok(stepfs("clone", pg_url, tmp_path / "c", "--at", "1", "--json"))["workspace"])
    _stage(c, {"keep.txt": b"keep\n"})  # staged, but K holds the same state for it: no conflict
    _ok(stepfs("prune", "--history", pg_url, "--keep-last", "2", "--json"))  # keeps 5 and 6
    for ws in (b, c):
        res = _ok(stepfs("sync", ws, "--json"))
        assert res["pulled"][0]["shared"] == 5 and res["head"] == 6
        assert manifest(ws) == manifest(a), ws
        assert stepfs("verify", ws).returncode == 0
    assert not (c / "big.bin").exists() and (c / "link").is_symlink()
    _stage(c, {"from_c.txt": b"c\n"})
    assert _step(c, "c after the fold") == 7
    assert _ok(stepfs("sync", a, "--json"))["pulled"][0]["shared"] == 7
    _verified(pg_url)


def _waiting(url: str, like: str) -> int:
    """The pid of a backend waiting on a row lock with ``like`` in its query."""
    deadline = time.monotonic() + WAIT
    with _connect(url) as conn:
        while time.monotonic() < deadline:
            row = conn.execute("SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                               "AND wait_event_type = 'Lock' AND query LIKE %s", (f"%{like}%",)).fetchone()
            if row is not None:
                return row[0]
            time.sleep(0.02)
    raise AssertionError(f"nothing waited on a lock with {like!r} within {WAIT} s")


def _meta_row_locked(url: str):
    """Hold ``stepfs_meta``'s format row, the prune's last write."""
    conn = _connect(url)
    conn.execute("BEGIN")
    conn.execute("SELECT value FROM stepfs_meta WHERE key = 'format_version' FOR UPDATE")
    return conn


def _prune_process(url: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "stepfs.cli.main", "prune", "--history", url, "--keep-last", "2",
                             "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _gone(url: str, pid: int) -> None:
    deadline = time.monotonic() + WAIT
    with _connect(url) as conn:
        while conn.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone():
            assert time.monotonic() < deadline, "the killed prune's backend never ended"
            time.sleep(0.02)


def test_a_step_waits_for_the_fold_and_lands_on_it(pg_url, tmp_path):
    a, b = _build(pg_url, tmp_path)
    _ok(stepfs("sync", b))
    before = _states(pg_url, range(7))
    held = _meta_row_locked(pg_url)
    proc = _prune_process(pg_url)
    step = None
    try:
        _waiting(pg_url, "stepfs_meta")  # the fold is written, uncommitted, the head's row held
        _stage(b, {"during.txt": b"stepped while folding\n"})
        step = subprocess.Popen([sys.executable, "-m", "stepfs.cli.main", "step", str(b), "-m", "during", "--json"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        # The step waits for the history's lock (the prune holds it); without it, its
        # compare-and-swap would wait on the head's row: never on top of a half fold.
        deadline = time.monotonic() + WAIT
        with _connect(pg_url) as conn:
            while not conn.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' "
                                   "AND NOT granted").fetchone()[0]:
                assert time.monotonic() < deadline and step.poll() is None, "the step did not wait"
                time.sleep(0.02)
        assert _rows(pg_url)[2] == "1"  # nothing of the fold is visible yet
    finally:
        held.execute("ROLLBACK")
        held.close()
    out, err = proc.communicate(timeout=WAIT)
    assert proc.returncode == 0, err.decode()
    out, err = step.communicate(timeout=WAIT)
    assert step.returncode == 0, err.decode()
    assert json.loads(out)["published"][-1]["shared"] == 7
    after = _states(pg_url, range(5, 8))
    assert after[5] == before[5] and after[6] == before[6]
    assert after[7][b"during.txt"][3] == b"stepped while folding\n"
    _ok(stepfs("sync", a))
    assert manifest(a) == manifest(b)
    _verified(pg_url)


def test_publish_without_the_lock_waits_for_the_fold(pg_url, tmp_path):
    """A publish whose advisory lock was lost: its compare-and-swap waits
    on the head's row for the fold's commit, then succeeds on top of it."""
    from stepfs.store.shared.remote import LayerRecord

    _build(pg_url, tmp_path)
    held = _meta_row_locked(pg_url)
    proc = _prune_process(pg_url)
    done: list = []
    try:
        _waiting(pg_url, "stepfs_meta")

        def publish():
            with Remote.open(parse(pg_url)) as remote:
                rec = LayerRecord(0, "step", time.time_ns(), "raw", "", "", {}, "w" * 32, "/x", "h", None)
                done.append(remote.publish(6, rec, []))

        t = threading.Thread(target=publish)
        t.start()
        _waiting(pg_url, "UPDATE stepfs_histories")
        assert not done
    finally:
        held.execute("ROLLBACK")
        held.close()
    t.join(WAIT)
    assert proc.wait(WAIT) == 0, proc.stderr.read().decode()
    assert done == [7]
    kinds = dict(_rows(pg_url)[0])
    assert [n for n, k in sorted(kinds.items()) if k == "pruned"] == [0, 1, 2, 3, 4]
    _verified(pg_url)


def test_prune_killed_at_each_point_leaves_before_or_after(pg_server, pg_url, tmp_path):
    a, _b = _build(pg_url, tmp_path)
    before_rows = _rows(pg_url)
    states = _states(pg_url, range(7))

    # 1. Killed while waiting for the head's row (the transaction begun, nothing written).
    with head_row_locked(pg_url):
        proc = _prune_process(pg_url)
        pid = _waiting(pg_url, "FOR UPDATE")
        proc.send_signal(signal.SIGKILL)
        proc.wait(WAIT)
    _gone(pg_url, pid)
    assert _rows(pg_url) == before_rows

    # 2. Killed with every fold write done, before COMMIT (blocked at its last write).
    held = _meta_row_locked(pg_url)
    try:
        proc = _prune_process(pg_url)
        pid = _waiting(pg_url, "stepfs_meta")
        proc.send_signal(signal.SIGKILL)
        proc.wait(WAIT)
    finally:
        held.execute("ROLLBACK")
        held.close()
    _gone(pg_url, pid)
    assert _rows(pg_url) == before_rows
    _verified(pg_url)

    # 3. Its backend terminated there instead (a dropped connection): exit 19, before.
    held = _meta_row_locked(pg_url)
    try:
        proc = _prune_process(pg_url)
        pid = _waiting(pg_url, "stepfs_meta")
        with _connect(pg_url) as conn:
            conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
        _out, err = proc.communicate(timeout=WAIT)
    finally:
        held.execute("ROLLBACK")
        held.close()
    assert proc.returncode == 19, err.decode()
    assert _rows(pg_url) == before_rows

    # 3b. The server stopped there (its backends end, their transactions rolled back): exit 19, before.
    held = _meta_row_locked(pg_url)
    proc = _prune_process(pg_url)
    try:
        _waiting(pg_url, "stepfs_meta")
    finally:
        try:
            pg_server.stop()
        finally:
            held.close()
            pg_server.start()
    _out, err = proc.communicate(timeout=WAIT)
    assert proc.returncode == 19, err.decode()
    assert _rows(pg_url) == before_rows

    # 4. Killed after COMMIT, before gc-history (as --no-gc): after; gc-history frees the rest later.
    res = _ok(stepfs("prune", "--history", pg_url, "--keep-last", "2", "--no-gc", "--json"))
    assert res["keep_from"] == 5 and "gc" not in res
    for n in (5, 6):
        assert _states(pg_url, [n])[n] == states[n]
    _verified(pg_url)
    freed = _ok(stepfs("gc-history", "--history", pg_url, "--json"))
    assert freed["objects"] >= 1
    _verified(pg_url)
    got = Path(_ok(stepfs("clone", pg_url, tmp_path / "c", "--json"))["workspace"])
    assert manifest(got) == manifest(a)


def test_prune_on_both_backends(history_url, tmp_path):
    """The library call on an SQLite history too (no gc-history there)."""
    a = _workspace(tmp_path / "a", {"f.txt": b"0\n", "g.txt": b"g\n"})
    _ok(stepfs("sync", a, "--history", history_url))
    for i in range(1, 4):
        _stage(a, {"f.txt": b"%d\n" % i})
        _step(a, f"s{i}")
    before = _states(history_url, range(4))
    with Remote.open(parse(history_url)) as remote:
        res = shared_prune.prune(remote, keep_last=2)
        assert (res.keep_from, res.pruned, res.folded_paths) == (2, [0, 1], 2)
        assert shared_prune.oldest_kept(remote) == 2 and shared_prune.is_pruned(remote, 1)
        assert verify_history(remote)[1] == []
    after = _states(history_url, range(2, 4))
    assert after == {n: before[n] for n in (2, 3)}
    r = stepfs("cat", "--history", history_url, "1", "f.txt")
    assert r.returncode == 11, r.stderr.decode()
    with Remote.open(parse(history_url)) as remote:
        with remote.tx() as conn:  # damage: an entry left in a pruned layer, a kept layer marked pruned
            conn.execute(T.entries.insert().values(history=remote.name, layer=1, path=b"stray"))
            conn.execute(T.layers.update().where(T.layers.c.number == 3).values(kind="pruned"))
        problems = verify_history(remote)[1]
    assert any("pruned layer" in p and "newer than a kept one" in p for p in problems), problems
    assert "2 entries of proj belong to pruned layers" in problems, problems  # the stray one and 3's


def _commit_here(ws: Path, files: dict[str, bytes]) -> int:
    """A local layer not yet published (as a step whose push was cut off)."""
    from store_kit import Stager
    from stepfs.store import publish

    with Workspace.open(str(ws)) as w:
        st = Stager(w)
        for rel, data in files.items():
            st.file(rel, data)
        return publish.commit_step(w, st.step)


def test_behind_the_fold_with_unpublished_layers(pg_url, tmp_path):
    """Unpublished layers of a workspace behind the fold: a path only it
    changed is kept and published; a path the pruned layers changed too is
    refused (exit 7, nothing written) until the workspace gives it up."""
    a, _b = _build(pg_url, tmp_path)
    c = Path(_ok(stepfs("clone", pg_url, tmp_path / "c", "--at", "1", "--json"))["workspace"])
    _commit_here(c, {"keep.txt": b"changed by c only\n", "new_in_c.txt": b"c\n"})
    d = Path(_ok(stepfs("clone", pg_url, tmp_path / "d", "--at", "1", "--json"))["workspace"])
    _commit_here(d, {"edit.txt": b"d's edit\n"})  # edit.txt changed in 4 and 6 too
    _ok(stepfs("prune", "--history", pg_url, "--keep-last", "2"))

    res = _ok(stepfs("sync", c, "--json"))
    assert res["pulled"][0]["shared"] == 5 and res["published"][0]["shared"] == 7
    assert (c / "keep.txt").read_bytes() == b"changed by c only\n" and (c / "new_in_c.txt").read_bytes() == b"c\n"
    assert (c / "edit.txt").read_bytes() == b"v6\n"
    got = Path(_ok(stepfs("clone", pg_url, tmp_path / "c7", "--json"))["workspace"])
    assert manifest(got) == manifest(c)

    before = manifest(d)
    refused = stepfs("sync", d)
    assert refused.returncode == 7, refused.stderr.decode()
    assert "edit.txt (shared layer 5)" in refused.stderr.decode()
    assert manifest(d) == before
    _verified(pg_url)
    assert stepfs("verify", c).returncode == 0 and stepfs("verify", d).returncode == 0


def test_live_mounts_step_across_a_prune(pg_url, mount, tmp_path):
    """Real mounts: b's mount is behind when the history is pruned; its
    next step takes the fold's result (the mount shows it at once) and
    publishes on top; a's mount keeps stepping."""
    a = _workspace(tmp_path / "a", {"common.txt": b"base\n", "old.txt": b"old\n"})
    _ok(stepfs("sync", a, "--history", pg_url))
    b = Path(_ok(stepfs("clone", pg_url, tmp_path / "b", "--json"))["workspace"])
    ma, mb = mount(a), mount(b)
    (mb.mountpoint / "notes.txt").write_bytes(b"b's notes, staged across the prune\n")
    for i in range(1, 5):
        (ma.mountpoint / "common.txt").write_bytes(b"a %d\n" % i)
        if i == 2:
            os.unlink(ma.mountpoint / "old.txt")
        assert _ok(stepfs("step", ma.mountpoint, "-m", f"a{i}", "--json"))["published"][0]["shared"] == i
    res = _ok(stepfs("prune", "--history", pg_url, "--keep-last", "2", "--json"))
    assert res["keep_from"] == 3 and res["gc"]["objects"] >= 1
    res = _ok(stepfs("step", mb.mountpoint, "-m", "b after the prune", "--json"))
    assert [p["shared"] for p in res["pulled"]] == [3, 4] and res["published"][0]["shared"] == 5
    assert (mb.mountpoint / "common.txt").read_bytes() == b"a 4\n"
    assert not (mb.mountpoint / "old.txt").exists()
    (ma.mountpoint / "from_a.txt").write_bytes(b"A\n")
    res = _ok(stepfs("step", ma.mountpoint, "-m", "a5", "--json"))
    assert [p["shared"] for p in res["pulled"]] == [5] and res["published"][0]["shared"] == 6
    assert (ma.mountpoint / "notes.txt").read_bytes() == b"b's notes, staged across the prune\n"
    _ok(stepfs("sync", mb.mountpoint))
    assert manifest(a) == manifest(b)
    r = stepfs("cat", "--history", pg_url, "2", "common.txt")
    assert r.returncode == 11, r.stderr.decode()
    _verified(pg_url)


def test_gc_history_makes_its_indexes_on_an_older_database(pg_url, tmp_path):
    a = _workspace(tmp_path / "a", {"f.txt": b"0\n"})
    _ok(stepfs("sync", a, "--history", pg_url))
    names = [i.name for i in T.GC_INDEXES]
    with _connect(pg_url) as conn:
        for n in names:
            conn.execute(f"DROP INDEX {n}")  # as a database made before them
    _ok(stepfs("gc-history", "--history", pg_url))
    with _connect(pg_url) as conn:
        have = {r[0] for r in conn.execute("SELECT indexname FROM pg_indexes WHERE tablename LIKE 'stepfs_%'")}
    assert set(names) <= have


def _kill_at(obj, name, after: bool):
    import os as _os

    real = getattr(obj, name)

    def wrapper(*a, **k):
        if not after:
            _os.kill(_os.getpid(), signal.SIGKILL)
        out = real(*a, **k)
        _os.kill(_os.getpid(), signal.SIGKILL)
        return out
    return wrapper


def test_a_catch_up_killed_before_or_after_its_layer_recovers(pg_url, tmp_path):
    """The pull of a workspace behind the fold, SIGKILLed before its local
    layer, after its capture of the disk, and after its layer: the next
    sync leaves it equal to the head."""
    from stepfs.overlayfs.client import manage, shared as client
    from stepfs.store import publish
    from stepfs.store.shared import catchup

    a, _b = _build(pg_url, tmp_path)
    points = [(catchup, "changed_rows", False), (catchup, "entries", True), (publish, "write_layer", True)]
    behind = [Path(_ok(stepfs("clone", pg_url, tmp_path / f"c{i}", "--at", "1", "--json"))["workspace"])
              for i in range(len(points))]
    _ok(stepfs("prune", "--history", pg_url, "--keep-last", "2"))
    for (obj, name, after), c in zip(points, behind):
        pid = os.fork()
        if pid == 0:
            try:
                setattr(obj, name, _kill_at(obj, name, after))
                client.sync_workspace(manage.Target(str(c)))
            finally:
                os._exit(3)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (name, status)
        _ok(stepfs("sync", c))
        assert manifest(c) == manifest(a), name
        assert stepfs("verify", c).returncode == 0
    _verified(pg_url)


def test_prune_killed_while_waiting_for_the_history_lock(pg_url, tmp_path):
    _build(pg_url, tmp_path)
    before_rows = _rows(pg_url)
    with Remote.open(parse(pg_url)) as holder, holder.lock():  # a step in progress
        proc = _prune_process(pg_url)
        deadline = time.monotonic() + WAIT
        with _connect(pg_url) as conn:
            while not conn.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' "
                                   "AND NOT granted").fetchone()[0]:
                assert time.monotonic() < deadline, "the prune did not wait for the history's lock"
                time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait(WAIT)
    assert _rows(pg_url) == before_rows
    res = _ok(stepfs("prune", "--history", pg_url, "--keep-last", "2", "--json"))
    assert res["keep_from"] == 5
    _verified(pg_url)
