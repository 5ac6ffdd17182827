"""Committing the open step from the view (no kernel): the workspace on
disk becomes what the view showed."""

from __future__ import annotations

import os

import pytest

from conftest import manifest
from stepfs.store import staging
from stepfs.store.errors import NothingToCommit
from viewkit import open_view, orphan_scratch, read_all, read_fh, view_manifest, write_file


@pytest.fixture
def ws_view(tmp_path):
    ws_dir = tmp_path / "ws"
    (ws_dir / "a" / "b").mkdir(parents=True)
    (ws_dir / "a" / "b" / "deep.txt").write_bytes(b"deep\n")
    (ws_dir / "a" / "x.txt").write_bytes(b"x\n")
    (ws_dir / "keep").write_bytes(b"keep\n")
    (ws_dir / "tool.sh").write_bytes(b"#!/bin/sh\n")
    os.symlink("keep", ws_dir / "ln")
    return open_view(tmp_path)


def rows(ws, view):
    with ws.db.read() as conn:
        return staging.load(conn, view.step)


def test_commit_makes_the_workspace_equal_the_view(ws_view):
    ws, view = ws_view
    write_file(view, "/new.txt", b"new\n")
    view.chmod("/tool.sh", 0o755)
    view.unlink("/a/x.txt")
    view.rename("/a", "/z")
    view.mkdir("/z/b/c", 0o700)
    write_file(view, "/z/b/c/f", b"\0" * 5000 + b"end")
    view.unlink("/ln")
    view.symlink("/ln", "new.txt")
    view.truncate("/keep", 2)
    expected = view_manifest(view)
    number = view.commit(message="first")
    assert number == 1
    assert manifest(ws.path) == expected
    assert view_manifest(view) == expected
    assert len(view.upper) == 0
    assert rows(ws, view) == []
    assert orphan_scratch(view) == []  # idle drafts may stay (a cache); nothing leaks
    write_file(view, "/keep", b"second\n")
    assert view.commit(message="second") == 2
    assert manifest(ws.path)[b"keep"] == ("file", 0o644, b"second\n")
    # What the view kept of committed files never hides the workspace: an
    # editor's change after the commit shows through at once.
    with open(os.path.join(ws.path, "new.txt"), "wb") as f:
        f.write(b"edited outside\n")
    assert read_all(view, "/new.txt") == b"edited outside\n"
    assert read_all(view, "/keep") == b"second\n"


def test_nothing_to_commit(ws_view):
    ws, view = ws_view
    with pytest.raises(NothingToCommit):
        view.commit(message="empty")
    # Changes that end where they started are nothing too.
    view.chmod("/keep", 0o644)
    write_file(view, "/tool.sh", b"#!/bin/sh\n")
    write_file(view, "/tmp-file", b"t")
    view.unlink("/tmp-file")
    with pytest.raises(NothingToCommit):
        view.commit(message="no-ops")
    assert len(view.upper) == 0 and rows(ws, view) == []
    assert view.commit(message="forced", allow_empty=True) == 1


def test_file_open_for_writing_during_a_commit_lands_in_the_next_step(ws_view):
    ws, view = ws_view
    fh = view.open("/keep", os.O_RDWR)
    view.write(fh, b"KEEP", 0)
    view.flush(fh)                      # staged: "KEEP\n"
    view.write(fh, b"-more", 5)         # not yet closed
    write_file(view, "/other", b"o")
    assert view.commit(message="one") == 1
    assert manifest(ws.path)[b"keep"][2] == b"KEEP\n"
    assert view.staged_paths() == []  # the unclosed writes are in no step yet
    assert rows(ws, view) == []
    assert read_fh(view, fh) == b"KEEP\n-more"
    # The writing agent sees its own unclosed bytes; another agent sees the layer.
    assert read_all(view, "/keep") == b"KEEP\n-more"
    fh_other = view.open("/keep", os.O_RDONLY, agent="other")
    assert read_fh(view, fh_other) == b"KEEP\n"
    view.release(fh_other)
    view.flush(fh)
    assert [(r.path, r.kind) for r in rows(ws, view)] == [(b"keep", "file")]
    view.release(fh)
    assert view.commit(message="two") == 2
    assert manifest(ws.path)[b"keep"][2] == b"KEEP\n-more"
    assert len(view.upper) == 0


def test_file_open_but_unchanged_after_a_commit_leaves_nothing_staged(ws_view):
    ws, view = ws_view
    fh = view.open("/keep", os.O_RDWR)
    view.write(fh, b"K", 0)
    view.flush(fh)
    view.commit(message="one")
    view.flush(fh)   # a second close of a dup'ed descriptor: nothing new
    view.release(fh)
    assert len(view.upper) == 0 and rows(ws, view) == []
    assert read_all(view, "/keep") == b"Keep\n"
    with pytest.raises(NothingToCommit):
        view.commit(message="two")


def test_created_file_open_during_a_commit(ws_view):
    ws, view = ws_view
    fh = view.create("/fresh", 0o640, os.O_RDWR | os.O_CREAT)
    view.write(fh, b"fresh", 0)
    write_file(view, "/other", b"o")
    view.commit(message="without fresh")
    assert b"fresh" not in manifest(ws.path)
    assert read_all(view, "/fresh") == b"fresh"
    view.flush(fh)
    view.release(fh)
    view.commit(message="with fresh")
    assert manifest(ws.path)[b"fresh"] == ("file", 0o640, b"fresh")


def test_commit_replaces_directories_files_and_symlinks(ws_view):
    ws, view = ws_view
    # a directory becomes a file, a file becomes a directory, a symlink a directory
    view.unlink("/a/b/deep.txt")
    view.rmdir("/a/b")
    write_file(view, "/a/b", b"now a file")
    view.unlink("/keep")
    view.mkdir("/keep", 0o755)
    write_file(view, "/keep/inside", b"in")
    view.unlink("/ln")
    view.mkdir("/ln", 0o755)
    write_file(view, "/ln/inside", b"in ln")
    # a directory with children becomes a symlink
    view.unlink("/a/x.txt")
    view.unlink("/a/b")
    view.rmdir("/a")
    view.symlink("/a", "keep")
    expected = view_manifest(view)
    assert expected[b"a"] == ("symlink", None, b"keep")
    view.commit(message="kinds")
    assert manifest(ws.path) == expected


# -- before states captured ahead (publish.precapture) ------------------------------


def _before_bytes(ws, layer: int, path: bytes) -> bytes:
    from stepfs.store.layers import entries

    with ws.db.read() as conn:
        entry = next(e for e in entries(conn, layer) if e.path == path)
        return ws.objects.read_all(conn, entry.before.oid)


def test_a_staged_workspace_file_is_captured_ahead_and_the_commit_only_checks_its_token(ws_view, monkeypatch):
    from stepfs.store import plan, tokens

    ws, view = ws_view
    monkeypatch.setattr(tokens, "RACY_WINDOW_NS", 0)  # the fixture's files are older than the racy window
    write_file(view, "/keep", b"changed\n")
    assert b"keep" in view.precaptured
    captured = []
    real_capture = plan.capture
    monkeypatch.setattr(plan, "capture", lambda ws_, conn, path: captured.append(path) or real_capture(ws_, conn, path))
    assert view.commit(message="reuses the capture") == 1
    assert captured == []  # not read again at the commit
    assert _before_bytes(ws, 1, b"keep") == b"keep\n"
    assert manifest(ws.path)[b"keep"][2] == b"changed\n"
    assert view.precaptured == {}  # its tokens are gone with the commit


def test_a_file_changed_outside_after_its_capture_ahead_is_captured_again(ws_view, monkeypatch):
    from stepfs.store import tokens
    from stepfs.store.errors import CommitConflict

    ws, view = ws_view
    monkeypatch.setattr(tokens, "RACY_WINDOW_NS", 0)
    write_file(view, "/keep", b"changed\n")
    assert b"keep" in view.precaptured
    with open(os.path.join(ws.path, "keep"), "wb") as f:
        f.write(b"edited outside, longer\n")
    with pytest.raises(CommitConflict):
        view.commit(message="refused: the workspace file changed")
    assert view.commit(message="over it", overwrite={b"keep"}) == 1
    # The before state is what the workspace held at the commit, not the capture.
    assert _before_bytes(ws, 1, b"keep") == b"edited outside, longer\n"


def test_files_inside_the_racy_window_or_too_big_are_not_captured_ahead(ws_view, monkeypatch):
    from stepfs.store import plan

    from stepfs.store import tokens

    ws, view = ws_view
    # Written by the fixture just now: racy (the window made to cover a busy
    # machine's slow set-up too).
    monkeypatch.setattr(tokens, "RACY_WINDOW_NS", 3600 * 10**9)
    write_file(view, "/keep", b"changed\n")
    assert view.precaptured == {}
    monkeypatch.setattr(tokens, "RACY_WINDOW_NS", 0)
    monkeypatch.setattr(plan, "PRECAPTURE_MAX", len(b"x\n"))
    write_file(view, "/a/x.txt", b"bigger now\n")
    assert view.precaptured == {}
    assert view.commit(message="captured at the commit") == 1
    assert _before_bytes(ws, 1, b"keep") == b"keep\n"
    assert _before_bytes(ws, 1, b"a/x.txt") == b"x\n"
