"""The upgrade of a version-8 store to format 9 (line counts per layer,
``layer_counts``; deltas without their frame head): every count format
8's ``line_counts`` held for a committed layer's changes is carried, every
delta loses its head and reads the same, the cards read the same, the
store verifies, and a process killed at any durable call of the upgrade leaves a
store that opens as version 8 or 9 with the same history (kernel-free
tier)."""

from __future__ import annotations

import shutil
import sqlite3

import pytest

from crashkit import fast_tmp, opened_upgraded, store_version, upgrade_killed_at_every_durable_call  # noqa: F401  (fast_tmp is a fixture)
from stepfs.store import cards, linecounts, prune, publish, schema, verify
from stepfs.store.workspace import Workspace
from store_kit import Stager, drop_format_9, open_workspace

LONG = b"".join(b"line %d of a text file\n" % i for i in range(300))


def _history(root):
    """Text and binary edits, an added, a deleted and a renamed file, a
    pruned fold, every count remembered, and an open step."""
    ws = open_workspace(root, {"text": ("file", 0o644, b"a\nb\nc\n"), "blob": ("file", 0o644, b"\0\1\2" * 10),
                               "gone.txt": ("file", 0o644, b"x\ny\n"), "moved": ("file", 0o644, b"moves\n")})
    for i in range(1, 6):
        s = Stager(ws)
        s.file("text", b"a\n%d\nc\n" % i)
        s.file("blob", b"\0\3" * (40 + i))
        s.file("long.txt", LONG.replace(b"line %d " % i, b"LINE %d " % i))
        if i == 2:
            s.whiteout("gone.txt")
            s.whiteout("moved")
            s.file("moved-to", b"moves\n")
        publish.commit_step(ws, s.step, message=f"step {i}")
    prune.prune(ws, keep_last=4)
    cards.read_log(ws, fold=False)
    Stager(ws).file("staged", b"an open step's file\n")
    return ws


def snapshot(ws) -> dict:
    """The cards, and every count remembered, by layer."""
    with ws.db.read() as conn:
        rows = cards.Rows.over(conn, ws.objects.hasher)
        numbers = [layer.number for layer in rows.layers()]
        return {"log": cards.log_of(rows, fold=False), "cards": [cards.card_at(rows, n) for n in numbers],
                "counts": {n: linecounts.lookup(rows, n) for n in numbers}}


def _whole_deltas(raw) -> int:
    """Deltas stored as whole zstd frames (format 8's form)."""
    return raw.execute("SELECT count(*) FROM objects WHERE codec = 2 AND substr(data, 1, 4) = x'28b52ffd'"
                       ).fetchone()[0]



@pytest.fixture(scope="module")
def version_8(tmp_path_factory):
    """A version-8 store (``root``) and the snapshot its format-9 original gave."""
    root = tmp_path_factory.mktemp("upgrade9") / "ws"
    ws = _history(root)
    before = snapshot(ws)
    assert sum(map(len, before["counts"].values())) >= 10
    ws.close()
    raw = sqlite3.connect(root / ".stepfs" / "store.db")
    drop_format_9(raw)
    raw.execute("UPDATE meta SET value = '8' WHERE key = 'format_version'")
    raw.commit()
    assert raw.execute("SELECT count(*) FROM line_counts").fetchone()[0] >= 10
    assert _whole_deltas(raw) >= 3
    raw.close()
    return root, before


def test_a_version_8_store_is_upgraded_keeping_every_count(version_8, tmp_path):
    root = tmp_path / "ws"
    shutil.copytree(version_8[0], root, symlinks=True)
    with opened_upgraded(root, snapshot, version_8[1]) as ws:
        s = Stager(ws)  # and it commits on top, its counts remembered by a reader
        s.file("text", b"after the upgrade\n")
        n = publish.commit_step(ws, s.step, overwrite={r.path for r in s.rows()})
        cards.read_log(ws)
        with ws.db.read() as conn:
            assert linecounts.lookup(cards.Rows.over(conn), n)
    raw = sqlite3.connect(root / ".stepfs" / "store.db")
    try:
        tables = {r[0] for r in raw.execute("SELECT name FROM sqlite_master")}
        assert "line_counts" not in tables and "layer_counts" in tables
        assert _whole_deltas(raw) == 0  # stored without the head their size implies
    finally:
        raw.close()


def test_a_version_8_store_without_line_counts_is_upgraded(version_8, tmp_path):
    root = tmp_path / "ws"
    shutil.copytree(version_8[0], root, symlinks=True)
    raw = sqlite3.connect(root / ".stepfs" / "store.db")
    raw.execute("DROP TABLE line_counts")  # optional in format 8
    raw.commit()
    raw.close()
    with Workspace.open(str(root)) as ws:
        assert store_version(root) == str(schema.FORMAT_VERSION)
        got = snapshot(ws)
        assert got["log"] == version_8[1]["log"] and not any(got["counts"].values())
        assert verify.verify(ws).ok


@pytest.mark.timeout(300)
def test_the_upgrade_killed_at_every_durable_call_leaves_version_8_or_9(version_8, fast_tmp):
    upgrade_killed_at_every_durable_call(version_8[0], fast_tmp, "8", str(schema.FORMAT_VERSION), snapshot, version_8[1])
