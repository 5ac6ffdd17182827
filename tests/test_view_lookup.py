"""Lookup precedence of the overlay view (no kernel): workspace below, the
open step above, whiteouts and opaque directories, the ``.stepfs`` tree."""

from __future__ import annotations

import os
import stat as stat_mod

import pytest

from overlayfs.errors import Exists, NotFound, ReadOnly, Reserved
from store import staging
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


def test_exists_refusals(ws_view):
    _ws, view = ws_view
    with pytest.raises(Exists):
        view.mkdir("/src", 0o755)
    with pytest.raises(Exists):
        view.create("/README", 0o644, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    with pytest.raises(Exists):
        view.symlink("/link", "elsewhere")
