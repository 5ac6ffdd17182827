"""prune: folding dropped layers into the oldest kept one (kernel-free)."""

from __future__ import annotations

import os

import pytest
from sqlalchemy import select

from conftest import manifest
from stepfs.store import entrytable, gc, history, prune, publish, rollback, schema, verify
from stepfs.store.errors import InputError, LayerPruned, NothingToRollBack
from stepfs.store.workspace import Workspace
from store_kit import Stager, open_workspace


def check(ws) -> None:
    report = verify.verify(ws)
    assert report.ok, report.problems


def body(i: int, n: int = 400) -> bytes:
    return b"".join(b"version %d line %d\n" % (i, k) for k in range(n))


def build_history(path) -> tuple[Workspace, dict[int, dict]]:
    """Nine layers of edits, creations, deletions, a directory made and
    removed, a symlink; returns the workspace and the tree after each."""
    ws = open_workspace(path, {"a.txt": ("file", 0o644, body(0)), "d": ("dir", 0o755),
                               "d/x": ("file", 0o600, b"x0\n")})
    trees = {0: manifest(path)}
    for i in range(1, 10):
        s = Stager(ws)
        s.file("a.txt", body(i))
        if i % 3 == 0:
            s.file(f"new{i}", b"made in %d\n" % i)
        if i == 4:
            s.whiteout("new3")
            s.dir("e")
            s.file("e/y", b"y\n")
            s.symlink("link", "a.txt")
        if i == 5:
            s.file("temp", b"made and removed\n")
        if i == 6:
            s.whiteout("temp")
            s.file("d/x", b"x6\n", mode=0o644)
        if i == 8:
            s.whiteout("e/y")
            s.whiteout("e")
        n = publish.commit_step(ws, s.step, message=f"step {i}", overwrite={r.path for r in s.rows()})
        assert n == i
        trees[i] = manifest(path)
    return ws, trees


def snapshot_files(ws, number: int) -> dict[bytes, bytes]:
    """Every file's bytes as of ``number``, read from history (not the disk)."""
    out = {}
    with ws.db.read() as conn:
        rows = entrytable.all_rows(conn)
        paths = sorted({bytes(r.path) for r in rows})
        for p in paths:
            state = history.state_at(conn, p, number)
            if state is not None and state.kind == "file":
                out[p] = ws.objects.read_all(conn, state.oid)
    return out


@pytest.mark.parametrize("keep_last", [1, 3, 6])
def test_prune_keeps_every_kept_layer_exactly(tmp_path, keep_last):
    path = tmp_path / "ws"
    ws, trees = build_history(path)
    keep_from = 10 - keep_last
    before = {n: snapshot_files(ws, n) for n in range(keep_from, 10)}
    with ws.db.read() as conn:
        assert prune.choose(conn, keep_last=keep_last) == keep_from
    result = prune.prune(ws, keep_last=keep_last)
    assert result.keep_from == keep_from and result.pruned == list(range(keep_from))
    check(ws)
    gc.collect(ws)
    check(ws)
    for n in range(keep_from, 10):
        assert snapshot_files(ws, n) == before[n]
    for n in range(keep_from):
        with pytest.raises(LayerPruned, match=f"layer {n} was pruned; the oldest layer kept is {keep_from}"):
            with ws.db.read() as conn:
                history.require_layer(conn, n)
        with pytest.raises(LayerPruned, match=f"cannot roll back to layer {n}"):
            rollback.rollback(ws, n)
    # Roll back to every kept layer, newest first, then forward again.
    for n in sorted(range(keep_from, 10), reverse=True):
        try:
            rollback.rollback(ws, n)
        except NothingToRollBack:
            assert manifest(path) == trees[n]
        assert manifest(path) == trees[n], n
        check(ws)
    ws.close()


def test_prune_then_more_steps_and_a_second_prune(tmp_path):
    path = tmp_path / "ws"
    ws, trees = build_history(path)
    prune.prune(ws, keep_last=5)
    s = Stager(ws)
    s.file("a.txt", body(10))
    assert publish.commit_step(ws, s.step, overwrite={b"a.txt"}) == 10  # numbers go on
    trees[10] = manifest(path)
    result = prune.prune(ws, keep_last=2)
    assert result.keep_from == 9 and result.pruned == [5, 6, 7, 8]
    gc.collect(ws)
    check(ws)
    rollback.rollback(ws, 9)
    assert manifest(path) == trees[9]
    with ws.db.read() as conn:
        states = dict(conn.execute(select(schema.layers.c.number, schema.layers.c.state)).all())
    assert [n for n, s in states.items() if s == "pruned"] == list(range(9))
    ws.close()


def test_prune_and_gc_give_space_back(tmp_path):
    path = tmp_path / "ws"
    ws = open_workspace(path)
    for i in range(1, 8):
        s = Stager(ws)
        s.file("blob", os.urandom(300_000))
        publish.commit_step(ws, s.step, overwrite={b"blob"})
    gc.collect(ws)
    size = gc.store_bytes(ws)
    with ws.db.read() as conn:
        assert prune.referenced_bytes(conn, 6) < prune.referenced_bytes(conn, 1)
    prune.prune(ws, keep_last=2)
    report = gc.collect(ws)
    assert report.objects == 5  # versions 1..5 (version 6 is the kept layer's before state)
    assert gc.store_bytes(ws) < size - 1_000_000
    check(ws)
    ws.close()


def test_keep_within_and_max_size_choose_the_oldest_kept_layer(tmp_path):
    path = tmp_path / "ws"
    ws, _trees = build_history(path)
    with ws.db.read() as conn:
        created = dict(conn.execute(select(schema.layers.c.number, schema.layers.c.created_ns)).all())
        now = created[9] + 1
        assert prune.choose(conn, keep_within_ns=now - created[6], now_ns=now) == 6
        assert prune.choose(conn, keep_within_ns=1, now_ns=now + 10**12) == 9  # the head always stays
        assert prune.choose(conn, keep_last=20) is None
        assert prune.choose(conn, keep_last=2, keep_within_ns=now - created[5], now_ns=now) == 5  # either rule keeps
        everything = prune.referenced_bytes(conn, 0)
        assert prune.choose(conn, max_size=10**12) is None
        small = prune.choose(conn, max_size=1)
        assert small == 9  # nothing fits: only the head stays
        assert prune.referenced_bytes(conn, 9) < everything
        with pytest.raises(InputError, match="at least 1"):
            prune.choose(conn, keep_last=0)
    ws.close()


@pytest.mark.parametrize("text,value", [("2G", 2 << 30), ("500m", 500 << 20), ("1.5KiB", 1536), ("1024", 1024)])
def test_parse_size(text, value):
    assert prune.parse_size(text) == value


@pytest.mark.parametrize("text,value", [("7d", 7 * 86400 * 10**9), ("12h", 12 * 3600 * 10**9), ("30s", 30 * 10**9)])
def test_parse_duration(text, value):
    assert prune.parse_duration(text) == value


@pytest.mark.parametrize("bad", ["", "2X", "-1G", "G"])
def test_parse_size_refuses(bad):
    with pytest.raises(InputError, match="is not a size"):
        prune.parse_size(bad)


def test_prune_without_a_rule_is_refused(tmp_path):
    ws = open_workspace(tmp_path / "ws")
    with pytest.raises(InputError, match="say what to keep"):
        prune.prune(ws)
    ws.close()


def links_manifest(root) -> dict:
    """``manifest`` plus, for every file, the other names of its inode."""
    tree = manifest(root)
    by_inode: dict[tuple, list[bytes]] = {}
    for rel, (kind, _mode, _data) in tree.items():
        if kind == "file":
            st = os.lstat(os.path.join(os.fsencode(str(root)), rel))
            by_inode.setdefault((st.st_dev, st.st_ino), []).append(rel)
    names = {rel: tuple(sorted(set(group) - {rel})) for group in by_inode.values() for rel in group}
    return {rel: (*entry, names.get(rel, ())) for rel, entry in tree.items()}


@pytest.mark.parametrize("keep_last", [2, 3])
def test_prune_keeps_hard_links_for_every_kept_layer(tmp_path, keep_last):
    """A hard-linked pair made in a layer that prune folds away comes back
    as one inode when rolling back to every kept layer (the folded layer
    keeps its ``after_link``); a pair whose partner was replaced later
    does not."""
    from stepfs.store import staging

    path = tmp_path / "ws"
    ws = open_workspace(path, {"a.txt": ("file", 0o644, body(0))})
    trees = {0: links_manifest(path)}

    def linked(s: Stager, names: list[str], data: bytes, group: int) -> None:
        with ws.db.write() as conn:
            oid = ws.objects.put_bytes(conn, data)
            for name in names:
                staging.put(conn, s.step, staging.StagedRow(
                    os.fsencode(name), "file", 0o100644, oid, None, len(data), 1_600_000_000_000_000_000,
                    False, "absent", link_group=group))

    for i in range(1, 6):
        s = Stager(ws)
        s.file("a.txt", body(i))
        if i == 1:
            linked(s, ["h1", "h2"], b"one inode, two names\n" * 100, 1)
            linked(s, ["p1", "p2"], b"a pair split later\n" * 100, 2)
        if i == 2:
            s.file("p2", b"p2 on its own\n")  # replaces one name: the pair is split from here on
        if i == 5:
            s.whiteout("h1")
            s.whiteout("h2")
        assert publish.commit_step(ws, s.step, message=f"step {i}", overwrite={r.path for r in s.rows()}) == i
        trees[i] = links_manifest(path)
    assert trees[1][b"h1"][3] == (b"h2",) and trees[1][b"p1"][3] == (b"p2",)
    assert trees[4][b"h1"][3] == (b"h2",) and trees[4][b"p1"][3] == ()
    keep_from = 6 - keep_last
    prune.prune(ws, keep_last=keep_last)
    gc.collect(ws)
    check(ws)
    for n in sorted(range(keep_from, 6), reverse=True):
        try:
            rollback.rollback(ws, n)
        except NothingToRollBack:
            pass
        assert links_manifest(path) == trees[n], n
        check(ws)
    ws.close()
