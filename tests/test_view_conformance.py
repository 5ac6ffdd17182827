"""Fixes the conformance suite (tests/conformance) found, pinned at the view
level (no kernel): one test per fix."""

from __future__ import annotations

import errno
import os

import pytest

from stepfs.overlayfs.daemon.fuse_ops import errno_for
from viewkit import open_view


@pytest.fixture
def ws_view(tmp_path):
    (tmp_path / "ws" / "d").mkdir(parents=True)
    return open_view(tmp_path)


def errno_of(fn, *args) -> int:
    try:
        fn(*args)
    except Exception as exc:  # a view error maps to errno in fuse_ops
        return errno_for(exc) if not isinstance(exc, OSError) else exc.errno
    return 0


def test_lookup_of_an_overlong_name_is_enametoolong(ws_view):
    _ws, view = ws_view
    view.mkdir("/new", 0o755)  # opaque: lookups below it never reach the workspace
    for parent in ("", "/d", "/new"):
        assert errno_of(view.getattr, parent + "/" + "x" * 256) == errno.ENAMETOOLONG, parent
        assert errno_of(view.getattr, parent + "/" + "x" * 255) == errno.ENOENT, parent


def test_entry_changes_update_the_parent_directory_times(ws_view):
    ws, view = ws_view
    os.utime(ws.path + "/d", ns=(10**9, 10**9))  # a workspace directory
    view.mkdir("/new", 0o755)  # a directory of the step
    steps = [
        (lambda: view.mkdir("/d/sub", 0o755), {"/d"}),
        (lambda: view.symlink("/new/l", "t"), {"/new"}),
        (lambda: view.rmdir("/d/sub"), {"/d"}),
        (lambda: view.unlink("/new/l"), {"/new"}),
        (lambda: view.release(view.create("/d/f", 0o644)), {"/d"}),
        (lambda: view.rename("/d/f", "/new/f"), {"/d", "/new"}),
        (lambda: view.link("/d/g", "/new/f"), {"/d"}),
    ]
    for step, dirs in steps:
        view.utimens("/new", (10**9, 10**9))
        view.dir_times.clear()
        before = {d: view.getattr(d)["st_ctime"] for d in dirs}
        step()
        for d in dirs:
            st = view.getattr(d)
            assert st["st_mtime"] > 10**9 and st["st_ctime"] > before[d], (d, dirs)


def test_new_names_in_a_setgid_directory_take_its_group(ws_view):
    _ws, view = ws_view
    view.mkdir("/s", 0o2775, owner=(0, 0))
    view.chown("/s", -1, 4242)
    view.mkdir("/s/sub", 0o755, owner=(1000, 1000))
    view.symlink("/s/l", "x", owner=(1000, 1000))
    view.release(view.create("/s/f", 0o644, owner=(1000, 1000)))
    sub = view.getattr("/s/sub")
    assert (sub["st_gid"], sub["st_mode"] & 0o7777) == (4242, 0o2755)
    assert view.getattr("/s/f")["st_gid"] == 4242 and view.getattr("/s/f")["st_mode"] & 0o7777 == 0o644
    assert view.getattr("/s/l")["st_gid"] == 4242
    view.mkdir("/plain", 0o755, owner=(1000, 1000))
    assert view.getattr("/plain")["st_gid"] == 1000


def test_metadata_change_through_one_hard_link_invalidates_the_others(ws_view):
    _ws, view = ws_view
    view.release(view.create("/a", 0o644))
    view.link("/b", "/a")
    seen = []
    view.invalidate = seen.append
    view.chown("/b", 7, 7)
    view.chmod("/b", 0o600)
    view.utimens("/b", (1, 2))
    assert seen == ["/a", "/a", "/a"]
    assert view.getattr("/a")["st_uid"] == 7


def test_writes_through_an_unlinked_name_reach_the_remaining_hard_link(ws_view):
    _ws, view = ws_view
    fh = view.create("/f", 0o644)
    view.write(fh, b"abc", 0)
    view.flush(fh)
    view.link("/g", "/f")
    assert view.getattr("/f", fh)["st_nlink"] == view.getattr("/f")["st_nlink"] == 2
    view.rename("/f", "/.fuse_hidden0001")  # libfuse's unlink of an open file
    view.write(fh, b"XYZ", 0)
    # libfuse subtracts one from what a hidden name reports: 2 means 1.
    assert view.getattr("/", fh)["st_nlink"] == 2
    assert view.getattr("/.fuse_hidden0001")["st_nlink"] == 2  # fstat: the kernel sends no handle
    view.flush(fh)
    view.release(fh)
    fh = view.open("/g", os.O_RDONLY)
    assert view.read(fh, 10, 0) == b"XYZ"
    view.release(fh)
    assert view.getattr("/g")["st_nlink"] == 1


def test_workspace_hard_links(tmp_path):
    """Names of a workspace file with several links: renaming one onto
    another does nothing (POSIX); removing or replacing one lowers the link
    count the others show."""
    ws_dir = tmp_path / "ws"
    ws_dir.mkdir()
    for name in ("a", "c"):
        (ws_dir / name).write_bytes(name.encode())
    os.link(ws_dir / "a", ws_dir / "a2")
    os.link(ws_dir / "a", ws_dir / "a3")
    _ws, view = open_view(tmp_path)
    view.rename("/a", "/a2")
    assert {n for n, _k, _i in view.readdir("/")} >= {"a", "a2", "a3"}
    assert view.getattr("/a")["st_nlink"] == 3
    before = view.getattr("/a3")["st_ctime"]
    view.unlink("/a")
    assert view.getattr("/a3")["st_nlink"] == 2 and view.getattr("/a3")["st_ctime"] > before
    view.rename("/c", "/a2")
    assert view.getattr("/a3")["st_nlink"] == 1
    (ws_dir / "e").write_bytes(b"e")
    os.link(ws_dir / "e", ws_dir / "e2")  # written through one name: two files from then on
    assert view.getattr("/e")["st_nlink"] == 2
    fh = view.open("/e2", os.O_WRONLY)
    view.write(fh, b"E", 0)
    view.flush(fh)
    view.release(fh)
    assert view.getattr("/e")["st_nlink"] == view.getattr("/e2")["st_nlink"] == 1
