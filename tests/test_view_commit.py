"""Committing the open step from the view (no kernel): the workspace on
disk becomes what the view showed."""

from __future__ import annotations

import os

import pytest

from conftest import manifest
from store import staging
from store.errors import NothingToCommit
from viewkit import open_view, read_all, read_fh, view_manifest, write_file


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
