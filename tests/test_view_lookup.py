"""Lookup precedence of the overlay view (no kernel): workspace below, the
open step above, whiteouts and opaque directories, the ``.stepfs`` tree."""

from __future__ import annotations

import os
import stat as stat_mod

import pytest

from stepfs.overlayfs.core.errors import Exists, NotFound, ReadOnly, Reserved
from stepfs.store import staging
from viewkit import open_view, read_all, view_manifest, write_file


@pytest.fixture
def ws_view(tmp_path):
    ws_dir = tmp_path / "ws"
    (ws_dir / "src").mkdir(parents=True)
    (ws_dir / "src" / "a.py").write_bytes(b"print('a')\n")
    (ws_dir / "src" / "b.py").write_bytes(b"print('b')\n")
    (ws_dir / "README").write_bytes(b"readme\n")
    os.symlink("src/a.py", ws_dir / "link")
    return open_view(tmp_path)


def names(view, path):
    return [n for n, _k, _i in view.readdir(path)[2:]]


def test_workspace_files_are_visible(ws_view):
    ws, view = ws_view
    assert names(view, "/") == ["README", "link", "src"]
    assert names(view, "/src") == ["a.py", "b.py"]
    assert read_all(view, "/src/a.py") == b"print('a')\n"
    st = view.getattr("/src/a.py")
    assert stat_mod.S_ISREG(st["st_mode"]) and st["st_size"] == 11
    assert st["st_ino"] == os.lstat(os.path.join(ws.path, "src/a.py")).st_ino
    assert view.readlink("/link") == "src/a.py"
    with pytest.raises(NotFound):
        view.getattr("/missing")
    with pytest.raises(NotFound):
        view.getattr("/README/below-a-file")


def test_upper_wins_over_workspace(ws_view):
    ws, view = ws_view
    write_file(view, "/src/a.py", b"staged\n")
    assert read_all(view, "/src/a.py") == b"staged\n"
    assert view.getattr("/src/a.py")["st_size"] == 7
    with open(os.path.join(ws.path, "src/a.py"), "rb") as f:
        assert f.read() == b"print('a')\n"


def test_whiteout_hides_workspace_path(ws_view):
    ws, view = ws_view
    view.unlink("/src/a.py")
    assert names(view, "/src") == ["b.py"]
    with pytest.raises(NotFound):
        view.getattr("/src/a.py")
    with pytest.raises(NotFound):
        view.open("/src/a.py", os.O_RDONLY)
    assert os.path.exists(os.path.join(ws.path, "src/a.py"))
    with ws.db.read() as conn:
        rows = {r.path: r.kind for r in staging.load(conn, view.step)}
    assert rows == {b"src/a.py": "whiteout"}


def test_opaque_directory_hides_workspace_children(ws_view):
    ws, view = ws_view
    view.unlink("/src/a.py")
    view.unlink("/src/b.py")
    view.rmdir("/src")
    view.mkdir("/src", 0o755)
    assert names(view, "/src") == []
    with pytest.raises(NotFound):
        view.getattr("/src/b.py")
    write_file(view, "/src/c.py", b"c")
    assert names(view, "/src") == ["c.py"]
    # The workspace still holds the old children until a commit.
    assert sorted(os.listdir(os.path.join(ws.path, "src"))) == ["a.py", "b.py"]


def test_store_directory_is_hidden_but_reachable(ws_view):
    ws, view = ws_view
    assert ".stepfs" not in names(view, "/")
    st = view.getattr("/.stepfs")
    assert stat_mod.S_ISDIR(st["st_mode"])
    assert names(view, "/.stepfs") == ["conflicts", "layers", "status"]
    write_file(view, "/new", b"x")
    text = read_all(view, "/.stepfs/status").decode()
    assert f"step: {view.step}" in text
    assert "A /new" in text
    assert view.getattr("/.stepfs/status")["st_size"] == len(text.encode())
    # The store itself never shows through.
    assert ".stepfs" not in view_manifest(view)


def test_store_tree_is_read_only(ws_view):
    _ws, view = ws_view
    with pytest.raises(ReadOnly):
        view.open("/.stepfs/status", os.O_WRONLY)
    with pytest.raises(ReadOnly):
        view.open("/.stepfs/status", os.O_RDONLY | os.O_TRUNC)
    with pytest.raises(ReadOnly):
        view.create("/.stepfs/new", 0o644)
    with pytest.raises(ReadOnly):
        view.mkdir("/.stepfs/d", 0o755)
    with pytest.raises(ReadOnly):
        view.unlink("/.stepfs/status")
    with pytest.raises(ReadOnly):
        view.truncate("/.stepfs/status", 0)
    with pytest.raises(ReadOnly):
        view.chmod("/.stepfs/status", 0o777)
    with pytest.raises(ReadOnly):
        view.rename("/.stepfs/status", "/stolen")
    with pytest.raises(ReadOnly):
        view.rename("/README", "/.stepfs/status")
    with pytest.raises(ReadOnly):
        view.symlink("/.stepfs/l", "x")
    with pytest.raises(ReadOnly):
        view.utimens("/.stepfs/status", None)


def test_creating_the_store_name_at_the_root_is_reserved(ws_view):
    _ws, view = ws_view
    with pytest.raises(Reserved):
        view.mkdir("/.stepfs", 0o755)
    with pytest.raises(Reserved):
        view.create("/.stepfs", 0o644)
    with pytest.raises(Reserved):
        view.symlink("/.stepfs", "x")
    with pytest.raises(Reserved):
        view.mknod("/.stepfs", stat_mod.S_IFIFO | 0o644)
    with pytest.raises(Reserved):
        view.link("/.stepfs", "/README")
    # Only at the root: a nested .stepfs is an ordinary name.
    view.mkdir("/src/.stepfs", 0o755)
    assert ".stepfs" in names(view, "/src")


def test_exists_refusals(ws_view):
    _ws, view = ws_view
    with pytest.raises(Exists):
        view.mkdir("/src", 0o755)
    with pytest.raises(Exists):
        view.create("/README", 0o644, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    with pytest.raises(Exists):
        view.symlink("/link", "elsewhere")
