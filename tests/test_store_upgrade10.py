"""The upgrade of a version-9 store to format 10 (a delta names its base by
a key prefix, store/baseref.py): every object reads the same, every delta
finds its base, the cards read the same, the store verifies, gc keeps the
bases, and a process killed at any durable call of the upgrade leaves a
store that opens as version 9 or 10 with the same history (kernel-free
tier)."""

from __future__ import annotations

import shutil
import sqlite3

import pytest

from crashkit import fast_tmp, opened_upgraded, upgrade_killed_at_every_durable_call  # noqa: F401  (fast_tmp is a fixture)
from stepfs.store import baseref, cards, gc, publish, schema, verify
from store_kit import Stager, drop_format_10, open_workspace

SMALL = b"".join(b'{"name": "pkg%d", "version": "1.0.%d"}\n' % (i, i) for i in range(20))


def _history(root):
    """Small files edited over several steps (inline deltas), a deleted one."""
    ws = open_workspace(root, {f"f{i}.json": ("file", 0o644, SMALL + b"%d" % i) for i in range(4)})
    for step in range(1, 5):
        s = Stager(ws)
        for i in range(4):
            s.file(f"f{i}.json", SMALL.replace(b"1.0.%d" % step, b"2.%d.0" % step) + b"%d" % i)
        if step == 3:
            s.whiteout("f3.json")
        publish.commit_step(ws, s.step, message=f"step {step}")
    return ws


def snapshot(ws) -> dict:
    """The cards and every object's bytes."""
    with ws.db.read() as conn:
        rows = cards.Rows.over(conn, ws.objects.hasher)
        numbers = [layer.number for layer in rows.layers()]
        oids = [o for (o,) in conn.execute(schema.objects.select().with_only_columns(schema.objects.c.oid))]
        return {"log": cards.log_of(rows, fold=False), "cards": [cards.card_at(rows, n) for n in numbers],
                "bytes": {o: ws.objects.read_all(conn, o) for o in oids}}


@pytest.fixture(scope="module")
def version_9(tmp_path_factory):
    """A version-9 store (``root``) and the snapshot its format-10 original gave."""
    root = tmp_path_factory.mktemp("upgrade10") / "ws"
    ws = _history(root)
    before = snapshot(ws)
    ws.close()
    raw = sqlite3.connect(root / ".stepfs" / "store.db")
    drop_format_10(raw)
    raw.execute("UPDATE meta SET value = '9' WHERE key = 'format_version'")
    raw.commit()
    assert raw.execute("SELECT count(*) FROM objects WHERE length(base) = 16").fetchone()[0] >= 3
    raw.close()
    return root, before


def test_a_version_9_store_is_upgraded_keeping_every_object(version_9, tmp_path):
    root = tmp_path / "ws"
    shutil.copytree(version_9[0], root, symlinks=True)
    with opened_upgraded(root, snapshot, version_9[1]) as ws:
        gc.collect(ws)  # keeps every base a delta names (it may collect unreferenced objects)
        after = snapshot(ws)
        assert after["cards"] == version_9[1]["cards"] and verify.verify(ws).ok
        assert all(version_9[1]["bytes"][o] == b for o, b in after["bytes"].items())
    raw = sqlite3.connect(root / ".stepfs" / "store.db")
    try:
        lengths = {r[0] for r in raw.execute("SELECT length(base) FROM objects WHERE base IS NOT NULL")}
        assert lengths == {baseref.BASE_BYTES}
        assert not raw.execute("PRAGMA foreign_key_list(objects)").fetchall()
    finally:
        raw.close()


@pytest.mark.timeout(300)
def test_the_upgrade_killed_at_every_durable_call_leaves_version_9_or_the_current(version_9, fast_tmp):
    upgrade_killed_at_every_durable_call(version_9[0], fast_tmp, "9", str(schema.FORMAT_VERSION), snapshot,
                                        version_9[1])
