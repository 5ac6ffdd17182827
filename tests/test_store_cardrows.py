"""``log`` and ``show`` read two ways (store/cardrows.py): through the
workspace's SQLAlchemy connection (the daemon, the library) and through a
read-only stdlib sqlite3 connection (the CLI with no mount live).  Both
must give the same cards, the same errors and, through the CLI, the same
bytes; a store that cannot be read as it is goes the workspace's way."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys

import pytest

from stepfs.overlayfs.client import reads
from stepfs.store import cardrows, cards, entryrows, prune, publish
from stepfs.store.errors import LayerPruned, NoSuchLayer
from stepfs.store.keytext import to_db
from stepfs.store.paths import DB_NAME, STORE_DIR
from store_kit import Stager, open_workspace

#: Compressible text (stored zstd), longer than one line-count.
LONG = b"".join(b"line %d of a longer text file\n" % i for i in range(400))


def _history(path):
    """Layers 1-4: text edits, binary, mode, deletion, a rename, a symlink,
    a .git directory's churn, a compressed file; layer 4 is empty."""
    w = open_workspace(path, {
        "text": ("file", 0o644, b"a\nb\nc\n"),
        "blob": ("file", 0o644, b"\0\1\2" * 10),
        "script": ("file", 0o644, b"#!/bin/sh\n"),
        "moved-from": ("file", 0o644, b"content that moves\n"),
        "gone.txt": ("file", 0o644, b"x\ny\n"),
    })
    st = Stager(w)
    st.file("text", b"a\nB\nc\nd\n")
    st.file("blob", b"\0\3" * 40)
    st.file("script", b"#!/bin/sh\n", mode=0o755)
    st.whiteout("gone.txt")
    st.whiteout("moved-from")
    st.file("moved-to", b"content that moves\n")
    st.symlink("ln", "text")
    publish.commit_step(w, st.step, message="first", agent="agent-1", mount="/m", meta={"tool": "edit", "n": 1})
    st = Stager(w)
    st.dir(".git")
    st.file(".git/HEAD", b"ref: refs/heads/main\n")
    st.file(".git/index", b"\0index\0")
    st.file("long.txt", LONG)
    publish.commit_step(w, st.step, message="second, with .git")
    st = Stager(w)
    st.file("long.txt", LONG.replace(b"line 7 ", b"LINE 7 "))
    publish.commit_step(w, st.step, message="third")
    publish.record_empty(w, message="")
    return w


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    w = _history(tmp_path_factory.mktemp("cardrows") / "ws")
    yield w
    w.close()


def _direct(ws, answer):
    out = reads._read_only(ws.path, answer)
    assert out is not None  # the store is readable as it is: the sqlite3 path answered
    return out


@pytest.mark.parametrize("fold", [True, False])
def test_log_is_the_same_either_way(ws, fold):
    through_workspace = cards.read_log(ws, fold=fold)
    assert [c["number"] for c in through_workspace] == [4, 3, 2, 1, 0]
    assert _direct(ws, lambda rows: cards.log_of(rows, fold=fold)) == through_workspace
    assert _direct(ws, lambda rows: cards.log_of(rows, limit=2, fold=fold)) == through_workspace[:2]


@pytest.mark.parametrize("fold", [True, False])
def test_every_card_is_the_same_either_way(ws, fold):
    for number in range(5):
        card, _ = cards.read_card(ws, number, fold=fold)
        assert _direct(ws, lambda rows: cards.card_at(rows, number, fold=fold)) == card
    first = cards.read_card(ws, 1)[0]
    assert {f["path"]: f["op"] for f in first["files"]} == {
        "blob": "modified", "gone.txt": "deleted", "ln": "added", "moved-to": "renamed", "script": "mode",
        "text": "modified"}
    assert cards.read_card(ws, 3)[0]["files"][0]["lines_added"] == 1  # the compressed chunks were read


def test_errors_are_the_same_either_way(ws):
    for number in (9, -1):
        with pytest.raises(NoSuchLayer) as through_workspace:
            cards.read_card(ws, number)
        with pytest.raises(NoSuchLayer) as direct:
            _direct(ws, lambda rows: cards.card_at(rows, number))
        assert str(direct.value) == str(through_workspace.value)


def test_a_pruned_layer_is_named_either_way(tmp_path):
    w = _history(tmp_path / "ws")
    try:
        prune.prune(w, keep_last=2)
        with pytest.raises(LayerPruned) as through_workspace:
            cards.read_card(w, 1)
        with pytest.raises(LayerPruned) as direct:
            _direct(w, lambda rows: cards.card_at(rows, 1))
        assert str(direct.value) == str(through_workspace.value)
        assert _direct(w, cards.log_of) == cards.read_log(w)
    finally:
        w.close()


def test_a_corrupt_chunk_is_counted_as_unreadable_either_way(tmp_path):
    w = _history(tmp_path / "ws")
    w.close()
    db = sqlite3.connect(tmp_path / "ws" / STORE_DIR / DB_NAME)
    [oid] = [e.after.oid for e in entryrows.layer_entries(lambda q, p=(): db.execute(q, p).fetchall(), 1)
             if e.path == b"text"]
    with db:
        # The file is small: its bytes are inline in its object's row (format 7).
        db.execute("UPDATE objects SET data = ?, codec = 0 WHERE oid = ?", (b"a\nX\nc\nd\n", to_db(oid)))
    db.close()
    from stepfs.store.workspace import Workspace

    with Workspace.open(str(tmp_path / "ws")) as w:
        logged = cards.read_log(w)
        assert [c.get("unreadable") for c in logged if c["number"] == 1] == [1]
        assert _direct(w, cards.log_of) == logged


def test_stores_that_need_the_workspace_are_left_to_it(tmp_path, monkeypatch):
    w = _history(tmp_path / "ws")
    w.close()
    ws = str(tmp_path / "ws")
    session = cardrows.open_readonly(ws)
    assert session is not None
    with session as rows:
        assert rows.layer(1).message == "first"
    # Another format than the queries were written for.
    monkeypatch.setattr(cardrows, "FORMATS", frozenset({5}))
    assert cardrows.open_readonly(ws) is None
    monkeypatch.undo()
    # A pending layer: recovery must run first, and it writes.
    db = sqlite3.connect(tmp_path / "ws" / STORE_DIR / DB_NAME)
    with db:
        db.execute("INSERT INTO layers (number, state, kind, created_ns, message, agent, mount, meta, intent_sum) "
                   "VALUES (99, 'pending', 'step', 0, '', '', '', '{}', 'x')")
    assert cardrows.open_readonly(ws) is None
    with db:
        db.execute("DELETE FROM layers WHERE number = 99")
    db.close()
    assert cardrows.open_readonly(ws) is not None
    # No store, or a store directory that is a symlink: never read through it.
    assert cardrows.open_readonly(str(tmp_path)) is None
    os.rename(tmp_path / "ws" / STORE_DIR, tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", tmp_path / "ws" / STORE_DIR)
    assert cardrows.open_readonly(ws) is None


def _cli(*args, through_workspace: bool) -> subprocess.CompletedProcess:
    """``stepfs ARGS`` in a fresh interpreter; ``through_workspace`` empties
    the formats the sqlite3 path reads, so the CLI opens the workspace."""
    force = "import stepfs.store.cardrows as c; c.FORMATS = frozenset()\n" if through_workspace else ""
    code = f"import sys\n{force}from stepfs.cli.main import main\nsys.exit(main({[str(a) for a in args]!r}))\n"
    env = {k: v for k, v in os.environ.items() if k != "STEPFS_DIRECT"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60, env=env)


def test_the_cli_prints_the_same_bytes_either_way(ws):
    for args in (("log",), ("log", "--json"), ("log", "--limit", "2"), ("log", "--all"), ("show", "1"),
                 ("show", "1", "--json"), ("show", "2"), ("show", "2", "--all", "--json"), ("show", "3"),
                 ("show", "9"), ("show", "9", "--json")):
        argv = (args[0], ws.path, *args[1:])
        direct, through_workspace = _cli(*argv, through_workspace=False), _cli(*argv, through_workspace=True)
        assert (direct.returncode, direct.stdout, direct.stderr) == \
            (through_workspace.returncode, through_workspace.stdout, through_workspace.stderr), args
        assert direct.returncode == (11 if "9" in args else 0), direct.stderr
