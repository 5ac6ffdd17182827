"""Issue 18 item 4: a staged path whose directory was replaced outside
stepfs by a symlink (to somewhere outside) is an outside change: the
commit leaves it, records an ``outside-change`` conflict, commits the rest,
and the store stays usable.  Decoys live in temp dirs."""

from __future__ import annotations

import json
import os
import shutil

from sqlalchemy import select

from conftest import stepfs
from history_helpers import open_ws, read, write
from stepfs.store import layers, schema
from stepfs.store.layers import Entry, State
from stepfs.store.publish import OUTSIDE_CHANGE, classify
from stepfs.store.workspace import Workspace


def _conflicts(ws):
    with ws.db.read() as conn:
        return [(r.path, r.reason) for r in conn.execute(select(schema.conflicts))]


def test_overwrite_through_a_symlinked_directory_commits_the_rest(tmp_path):
    ws_path = tmp_path / "ws"
    (ws_path / "d").mkdir(parents=True)
    (ws_path / "d" / "f").write_text("old\n")
    (ws_path / "g").write_text("g1\n")
    outside = tmp_path / "outside"
    ws, view = open_ws(ws_path)
    try:
        write(view, "d/f", b"new\n")
        write(view, "g", b"g2\n")
        os.rename(ws_path / "d", outside)
        os.symlink(outside, ws_path / "d")
        number = view.commit(message="over", overwrite={b"d/f"})
        assert number == 1
        assert _conflicts(ws) == [(b"d/f", OUTSIDE_CHANGE)]
        with ws.db.read() as conn:
            assert [e.path for e in layers.entries(conn, 1)] == [b"g"]
    finally:
        ws.close()
    assert (outside / "f").read_text() == "old\n"  # nothing written through the link
    assert (ws_path / "g").read_text() == "g2\n"
    for argv in (("log", ws_path), ("verify", ws_path), ("status", ws_path)):
        r = stepfs(*argv)
        assert r.returncode == 0, (argv, r.stderr)
    status = json.loads(stepfs("status", ws_path, "--json").stdout)
    assert [c["reason"] for c in status["conflicts"]] == [OUTSIDE_CHANGE]

    # Repaired by hand: the next layer sees d/f as it is, modified, not added.
    os.unlink(ws_path / "d")
    os.rename(outside, ws_path / "d")
    ws, view = open_ws(ws_path)
    try:
        assert read(view, "d/f") == b"old\n"
        write(view, "d/f", b"newer\n")
        assert view.commit(message="after the repair") == 2
        with ws.db.read() as conn:
            (entry,) = layers.entries(conn, 2)
        assert entry.path == b"d/f" and entry.op == "modified" and entry.before.kind == "file"
    finally:
        ws.close()


def test_a_step_that_only_goes_through_the_link_says_so(tmp_path):
    ws_path = tmp_path / "ws"
    (ws_path / "d").mkdir(parents=True)
    (ws_path / "d" / "f").write_text("old\n")
    outside = tmp_path / "outside"
    ws, view = open_ws(ws_path)
    try:
        write(view, "d/f", b"new\n")
        os.rename(ws_path / "d", outside)
        os.symlink(outside, ws_path / "d")
        from stepfs.store.errors import NothingToCommit

        try:
            view.commit(message="x", overwrite={b"d/f"})
            raise AssertionError("committed through a symlink")
        except NothingToCommit as exc:
            assert "outside-change" in str(exc) and "d/f" in str(exc)
        assert _conflicts(ws) == [(b"d/f", OUTSIDE_CHANGE)]
    finally:
        ws.close()
    assert (outside / "f").read_text() == "old\n"


def test_recovery_leaves_a_pending_path_below_a_symlink(tmp_path):
    """A pending layer (as an older stepfs could leave one) whose path now
    lies below a symlink: classify leaves it instead of failing the
    recovery on ELOOP for ever."""
    ws_path = tmp_path / "ws"
    (ws_path / "d").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    with Workspace.open(str(ws_path), create=True) as ws:
        os.rmdir(ws_path / "d")
        os.symlink(outside, ws_path / "d")
        with ws.db.write() as conn:
            oid = ws.objects.put_bytes(conn, b"x\n")
        entries = [Entry(b"d/f", State(None), State("file", 0o644, oid)), Entry(b"e", State(None), State("file", 0o644, oid))]
        with ws.db.read() as conn:
            left = classify(ws, conn, entries)
        assert set(left) == {b"d/f"} and "not a directory" in left[b"d/f"]
    shutil.rmtree(outside)
