"""Issue 18 item 1: a commit reaches its store (``.stepfs/spare``, ``tmp``,
``retired``, ``commit.lock``, ``run``, ``store.db``) only through the
handle opened beneath the workspace, never by the workspace's path name.
Every decoy lives in a temp dir."""

from __future__ import annotations

import os

import pytest

from history_helpers import open_ws, read, write
from stepfs.store import spares as spares_mod


def _decoy_tree(r):
    (r / "par" / "ws").mkdir(parents=True)
    (r / "victim").mkdir()
    for sub in ("spare", "tmp", "retired", "run", "scratch"):
        (r / "evil" / "ws" / ".stepfs" / sub).mkdir(parents=True)
    (r / "par" / "ws" / "a").write_text("orig\n")
    (r / "victim" / "target").write_text("ORIGINAL\n")


def test_a_parent_swapped_for_a_symlink_does_not_steer_the_commit(tmp_path):
    """The issue's reproduction: the workspace's parent is renamed and a
    symlink to a look-alike tree whose spares are hard links to a victim
    takes its place while the workspace is open."""
    r = tmp_path
    _decoy_tree(r)
    ws, view = open_ws(r / "par" / "ws")
    try:
        ws.spares.fill(8)
        write(view, "a", b"new-a\n")
        write(view, "b", b"new-b\n")
        for name in os.listdir(r / "par" / "ws" / ".stepfs" / "spare"):
            os.link(r / "victim" / "target", r / "evil" / "ws" / ".stepfs" / "spare" / name)
        (r / "evil" / "ws" / ".stepfs" / "commit.lock").touch()
        os.rename(r / "par", r / "par.orig")
        os.symlink(r / "evil", r / "par")
        number = view.commit(message="x")
        assert number == 1
        assert read(view, "a") == b"new-a\n"
    finally:
        ws.close()
    assert (r / "victim" / "target").read_text() == "ORIGINAL\n"
    assert os.stat(r / "victim" / "target").st_nlink == 1 + len(os.listdir(r / "evil" / "ws" / ".stepfs" / "spare"))
    real = r / "par.orig" / "ws"
    assert (real / "a").read_text() == "new-a\n" and (real / "b").read_text() == "new-b\n"
    assert os.stat(real / "a").st_nlink == 1 and os.stat(real / "b").st_nlink == 1
    # Nothing of the store was made or written in the look-alike tree.
    assert sorted(os.listdir(r / "evil" / "ws" / ".stepfs")) == ["commit.lock", "retired", "run", "scratch",
                                                                  "spare", "tmp"]
    assert os.listdir(r / "evil" / "ws" / ".stepfs" / "tmp") == []


def test_renaming_the_workspace_while_open_recreates_nothing_at_the_old_path(tmp_path):
    (tmp_path / "par" / "ws").mkdir(parents=True)
    (tmp_path / "par" / "ws" / "a").write_text("orig\n")
    ws, view = open_ws(tmp_path / "par" / "ws")
    try:
        write(view, "a", b"new\n")
        os.rename(tmp_path / "par" / "ws", tmp_path / "par" / "ws-renamed")
        ws.spares.fill(4)
        assert view.commit(message="after the rename") == 1
        write(view, "c", b"c\n")
        assert view.commit(message="and again") == 2
    finally:
        ws.close()
    assert not (tmp_path / "par" / "ws").exists()
    assert (tmp_path / "par" / "ws-renamed" / "a").read_text() == "new\n"
    assert (tmp_path / "par" / "ws-renamed" / "c").read_text() == "c\n"


@pytest.mark.parametrize("planted", ["hardlink", "foreign"])
def test_a_spare_with_a_second_link_or_another_owner_is_refused(tmp_path, planted):
    (tmp_path / "ws").mkdir()
    (tmp_path / "victim").write_text("ORIGINAL\n")
    ws, view = open_ws(tmp_path / "ws")
    try:
        spare_dir = os.path.join(ws.store_dir, "spare")
        if planted == "hardlink":
            os.link(tmp_path / "victim", os.path.join(spare_dir, "planted"))
        else:
            if os.geteuid() != 0:
                pytest.skip("making a file of another owner needs root")
            fd = os.open(os.path.join(spare_dir, "planted"), os.O_WRONLY | os.O_CREAT, 0o600)
            os.fchown(fd, 65534, 65534)
            os.close(fd)
        assert ws.spares.available() == 1
        write(view, "f", b"content\n")
        assert view.commit(message="x") == 1
        assert (tmp_path / "ws" / "f").read_text() == "content\n"
        assert os.stat(tmp_path / "ws" / "f").st_nlink == 1
        assert os.stat(tmp_path / "ws" / "f").st_uid == os.geteuid()
    finally:
        ws.close()
    assert (tmp_path / "victim").read_text() == "ORIGINAL\n"


def test_taking_a_spare_checks_the_inode_before_emptying_it(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    (tmp_path / "victim").write_text("keep\n")
    os.link(tmp_path / "victim", d / "x")
    fd = os.open(d, os.O_PATH | os.O_DIRECTORY)
    try:
        assert spares_mod._open_own_empty("x", fd) is None
        (d / "y").write_text("bytes\n")
        got = spares_mod._open_own_empty("y", fd)
        assert got is not None
        os.close(got)
    finally:
        os.close(fd)
    assert (tmp_path / "victim").read_text() == "keep\n"
    assert (d / "y").read_bytes() == b""


def test_a_symlinked_store_directory_is_refused(tmp_path):
    from stepfs.store.errors import WorkspaceError
    from stepfs.store.workspace import Workspace

    (tmp_path / "ws").mkdir()
    (tmp_path / "elsewhere").mkdir()
    Workspace.open(str(tmp_path / "ws"), create=True).close()
    store = tmp_path / "ws" / ".stepfs"
    os.rename(store / "tmp", tmp_path / "elsewhere" / "tmp")
    os.symlink(tmp_path / "elsewhere" / "tmp", store / "tmp")
    with pytest.raises(WorkspaceError, match="symbolic link"):
        Workspace.open(str(tmp_path / "ws"))


def test_verify_workspace_compares_every_committed_path_with_the_head(tmp_path):
    """``stepfs verify --workspace``: kind, mode and content of every path a
    layer committed, against the head layer."""
    from conftest import stepfs

    ws_path = tmp_path / "ws"
    (ws_path / "d").mkdir(parents=True)
    ws, view = open_ws(ws_path)
    try:
        for name in ("a", "b", "c", "d/f"):
            write(view, name, f"{name}\n".encode())
        view.commit(message="four files")
    finally:
        ws.close()
    r = stepfs("verify", ws_path, "--workspace", "--json")
    assert r.returncode == 0, r.stderr
    import json

    assert json.loads(r.stdout)["counts"]["workspace paths"] == 4
    # The damage the issue's attack left, and plainer changes.
    (tmp_path / "victim").write_text("a\n")
    os.unlink(ws_path / "a")
    os.link(tmp_path / "victim", ws_path / "a")  # right bytes, a second link elsewhere
    (ws_path / "b").write_text("B!\n")  # other bytes
    os.chmod(ws_path / "c", 0o600)  # another mode
    os.rename(ws_path / "d", tmp_path / "d-away")
    os.symlink(tmp_path / "d-away", ws_path / "d")  # a symlink where a directory was
    assert stepfs("verify", ws_path).returncode == 0  # the store itself is fine
    r = stepfs("verify", ws_path, "--workspace", "--json")
    assert r.returncode == 15
    problems = json.loads(r.stdout)["problems"]
    text = "\n".join(problems)
    assert "'a' has 2 links" in text and "'b' holds other bytes" in text and "'c' has mode 600" in text
    assert "'d/f' is missing (or lies below a symlink" in text  # d was there before layer 1: not committed
    assert len(problems) == 4


@pytest.mark.mount
def test_the_issue_reproduction_through_a_real_mount(tmp_path, mount):
    """The issue's shell reproduction, step for step, against a live daemon:
    spares hard-linked to a victim in a look-alike tree, the workspace's
    parent swapped for a symlink to it, then ``stepfs step``."""
    import time

    from conftest import stepfs

    r = tmp_path
    _decoy_tree(r)
    ws = r / "par" / "ws"
    (r / "mnt").mkdir()
    m = mount(ws, r / "mnt")
    try:
        (m.mountpoint / "a").write_text("new-a\n")
        (m.mountpoint / "b").write_text("new-b\n")
        deadline = time.monotonic() + 30
        while not os.listdir(ws / ".stepfs" / "spare"):  # the daemon's first round of spares
            assert time.monotonic() < deadline, "the daemon made no spare files"
            time.sleep(0.05)
        for name in os.listdir(ws / ".stepfs" / "spare"):
            os.link(r / "victim" / "target", r / "evil" / "ws" / ".stepfs" / "spare" / name)
        (r / "evil" / "ws" / ".stepfs" / "commit.lock").touch()
        os.rename(r / "par", r / "par.orig")
        os.symlink(r / "evil", r / "par")
        res = stepfs("step", m.mountpoint, "-m", "x")
        assert res.returncode == 0, res.stderr
        assert res.stdout.decode().strip() == "1"
        assert (r / "victim" / "target").read_text() == "ORIGINAL\n"
        real = r / "par.orig" / "ws"
        assert (real / "a").read_text() == "new-a\n" and (real / "b").read_text() == "new-b\n"
        assert os.stat(real / "a").st_nlink == 1 and os.stat(real / "b").st_nlink == 1
        assert os.listdir(r / "evil" / "ws" / ".stepfs" / "tmp") == []
        assert stepfs("verify", real, "--workspace").returncode == 0
    finally:
        if (r / "par").is_symlink():
            os.unlink(r / "par")
            os.rename(r / "par.orig", r / "par")
