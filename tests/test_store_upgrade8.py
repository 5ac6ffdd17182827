"""The upgrade of a version-7 store to format 8 (entry lists, a tree of
paths, ``path_layers``): every layer's entries survive as they were, the
history queries answer as before, the store verifies, and a process killed
at any durable call of the upgrade leaves a store that opens as version 7
or 8 with the same layers (kernel-free tier)."""

from __future__ import annotations

import shutil
import sqlite3

import pytest
from sqlalchemy import select

from crashkit import fast_tmp, opened_upgraded, upgrade_killed_at_every_durable_call  # noqa: F401  (fast_tmp is a fixture)
from stepfs.store import entrytable, history, prune, publish, schema, staging
from stepfs.store.layers import entries as load_entries
from store_kit import Stager, drop_format_8, open_workspace


def _history(root):
    """A workspace with files, a directory made and removed, a symlink, a
    hard-linked pair, a big file, a pruned fold and an open step."""
    ws = open_workspace(root, {"d": ("dir", 0o755), "d/x": ("file", 0o644, b"x0\n"),
                               "t.txt": ("file", 0o644, b"t0\n")})
    for i in range(1, 7):
        s = Stager(ws)
        s.file("d/x", b"x%d\n" % i)
        if i == 2:
            s.dir("d/sub")
            s.file("d/sub/y", b"y\n")
            s.file("big", b"".join(b"line %d of a big file\n" % n for n in range(5000)))
        if i == 3:
            s.symlink("d/ln", "x")
            with ws.db.write() as conn:
                oid = ws.objects.put_bytes(conn, b"one inode\n")
                for name in (b"h1", b"h2"):
                    staging.put(conn, s.step, staging.StagedRow(name, "file", 0o100644, oid, None, 10,
                                                                1_600_000_000_000_000_000, False, "absent",
                                                                link_group=1))
        if i == 4:
            s.whiteout("d/sub/y")
            s.whiteout("d/sub")
            s.whiteout("t.txt")
        publish.commit_step(ws, s.step, message=f"step {i}", overwrite={r.path for r in s.rows()})
    prune.prune(ws, keep_last=5)
    s = Stager(ws)
    s.file("staged", b"an open step's file\n")
    return ws


def snapshot(ws) -> dict:
    """Every layer's state and entries, and what the history queries say."""
    with ws.db.read() as conn:
        out = {"layers": conn.execute(select(schema.layers.c.number, schema.layers.c.state,
                                             schema.layers.c.intent_sum)).all()}
        for number, _state, _sum in out["layers"]:
            out[number] = load_entries(conn, number)
        for path in (b"d/x", b"d/sub/y", b"t.txt", b"big", b"h2"):
            out[("rows", path)] = [(r.layer, entrytable.entry_from_row(r)) for r in entrytable.path_rows(conn, path)]
            out[("at", path)] = [history.state_at(conn, path, n) for n in range(0, 8)]
        out["under d"] = [(r.layer, r.path) for r in entrytable.rows_under(conn, b"d")]
        out["refs"] = entrytable.referenced_oids(conn)
        out["staged"] = conn.execute(select(schema.staged.c.path, schema.staged.c.oid)).all()
    return out


def as_version_7(root) -> None:
    raw = sqlite3.connect(root / ".stepfs" / "store.db")
    raw.execute("PRAGMA foreign_keys=OFF")
    drop_format_8(raw)  # the tables as a version-7 stepfs wrote them
    raw.execute("UPDATE meta SET value = '7' WHERE key = 'format_version'")
    raw.commit()
    raw.close()



@pytest.fixture(scope="module")
def version_7(tmp_path_factory):
    """A version-7 store (``root``) and the snapshot its format-8 original gave."""
    root = tmp_path_factory.mktemp("upgrade8") / "ws"
    ws = _history(root)
    before = snapshot(ws)
    ws.close()
    as_version_7(root)
    return root, before


def test_a_version_7_store_is_upgraded_keeping_every_entry(version_7, tmp_path):
    root = tmp_path / "ws"
    shutil.copytree(version_7[0], root, symlinks=True)
    raw = sqlite3.connect(root / ".stepfs" / "store.db")
    assert raw.execute("SELECT count(*) FROM entries").fetchone()[0] > 10
    raw.close()
    with opened_upgraded(root, snapshot, version_7[1]) as ws:
        with ws.db.read() as conn:
            names = conn.exec_driver_sql("SELECT id, name FROM paths WHERE parent = 0 ORDER BY id").all()
        assert [bytes(n) for _i, n in names] == sorted(bytes(n) for _i, n in names)  # numbered in byte order
        s = Stager(ws)  # and it commits on top
        s.file("d/x", b"after the upgrade\n")
        n = publish.commit_step(ws, s.step, overwrite={r.path for r in s.rows()})
        with ws.db.read() as conn:
            assert history.state_at(conn, b"d/x", n - 1) == version_7[1][("at", b"d/x")][-1]
    raw = sqlite3.connect(root / ".stepfs" / "store.db")
    try:
        tables = {r[0] for r in raw.execute("SELECT name FROM sqlite_master")}
        assert "entries" not in tables and "entries_path_layer" not in tables
        assert {"paths", "layer_entries", "path_layers"} <= tables
        assert raw.execute("PRAGMA foreign_key_check").fetchall() == []
    finally:
        raw.close()


@pytest.mark.timeout(300)
def test_the_upgrade_killed_at_every_durable_call_leaves_version_7_or_the_current_one(version_7, fast_tmp):
    upgrade_killed_at_every_durable_call(version_7[0], fast_tmp, "7", str(schema.FORMAT_VERSION), snapshot, version_7[1])
