"""Unversioned paths in the overlay view, without a kernel: never staged,
written to the workspace at once, untouched by commits and rollbacks,
contained (``overlayfs/core/passthrough.py``)."""

from __future__ import annotations

import errno
import os

import pytest

from stepfs.overlayfs.core.errors import NotFound
from stepfs.store import staging
from stepfs.store.errors import NothingToCommit
from stepfs.store.rollback import rollback
from viewkit import open_view, read_all, write_file


def staged(ws, view):
    view.sync_rows()
    with ws.db.read() as conn:
        return sorted(os.fsdecode(r.path) for r in staging.load(conn, view.step))


@pytest.fixture
def ws_view(tmp_path):
    ws_dir = tmp_path / "ws"
    ws_dir.mkdir()
    (ws_dir / "app.py").write_bytes(b"print(1)\n")
    (ws_dir / "src").mkdir()
    return open_view(tmp_path)


def test_writes_under_node_modules_go_to_the_workspace_and_are_never_staged(ws_view, tmp_path):
    ws, view = ws_view
    view.mkdir("/node_modules", 0o755)
    view.mkdir("/node_modules/pkg", 0o755)
    write_file(view, "/node_modules/pkg/index.js", b"module.exports = 1;\n")
    view.symlink("/node_modules/.bin", "../pkg/index.js")
    assert (tmp_path / "ws/node_modules/pkg/index.js").read_bytes() == b"module.exports = 1;\n"
    assert os.readlink(tmp_path / "ws/node_modules/.bin") == "../pkg/index.js"
    assert read_all(view, "/node_modules/pkg/index.js") == b"module.exports = 1;\n"
    view.chmod("/node_modules/pkg/index.js", 0o600)
    assert (tmp_path / "ws/node_modules/pkg/index.js").stat().st_mode & 0o777 == 0o600
    view.utimens("/node_modules/pkg/index.js", (1_000_000_000, 2_000_000_000))
    assert (tmp_path / "ws/node_modules/pkg/index.js").stat().st_mtime_ns == 2_000_000_000
    view.setxattr("/node_modules/pkg/index.js", "user.k", b"v")
    assert os.getxattr(tmp_path / "ws/node_modules/pkg/index.js", "user.k") == b"v"
    assert view.getxattr("/node_modules/pkg/index.js", "user.k") == b"v"
    with pytest.raises(OSError) as err:
        view.setxattr("/node_modules/pkg/index.js", "trusted.k", b"v")
    assert err.value.errno == errno.EOPNOTSUPP
    view.removexattr("/node_modules/pkg/index.js", "user.k")
    assert "user.k" not in os.listxattr(tmp_path / "ws/node_modules/pkg/index.js")
    view.truncate("/node_modules/pkg/index.js", 3)
    assert (tmp_path / "ws/node_modules/pkg/index.js").read_bytes() == b"mod"
    assert view.getattr("/node_modules/pkg/index.js")["st_size"] == 3
    assert staged(ws, view) == []
    assert view.unversioned_state()["trees"] == ["/node_modules"]
    with pytest.raises(NothingToCommit):
        view.commit("nothing versioned changed")


def test_a_step_records_only_versioned_paths_and_a_rollback_leaves_unversioned_ones(ws_view, tmp_path):
    ws, view = ws_view
    write_file(view, "/app.py", b"print(2)\n")
    view.mkdir("/src/__pycache__", 0o755)
    write_file(view, "/src/__pycache__/m.cpython-311.pyc", b"pyc")
    assert staged(ws, view) == ["app.py"]
    n = view.commit("edit")
    write_file(view, "/src/__pycache__/m.cpython-311.pyc", b"pyc2")
    with ws.db.read() as conn:
        from stepfs.store import layers
        paths = [os.fsdecode(e.path) for e in layers.entries(conn, n)]
    assert paths == ["app.py"]
    view.close()
    rollback(ws, 0)
    assert (tmp_path / "ws/app.py").read_bytes() == b"print(1)\n"
    assert (tmp_path / "ws/src/__pycache__/m.cpython-311.pyc").read_bytes() == b"pyc2"


def test_rename_within_unversioned_trees_and_across_the_boundary(ws_view, tmp_path):
    ws, view = ws_view
    view.mkdir("/node_modules", 0o755)
    write_file(view, "/node_modules/a", b"a")
    view.rename("/node_modules/a", "/node_modules/b")
    assert (tmp_path / "ws/node_modules/b").read_bytes() == b"a"
    view.rename("/node_modules", "/.venv")  # both unversioned (a directory)
    assert (tmp_path / "ws/.venv/b").exists() and not (tmp_path / "ws/node_modules").exists()
    for old, new in (("/.venv/b", "/b"), ("/.venv", "/keep")):
        with pytest.raises(OSError) as err:
            view.rename(old, new)
        assert err.value.errno == errno.EXDEV
    with pytest.raises(OSError) as err:
        view.link("/.venv/hard", "/app.py")
    assert err.value.errno == errno.EXDEV
    assert staged(ws, view) == []
    view.unlink("/.venv/b")
    view.rmdir("/.venv")
    assert not (tmp_path / "ws/.venv").exists()


def test_unversioned_tree_in_a_directory_only_the_step_has_is_staged(ws_view, tmp_path):
    """The workspace has no directory to write it in: staged like any path
    (README's caveat), never written outside the step."""
    ws, view = ws_view
    view.mkdir("/newpkg", 0o755)
    view.mkdir("/newpkg/__pycache__", 0o755)
    write_file(view, "/newpkg/__pycache__/x.pyc", b"x")
    assert not (tmp_path / "ws/newpkg").exists()
    assert "newpkg/__pycache__/x.pyc" in staged(ws, view)


def test_excludes_and_no_defaults(tmp_path):
    (tmp_path / "ws").mkdir()
    ws, view = open_view(tmp_path, excludes=["build/"], default_excludes=False)
    view.mkdir("/build", 0o755)
    write_file(view, "/build/out.o", b"o")
    view.mkdir("/node_modules", 0o755)
    write_file(view, "/node_modules/x.js", b"x")
    assert (tmp_path / "ws/build/out.o").exists()
    assert not (tmp_path / "ws/node_modules").exists()
    assert staged(ws, view) == ["node_modules", "node_modules/x.js"]


def test_stepfsignore_staged_in_the_mount_takes_effect(ws_view, tmp_path, monkeypatch):
    from stepfs.overlayfs.core import unversioned

    monkeypatch.setattr(unversioned, "RELOAD_INTERVAL", 0.0)
    ws, view = ws_view
    view.unversioned._next_look = 0.0
    write_file(view, "/.stepfsignore", b"# generated\ndist/\n")
    view.mkdir("/dist", 0o755)
    write_file(view, "/dist/bundle.js", b"b")
    assert (tmp_path / "ws/dist/bundle.js").exists()
    assert staged(ws, view) == [".stepfsignore"]  # the rules themselves are versioned
    assert view.unversioned_state()["stepfsignore"] == ["dist/"]
    view.unlink("/.stepfsignore")
    view.unversioned._next_look = 0.0
    assert not view.unversioned.covers("/dist/x", False)


def test_containment_a_symlink_in_place_of_the_tree_is_not_followed(ws_view, tmp_path):
    ws, view = ws_view
    decoy = tmp_path / "decoy"
    decoy.mkdir()
    os.symlink(decoy, tmp_path / "ws/node_modules")
    with pytest.raises(OSError) as err:
        write_file(view, "/node_modules/escape.js", b"x")
    assert err.value.errno == errno.ELOOP
    with pytest.raises(OSError):
        view.mkdir("/node_modules/sub", 0o755)
    assert list(decoy.iterdir()) == []


def test_the_store_is_never_unversioned(tmp_path):
    (tmp_path / "ws").mkdir()
    ws, view = open_view(tmp_path, excludes=[".stepfs/", "*"])
    assert not view.unversioned.covers("/.stepfs", True)
    with pytest.raises(Exception):
        view.mkdir("/.stepfs/x", 0o755)
    assert not (tmp_path / "ws/.stepfs/x").exists()


def test_open_of_a_missing_unversioned_file_is_not_found(ws_view):
    ws, view = ws_view
    view.mkdir("/node_modules", 0o755)
    with pytest.raises(NotFound):
        view.open("/node_modules/none", os.O_RDONLY)


def test_a_tree_made_versioned_and_renamed_to_an_unversioned_name_moves_to_the_workspace(ws_view, tmp_path):
    """pytest makes .pytest_cache as pytest-cache-files-XXXX and renames it."""
    ws, view = ws_view
    view.mkdir("/pytest-cache-files-x", 0o755)
    view.mkdir("/pytest-cache-files-x/v", 0o755)
    write_file(view, "/pytest-cache-files-x/README.md", b"readme")
    view.symlink("/pytest-cache-files-x/ln", "README.md")
    write_file(view, "/app2.py", b"x")
    view.rename("/pytest-cache-files-x", "/.pytest_cache")
    assert (tmp_path / "ws/.pytest_cache/README.md").read_bytes() == b"readme"
    assert (tmp_path / "ws/.pytest_cache/v").is_dir()
    assert os.readlink(tmp_path / "ws/.pytest_cache/ln") == "README.md"
    assert read_all(view, "/.pytest_cache/README.md") == b"readme"
    assert staged(ws, view) == ["app2.py"]
    # A workspace file moved out: its old name is staged as deleted.
    view.mkdir("/node_modules", 0o755)
    view.rename("/app.py", "/node_modules/app.py")
    assert (tmp_path / "ws/node_modules/app.py").read_bytes() == b"print(1)\n"
    assert (tmp_path / "ws/app.py").exists()  # the workspace file goes at the step
    assert staged(ws, view) == ["app.py", "app2.py"]
    assert not [p for p in os.listdir(tmp_path / "ws") if p.startswith(".stepfs-move-")]
    with pytest.raises(OSError) as err:
        view.rename("/node_modules/app.py", "/app.py")
    assert err.value.errno == errno.EXDEV
