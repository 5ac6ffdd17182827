"""Kept workspace directory descriptors (core/dirhandles.py), kernel-free:
the same answers as ``Root.lstat``, nothing reached outside the workspace,
and a table that goes stale empties before it is used again."""

from __future__ import annotations

import os

import pytest

from stepfs.overlayfs.core.dirhandles import DirHandles
from stepfs.overlayfs.core.errors import NotFound
from stepfs.overlayfs.core.links import Links
from stepfs.overlayfs.core.namespace import Namespace
from stepfs.overlayfs.core.upper import Upper
from stepfs.store.contained import Root


@pytest.fixture
def ws(tmp_path):
    root = tmp_path / "ws"
    (root / "a" / "b").mkdir(parents=True)
    (root / "a" / "b" / "f").write_text("f\n")
    (root / "a" / "g").write_text("g\n")
    (root / "top").write_text("top\n")
    (root / ".stepfs").mkdir()
    return root


@pytest.fixture
def handles(ws):
    r = Root(str(ws), hide=".stepfs")
    h = DirHandles(r, limit=4)
    h.start(lambda path: True, lambda: 0)
    yield h
    h.close()
    r.close()


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_answers_as_lstat_does(ws, handles):
    for path in ("/a/b/f", "/a/g", "/a/b", "/top"):
        st = handles.lstat(path)
        assert st is not None
        want = os.lstat(ws / path[1:])
        assert (st.st_ino, st.st_mode, st.st_size) == (want.st_ino, want.st_mode, want.st_size)
    with pytest.raises(FileNotFoundError):
        handles.lstat("/a/absent")
    assert handles.lstat("/a/absent-dir/x") is None  # no directory there to keep: Root.lstat answers


def test_dot_names_and_odd_paths_are_left_to_root(handles):
    # ".stepfs" at the root is hidden by Root's checks; ".." would climb.
    for path in ("/.stepfs", "/a/..", "/a/.", "/a/", "/a/.hidden"):
        assert handles.lstat(path) is None


def test_a_symlink_in_place_of_a_directory_is_never_kept(ws, handles, tmp_path):
    decoy = tmp_path / "decoy"
    decoy.mkdir()
    (decoy / "secret").write_text("outside\n")
    os.symlink(decoy, ws / "link")
    assert handles.fd("/link") == -1
    assert handles.lstat("/link/secret") is None  # Root.lstat then refuses with ELOOP


def test_only_directories_keep_accepts(ws):
    r = Root(str(ws))
    h = DirHandles(r)
    assert h.lstat("/a/g") is None  # not started: off
    h.start(lambda path: path != "/a", lambda: 0)
    assert h.lstat("/a/g") is None
    assert h.lstat("/a/b/f") is not None
    h.close()
    assert h.lstat("/a/b/f") is None
    r.close()


def test_a_directory_renamed_and_replaced_is_seen_once_told(ws, handles):
    old = handles.lstat("/a/b/f")
    os.rename(ws / "a" / "b", ws / "a" / "moved")
    (ws / "a" / "b").mkdir()
    (ws / "a" / "b" / "f").write_text("new file\n")
    # Until told, the kept descriptor names the directory now at a/moved
    # (as the kernel's own cached entries do until the same event).
    assert handles.lstat("/a/b/f").st_ino == old.st_ino
    handles.changed({"/a/unrelated", "/a/b/f"})  # names that are not kept directories
    assert handles.lstat("/a/b/f").st_ino == old.st_ino
    handles.changed({"/a/b"})
    assert handles.lstat("/a/b/f").st_ino == os.lstat(ws / "a" / "b" / "f").st_ino != old.st_ino


def test_an_ancestor_renamed_makes_the_table_stale(ws, handles):
    handles.lstat("/a/b/f")
    os.rename(ws / "a", ws / "z")
    handles.changed({"/a"})
    assert handles.lstat("/a/g") is None  # no directory at /a to keep now: Root.lstat answers
    assert handles.lstat("/z/g") is not None


def test_stale_and_a_rules_change_empty_the_table(ws):
    r = Root(str(ws))
    generation = [0]
    h = DirHandles(r)
    h.start(lambda path: True, lambda: generation[0])
    fd = h.fd("/a")
    assert h.fd("/a") == fd
    h.stale()
    before = open_fds()
    h.fd("/a/b")  # the reset closed /a's descriptor, then /a/b was opened
    assert open_fds() == before
    h.fd("/a")
    generation[0] += 1
    before = open_fds()
    h.fd("/a/b")
    assert open_fds() == before - 1  # /a and /a/b closed, /a/b opened again
    h.close()
    r.close()


def test_the_oldest_descriptor_goes_beyond_the_limit(ws, handles):
    for d in ("c1", "c2", "c3", "c4", "c5"):
        (ws / d).mkdir()
    before = open_fds()
    for d in ("c1", "c2", "c3", "c4", "c5", "a"):
        assert handles.fd("/" + d) >= 0
    assert open_fds() - before == 4


def test_the_namespace_resolves_through_kept_directories(ws):
    r = Root(str(ws), hide=".stepfs")
    ns = Namespace(r, Upper(), Links(lambda: None, lambda path: None))
    ns.dirs.start(lambda path: True, lambda: 0)
    node, st = ns.resolve("/a/b/f")
    assert node is None and st.st_ino == os.lstat(ws / "a" / "b" / "f").st_ino
    with pytest.raises(NotFound):
        ns.resolve("/a/b/absent")
    with pytest.raises(NotFound):
        ns.resolve("/a/g/under-a-file")
    with pytest.raises(NotFound):
        ns.resolve("/.stepfs")
    ns.dirs.close()
    r.close()


def test_a_mount_that_stops_watching_closes_what_it_kept(ws):
    r = Root(str(ws))
    h = DirHandles(r)
    h.start(lambda path: True, lambda: 0)
    assert h.lstat("/a/b/f") is not None
    before = open_fds()
    h.enabled = False  # short_timeouts, from any thread
    assert h.lstat("/a/b/f") is None and h.lstat("/top") is None
    assert open_fds() == before - 1
    r.close()
