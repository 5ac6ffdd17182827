"""The upgrade of a version-6 store to format 7 (and on to 8) (binary keys, inline
objects, tables without rowid): every layer, staged row and conflict
survives with its bytes, keys come back as the same hex ids, and the new
store verifies (kernel-free tier)."""

from __future__ import annotations

import sqlite3

from sqlalchemy import select

from stepfs.store import gc, publish, schema, staging, verify
from stepfs.store.layers import entries as load_entries
from stepfs.store.workspace import Workspace
from store_kit import Stager, drop_format_7, open_workspace


def text(seed: int, n: int = 3000) -> bytes:
    return b"".join(b"line %d of file %d: some words to make it text\n" % (i, seed) for i in range(n))


def snapshot(ws) -> dict:
    with ws.db.read() as conn:
        out = {}
        for number in conn.execute(select(schema.layers.c.number)).scalars():
            for e in load_entries(conn, number):
                for state in (e.before, e.after):
                    if state.oid:
                        out[(number, e.path, state.oid)] = ws.objects.read_all(conn, state.oid)
        for oid in conn.execute(select(schema.staged.c.oid).where(schema.staged.c.oid.is_not(None))).scalars():
            out[("staged", oid)] = ws.objects.read_all(conn, oid)
        for oid in conn.execute(select(schema.conflicts.c.oid)).scalars():
            out[("conflict", oid)] = ws.objects.read_all(conn, oid)
        return out


def test_a_version_6_store_is_upgraded_keeping_every_byte(tmp_path):
    root = tmp_path / "ws"
    ws = open_workspace(root, {"big": ("file", 0o644, text(1)), "small": ("file", 0o644, b"tiny\n")})
    s = Stager(ws)
    s.file("big", text(1) + b"one more line\n")
    s.file("small", b"tinier\n")
    s.file("new", text(2))
    publish.commit_step(ws, s.step, message="m", agent="a", mount="/m", overwrite={r.path for r in s.rows()})
    s.file("staged", b"an open step's small file\n")
    s.file("doomed", text(3))
    with ws.db.write() as conn:
        staging.discard(conn, s.step, b"doomed", mount="/m")
    before = snapshot(ws)
    assert any(len(v) <= 2048 for v in before.values()) and any(len(v) > 2048 for v in before.values())
    ws.close()

    db = root / ".stepfs" / "store.db"
    raw = sqlite3.connect(db)
    drop_format_7(raw)  # the tables as a version-6 stepfs wrote them
    raw.execute("UPDATE meta SET value = '6' WHERE key = 'format_version'")
    raw.commit()
    assert {r[1] for r in raw.execute("PRAGMA table_info(objects)")} == {"oid", "size", "gen"}
    assert raw.execute("SELECT typeof(oid), length(oid) FROM objects LIMIT 1").fetchone() == ("text", 32)
    raw.close()

    ws = Workspace.open(str(root))
    try:
        with ws.db.read() as conn:
            assert conn.execute(select(schema.meta.c.value).where(schema.meta.c.key == "format_version")).scalar() == str(schema.FORMAT_VERSION)
        assert snapshot(ws) == before
        report = verify.verify(ws)
        assert report.ok, report.problems
        # New content goes inline once upgraded; gc still works across both forms.
        s2 = Stager(ws)
        s2.file("small", b"upgraded and small\n")
        with ws.db.read() as conn:
            assert conn.execute(select(schema.objects.c.data).where(schema.objects.c.data.is_not(None))).first()
        gc.collect(ws)
        assert verify.verify(ws).ok
        assert snapshot(ws).items() >= {k: v for k, v in before.items() if k[0] == "conflict"}.items()
    finally:
        ws.close()
    raw = sqlite3.connect(db)
    try:
        assert raw.execute("SELECT typeof(oid), length(oid) FROM objects LIMIT 1").fetchone() == ("blob", 16)
        tables = {name: sql for name, sql in raw.execute("SELECT name, sql FROM sqlite_master WHERE type = 'table'")}
        assert not any(name.startswith("v6_") for name in tables)
        for name in ("objects", "object_chunks", "path_layers"):  # through 7 to 8
            assert "WITHOUT ROWID" in tables[name]
        assert "entries" not in tables
        indexes = {r[0] for r in raw.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
        assert {"chunks_base", "object_chunks_cid"} <= indexes and "entries_path_layer" not in indexes
        assert raw.execute("PRAGMA foreign_key_check").fetchall() == []
    finally:
        raw.close()
