"""``store.verify`` and ``stepfs verify`` (kernel-free): every kind of damage
is named, a sound store passes, the CLI exits 13 on problems."""

from __future__ import annotations

import json
import sqlite3

import pytest
from dataclasses import replace


from conftest import stepfs
from stepfs.overlayfs.core.view import Overlay
from stepfs.store import keys, schema, verify
from stepfs.store.objects import xxh3_hex
from stepfs.store.workspace import Workspace
from store_kit import rewrite_layer


@pytest.fixture
def store(workspace):
    """A workspace with one committed layer and one staged file."""
    (workspace / "old.txt").write_bytes(b"old\n")
    with Workspace.open(str(workspace), create=True) as ws:
        view = Overlay(ws, "/verify/mnt")
        for path, data in (("/old.txt", b"new\n"), ("/added.txt", b"added\n" * 1000)):
            fh = view.create(path, 0o644)
            view.write(fh, data, 0)
            view.flush(fh)
            view.release(fh)
        assert view.commit("one") == 1
        fh = view.create("/staged.txt", 0o644)
        view.write(fh, b"staged\n", 0)
        view.flush(fh)
        view.release(fh)
    return workspace


def damage(ws_path, sql: str, *params) -> None:
    """Change the store's rows behind stepfs's back (foreign keys off)."""
    # Keys are stored as bytes (format 7, store/keys.py).
    params = tuple(keys.to_db(p) if isinstance(p, str) else p for p in params)
    conn = sqlite3.connect(ws_path / ".stepfs" / "store.db")
    conn.execute(sql, params)
    conn.commit()
    conn.close()


def report(ws_path) -> verify.Report:
    with Workspace.open(str(ws_path)) as ws:
        return verify.verify(ws)


def test_a_sound_store_passes(store):
    r = report(store)
    assert r.ok, r.problems
    assert r.counts["objects"] >= 4 and r.counts["layers"] == 2 and r.counts["staged"] == 1
    result = stepfs("verify", store)
    assert result.returncode == 0 and b"checked" in result.stdout


def test_a_changed_chunk_is_named(store):
    cid = xxh3_hex(b"added\n" * 1000)
    damage(store, "UPDATE chunks SET data = ? WHERE cid = ?", b"Added\n" + b"added\n" * 999, cid)
    problems = report(store).problems
    assert any(f"chunk {cid} is corrupt" in p for p in problems)
    assert any(f"object {cid} contains corrupt chunk" in p for p in problems)


def test_a_missing_object_of_a_layer_is_named(store):
    oid = xxh3_hex(b"new\n")
    damage(store, "DELETE FROM object_chunks WHERE oid = ?", oid)
    damage(store, "DELETE FROM objects WHERE oid = ?", oid)
    problems = report(store).problems
    assert any(f"after object {oid} is missing" in p and "layer 1" in p for p in problems), problems
    # (No foreign key can say it since format 8: entry lists name objects inside a blob.)
    result = stepfs("verify", store, "--json")
    assert result.returncode == 15
    assert json.loads(result.stdout)["ok"] is False
    assert json.loads(result.stderr.splitlines()[-1])["exit_code"] == 15


def test_a_rewritten_committed_layer_is_named(store):
    with Workspace.open(str(store)) as ws, ws.db.write() as conn:
        rewrite_layer(conn, 1, lambda es: [replace(e, after=replace(e.after, mode=0o777)) for e in es])
    assert any("layer 1's entries no longer match" in p for p in report(store).problems)


def test_a_damaged_entry_list_is_named(store):
    damage(store, "UPDATE layer_entries SET data = CAST(? || randomblob(30) AS BLOB) WHERE layer = ?",
           b"\x28\xb5\x2f\xfd", 1)
    problems = report(store).problems
    assert any(p.startswith("layer 1: an entry list does not decode") for p in problems), problems


def test_entry_lists_and_path_layers_that_disagree_are_named(store):
    damage(store, "DELETE FROM path_layers WHERE layer = ? AND path = (SELECT max(path) FROM path_layers)", 1)
    problems = report(store).problems
    assert any("layer 1: path_layers does not list the paths of its entry lists" in p for p in problems), problems


def test_a_wrong_object_size_is_named(store):
    oid = xxh3_hex(b"staged\n")
    damage(store, "UPDATE objects SET size = 3 WHERE oid = ?", oid)
    # Seven bytes are stored inline in the object's row (format 7).
    assert any(f"object {oid} holds 7 bytes inline, 3 recorded" in p for p in report(store).problems)


def test_a_damaged_database_page_is_reported_by_sqlite(store):
    db = store / ".stepfs" / "store.db"
    conn = sqlite3.connect(db)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    page_size = conn.execute("PRAGMA page_size").fetchone()[0]
    root = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = 'conflicts'").fetchone()[0]
    conn.close()
    data = bytearray(db.read_bytes())
    data[(root - 1) * page_size] = 0x00  # not a b-tree page type any more
    db.write_bytes(bytes(data))
    problems = report(store).problems
    # SQLite either lists the damage or refuses to run its check at all.
    assert any(p.startswith("SQLite integrity check:") or "could not check the database's integrity" in p
               for p in problems), problems
    assert any("could not check the references: database disk image is malformed" in p for p in problems)
    result = stepfs("verify", store)
    assert result.returncode == 15 and b"malformed" in result.stdout
