"""The upgrade of a version-10 store to format 11 (a before state that
repeats the path's previous after is a marker, docs/format11.md): the lists
gain markers, the cards and every object read the same, the store
verifies, and a process killed at any durable call of the upgrade leaves a
store that opens as version 10 or 11 with the same history (kernel-free
tier)."""

from __future__ import annotations

import shutil
import sqlite3

import pytest

from crashkit import fast_tmp, opened_upgraded, upgrade_killed_at_every_durable_call  # noqa: F401  (fast_tmp is a fixture)
from stepfs.store import entrylist, gc, schema, verify
from store_kit import drop_format_11
from test_store_upgrade10 import _history, snapshot


def _markers(root) -> int:
    raw = sqlite3.connect(root / ".stepfs" / "store.db")
    try:
        return sum(r[3] is entrylist.PREVIOUS for (data,) in raw.execute("SELECT data FROM layer_entries")
                   for r in entrylist.decode(data))
    finally:
        raw.close()


@pytest.fixture(scope="module")
def version_10(tmp_path_factory):
    """A version-10 store (``root``), the snapshot its format-11 original
    gave and how many markers that original held."""
    root = tmp_path_factory.mktemp("upgrade11") / "ws"
    ws = _history(root)
    before = snapshot(ws)
    ws.close()
    marked = _markers(root)
    raw = sqlite3.connect(root / ".stepfs" / "store.db")
    drop_format_11(raw)
    raw.execute("UPDATE meta SET value = '10' WHERE key = 'format_version'")
    raw.commit()
    raw.close()
    assert marked >= 9 and _markers(root) == 0
    return root, before, marked


def test_a_version_10_store_is_upgraded_with_the_markers_a_writer_makes(version_10, tmp_path):
    root = tmp_path / "ws"
    shutil.copytree(version_10[0], root, symlinks=True)
    with opened_upgraded(root, snapshot, version_10[1]) as ws:
        gc.collect(ws)
        after = snapshot(ws)
        assert after["cards"] == version_10[1]["cards"] and verify.verify(ws).ok
        assert all(version_10[1]["bytes"][o] == b for o, b in after["bytes"].items())
    assert _markers(root) == version_10[2]


@pytest.mark.timeout(300)
def test_the_upgrade_killed_at_every_durable_call_leaves_version_10_or_11(version_10, fast_tmp):
    upgrade_killed_at_every_durable_call(version_10[0], fast_tmp, "10", str(schema.FORMAT_VERSION), snapshot,
                                         version_10[1])
