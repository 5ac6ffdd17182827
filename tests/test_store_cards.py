"""Layer listings and change cards (kernel-free tier)."""

from __future__ import annotations

import pytest

from stepfs.store import cards, layers, publish
from stepfs.store.errors import NoSuchLayer
from store_kit import Stager, open_workspace

TEXT_BEFORE = b"one\ntwo\nthree\n"
TEXT_AFTER = b"one\nTWO\nthree\nfour\n"  # 1 line changed, 1 added: +2 -1
BINARY_BEFORE = b"\x00\x01\x02" * 100
BINARY_AFTER = b"\x00\x01\x02" * 150


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """Layer 1: 2 added, 3 modified (text, binary, mode), 3 deleted (a
    directory with one file, and a text file).  Layer 2: one symlink added."""
    w = open_workspace(tmp_path_factory.mktemp("cards") / "ws", {
        "text": ("file", 0o644, TEXT_BEFORE),
        "blob": ("file", 0o644, BINARY_BEFORE),
        "script": ("file", 0o644, b"#!/bin/sh\n"),
        "gone.txt": ("file", 0o644, b"a\nb\nc\nd\n"),
        "olddir": ("dir", 0o755),
        "olddir/f": ("file", 0o644, b"f\n"),
    })
    st = Stager(w)
    st.file("text", TEXT_AFTER)
    st.file("blob", BINARY_AFTER)
    st.file("script", b"#!/bin/sh\n", mode=0o755)
    st.file("new.txt", b"x\ny\n")
    st.dir("newdir", opaque=True)
    st.whiteout("gone.txt")
    st.whiteout("olddir")
    publish.commit_step(w, st.step, message="first", agent="agent-1", mount="/m", meta={"tool": "edit"})
    st = Stager(w)
    st.symlink("ln", "text")
    publish.commit_step(w, st.step, message="second")
    yield w
    w.close()


def test_list_layers_counts_added_modified_deleted(ws):
    with ws.db.read() as conn:
        listed = layers.list_layers(conn)
    assert [layer.number for layer in listed] == [2, 1, 0]  # newest first
    second, first, baseline = listed
    assert (first.added, first.modified, first.deleted) == (2, 3, 3)
    assert (second.added, second.modified, second.deleted) == (1, 0, 0)
    assert (baseline.added, baseline.modified, baseline.deleted) == (0, 0, 0)
    assert (first.message, first.agent, first.mount, first.meta) == ("first", "agent-1", "/m", {"tool": "edit"})
    assert baseline.kind == "baseline" and first.kind == "step"


def test_list_layers_limit_and_single(ws):
    with ws.db.read() as conn:
        assert [layer.number for layer in layers.list_layers(conn, limit=1)] == [2]
        assert layers.get(conn, 1).number == 1
        with pytest.raises(NoSuchLayer):
            layers.get(conn, 3)
        assert layers.head(conn) == 2


def test_a_limited_or_single_listing_counts_what_the_full_one_does(ws):
    """Only the listed layers' entries are counted: the counts must be the
    same as in a listing of every layer."""
    with ws.db.read() as conn:
        full = {layer.number: layer for layer in layers.list_layers(conn)}
        for limit in (1, 2, 3):
            assert layers.list_layers(conn, limit=limit) == [full[n] for n in sorted(full, reverse=True)[:limit]]
        for number in full:
            assert layers.get(conn, number) == full[number]


def test_log_is_the_cards_of_the_listed_layers(ws):
    with ws.db.read() as conn:
        logged = cards.log(ws.objects, conn)
        assert [c["number"] for c in logged] == [2, 1, 0]
        for c in logged:
            full = cards.card(ws.objects, conn, c["number"])
            assert c == {**full, "files": len(full["files"])}
        assert cards.log(ws.objects, conn, limit=1) == logged[:1]


def test_card_counts_lines_for_text_and_bytes_for_binary(ws):
    with ws.db.read() as conn:
        card = cards.card(ws.objects, conn, 1)
    files = {f["path"]: f for f in card["files"]}
    assert files["text"]["op"] == "modified"
    assert (files["text"]["binary"], files["text"]["lines_added"], files["text"]["lines_removed"]) == (False, 2, 1)
    assert files["blob"]["binary"] is True
    assert (files["blob"]["bytes_before"], files["blob"]["bytes_after"]) == (300, 450)
    assert "lines_added" not in files["blob"]
    assert files["script"]["op"] == "mode"
    assert (files["script"]["lines_added"], files["script"]["lines_removed"]) == (0, 0)
    assert (files["new.txt"]["op"], files["new.txt"]["lines_added"]) == ("added", 2)
    assert (files["gone.txt"]["op"], files["gone.txt"]["lines_removed"]) == ("deleted", 4)
    assert files["olddir/f"]["lines_removed"] == 1
    assert files["olddir"]["kind"] == "dir" and "lines_added" not in files["olddir"]
    assert (card["added"], card["modified"], card["deleted"]) == (2, 3, 3)
    assert (card["lines_added"], card["lines_removed"]) == (2 + 2, 1 + 4 + 1)
    assert (card["message"], card["meta"]) == ("first", {"tool": "edit"})


def test_card_of_a_symlink_has_no_line_counts(ws):
    with ws.db.read() as conn:
        card = cards.card(ws.objects, conn, 2)
    (only,) = card["files"]
    assert (only["path"], only["op"], only["kind"]) == ("ln", "added", "symlink")
    assert "lines_added" not in only and "binary" not in only


def test_card_of_a_missing_layer(ws):
    with ws.db.read() as conn:
        with pytest.raises(NoSuchLayer):
            cards.card(ws.objects, conn, 7)


def test_lines_that_look_like_diff_headers_are_counted(tmp_path):
    """Removed '-- comment' lines and added '++x' lines render as '---' and
    '+++' in a unified diff; they are content, not file headers."""
    w = open_workspace(tmp_path / "ws", {"q.sql": ("file", 0o644, b"-- setup\nselect 1;\n--\n++i;\n")})
    try:
        st = Stager(w)
        st.file("q.sql", b"select 1;\n++ new\n++j;\n")
        publish.commit_step(w, st.step)
        with w.db.read() as conn:
            (card,) = cards.card(w.objects, conn, 1)["files"]
        assert (card["lines_added"], card["lines_removed"]) == (2, 3)
    finally:
        w.close()


def test_large_files_are_not_line_counted(tmp_path, monkeypatch):
    from stepfs.store import records

    monkeypatch.setattr(records, "TEXT_LIMIT", 10)
    w = open_workspace(tmp_path / "ws", {"big": ("file", 0o644, b"1\n2\n3\n4\n5\n6\n")})
    try:
        st = Stager(w)
        st.file("big", b"1\n")
        publish.commit_step(w, st.step)
        with w.db.read() as conn:
            (card,) = cards.card(w.objects, conn, 1)["files"]
        assert card["binary"] is True  # too large to diff: reported by size, like binary content
        assert (card["bytes_before"], card["bytes_after"]) == (12, 2)
    finally:
        w.close()


# -- a .git directory's churn is one line unless asked ---------------------------------


@pytest.fixture(scope="module")
def git_ws(tmp_path_factory):
    """Layer 1: the agent's one real change (app.py) and a `git commit`'s
    worth of objects under .git/ and sub/.git/."""
    w = open_workspace(tmp_path_factory.mktemp("gitcards") / "ws", {"app.py": ("file", 0o644, b"a\n")})
    st = Stager(w)
    st.file("app.py", b"a\nb\n")
    st.dir(".git")
    st.dir(".git/objects")
    for i in range(20):
        st.file(f".git/objects/o{i}", f"object {i}\n".encode())
    st.dir("sub")
    st.dir("sub/.git")
    st.file("sub/.git/HEAD", b"ref: refs/heads/main\n")
    st.file("sub/.gitignore", b"*.pyc\n")
    publish.commit_step(w, st.step, message="git init")
    return w


def test_card_folds_each_git_directory_into_one_entry(git_ws):
    c, patch = cards.read_card(git_ws, 1, with_patch=True)
    assert sorted(f["path"] for f in c["files"]) == ["app.py", "sub", "sub/.gitignore"]
    assert c["folded"] == [
        {"path": ".git/", "files": 22, "added": 22, "modified": 0, "deleted": 0, "renamed": 0},
        {"path": "sub/.git/", "files": 2, "added": 2, "modified": 0, "deleted": 0, "renamed": 0},
    ]
    assert (c["added"], c["modified"], c["lines_added"]) == (2, 1, 2)
    assert "app.py" in patch and ".git/" not in patch.replace(".gitignore", "")


def test_card_and_log_list_everything_when_asked(git_ws):
    c, patch = cards.read_card(git_ws, 1, with_patch=True, fold=False)
    assert c["folded"] == [] and len(c["files"]) == 27
    assert ".git/objects/o7" in patch
    assert cards.read_log(git_ws, fold=False)[0]["files"] == 27


def test_log_counts_leave_git_internals_out(git_ws):
    (row,) = [r for r in cards.read_log(git_ws) if r["number"] == 1]
    assert row["files"] == 3 and row["added"] == 2
    assert [f["path"] for f in row["folded"]] == [".git/", "sub/.git/"]


def test_the_one_renderer_prints_a_folded_directory_as_one_line(git_ws):
    from stepfs.cli.render import card_text

    text = card_text(cards.read_card(git_ws, 1)[0])
    assert "  .git/  +22 files" in text.splitlines()
    assert "objects/o1" not in text
