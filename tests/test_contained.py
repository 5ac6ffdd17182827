"""Containment of :class:`store.contained.Root` (no kernel mount): nothing
resolves outside the tree, no symlink is followed on the way, the store
directory stays hidden, whichever way a path is spelled.  The paths a
lookup sends (normalized, no component starting with a dot) take a fast
route that skips ``normalize`` and the name checks; each refusal is tested
both for such a path and for one that takes the full route."""

from __future__ import annotations

import errno
import os
import shutil

import pytest

from stepfs.store.contained import Root, _plain


@pytest.fixture
def tree(tmp_path):
    ws = tmp_path / "ws"
    (ws / "a" / "b").mkdir(parents=True)
    (ws / "a" / "b" / "f").write_bytes(b"inside")
    (ws / ".stepfs").mkdir()
    (ws / ".stepfs" / "secret").write_bytes(b"store")
    (ws / ".hidden").write_bytes(b"dot file")
    outside = tmp_path / "outside"
    (outside / "b").mkdir(parents=True)
    (outside / "b" / "f").write_bytes(b"outside")
    root = Root(str(ws), hide=".stepfs")
    yield ws, outside, root
    root.close()


def _errno_of(fn, *args) -> int | None:
    try:
        fn(*args)
    except OSError as exc:
        return exc.errno
    return None


@pytest.mark.parametrize("path, plain", [
    (b"a/b/f", True), ("a/b/f", True), (b"a", True), (b"a/b.c/d", True),
    (b"", False), (b".", False), (b"/a", False), (b"a/", False), (b"a//b", False), (b"./a", False),
    (b"a/./b", False), (b"a/.", False), (b"..", False), (b"a/../b", False), (b".stepfs", False),
    (b"a/.stepfs", False), (b".hidden", False), (b"a/.git/HEAD", False), (b"a\0b", False),
])
def test_only_normalized_paths_without_dot_components_are_plain(path, plain):
    rel = path if isinstance(path, bytes) else os.fsencode(path)
    assert _plain(rel) is plain


@pytest.mark.parametrize("spelling", ["a/b/f", "/a/b/f", "a//b/f", "./a/b/./f", b"a/b/f"])
def test_every_spelling_of_a_path_inside_reaches_it(tree, spelling):
    ws, _outside, root = tree
    assert root.lstat(spelling).st_ino == os.lstat(ws / "a" / "b" / "f").st_ino
    fd = root.open(spelling, os.O_RDONLY)
    try:
        assert os.read(fd, 100) == b"inside"
    finally:
        os.close(fd)


@pytest.mark.parametrize("spelling", [".stepfs", ".stepfs/secret", "/.stepfs/secret", "./.stepfs/secret",
                                      ".stepfs//secret", b".stepfs/secret", "a/../.stepfs/secret",
                                      "a/b/../../.stepfs"])
def test_the_store_is_never_reachable(tree, spelling):
    _ws, _outside, root = tree
    assert _errno_of(root.lstat, spelling) in (errno.ENOENT, errno.EXDEV)
    assert _errno_of(root.open, spelling, os.O_RDONLY) in (errno.ENOENT, errno.EXDEV)
    assert root.lstat_or_none(spelling) is None
    assert "secret" not in [os.fsdecode(n) for n, _k, _i in root.listdir(".")]
    assert ".stepfs" not in [os.fsdecode(n) for n, _k, _i in root.listdir("/")]


def test_other_dot_names_are_reachable(tree):
    ws, _outside, root = tree
    assert root.lstat(".hidden").st_ino == os.lstat(ws / ".hidden").st_ino
    assert root.lstat("/.hidden").st_ino == os.lstat(ws / ".hidden").st_ino


@pytest.mark.parametrize("spelling", ["..", "../outside/b/f", "a/../../outside/b/f", "a/..", "a/b/../f", "a/../a"])
def test_dotdot_is_refused(tree, spelling):
    """``..`` never climbs out (``RESOLVE_BENEATH``) and is refused even
    where it would stay inside: it is how ``a/../.stepfs`` would get past
    the name check."""
    _ws, _outside, root = tree
    assert _errno_of(root.lstat, spelling) == errno.EXDEV
    assert _errno_of(root.open, spelling, os.O_RDONLY) == errno.EXDEV
    assert root.lstat_or_none(spelling) is None


@pytest.mark.parametrize("spelling", ["a/b/f", "/a/b/f", "a//b/f"])
def test_a_symlink_swapped_in_for_a_directory_is_not_followed(tree, spelling):
    """Something outside replaces the directory ``a`` by a symlink to a tree
    outside (and then one inside): a path through it is refused, never
    answered from where the link points, on the fast route as on the full one."""
    ws, outside, root = tree
    assert root.lstat(spelling).st_ino == os.lstat(ws / "a" / "b" / "f").st_ino
    shutil.rmtree(ws / "a")
    os.symlink(outside, ws / "a")
    assert _errno_of(root.lstat, spelling) == errno.ELOOP
    assert _errno_of(root.open, spelling, os.O_RDONLY) == errno.ELOOP
    assert root.lstat_or_none(spelling) is None
    assert not root.exists(spelling)
    os.unlink(ws / "a")
    (ws / "c" / "b").mkdir(parents=True)
    (ws / "c" / "b" / "f").write_bytes(b"elsewhere inside")
    os.symlink("c", ws / "a")
    assert _errno_of(root.lstat, spelling) == errno.ELOOP


def test_a_symlink_as_the_last_component_is_stat_not_followed(tree):
    ws, outside, root = tree
    os.symlink(outside / "b" / "f", ws / "a" / "link")
    st = root.lstat("a/link")
    assert st.st_ino == os.lstat(ws / "a" / "link").st_ino
    assert root.readlink("a/link") == os.fsencode(outside / "b" / "f")
    assert _errno_of(root.open, "a/link", os.O_RDONLY) == errno.ELOOP


def test_absolute_links_and_magic_links_do_not_escape(tree):
    ws, _outside, root = tree
    os.symlink("/", ws / "a" / "slash")
    assert _errno_of(root.lstat, "a/slash/etc") == errno.ELOOP
    assert root.lstat_or_none("a/slash/etc/passwd") is None


def test_creating_opens_use_their_own_mode_and_every_flag_set_its_own(tree):
    """The shared, prebuilt ``open_how`` per flag set must not carry one
    open's flags into another: O_CREAT opens get a fresh one with their
    mode, and a read-only open after a writable one cannot write."""
    ws, _outside, root = tree
    old = os.umask(0)
    try:
        fd = root.open("a/new", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640)
        os.close(fd)
        fd = root.open("a/new2", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.close(fd)
    finally:
        os.umask(old)
    assert os.stat(ws / "a" / "new").st_mode & 0o777 == 0o640
    assert os.stat(ws / "a" / "new2").st_mode & 0o777 == 0o600
    fd = root.open("a/b/f", os.O_RDWR)
    os.close(fd)
    fd = root.open("a/b/f", os.O_RDONLY)
    try:
        assert _errno_of(os.write, fd, b"x") == errno.EBADF
    finally:
        os.close(fd)
    assert _errno_of(root.open, "a/b/f", os.O_RDONLY | os.O_DIRECTORY) == errno.ENOTDIR


def test_parent_refuses_the_store_and_dotdot(tree):
    _ws, _outside, root = tree
    fd, name = root.parent("a/b/f")
    try:
        assert name == b"f"
    finally:
        os.close(fd)
    for spelling in (".stepfs/secret", "a/../.stepfs/secret", "a/../b"):
        assert _errno_of(root.parent, spelling) in (errno.ENOENT, errno.EXDEV)
    assert _errno_of(root.parent, "/") == errno.EINVAL


def test_the_hidden_name_must_be_a_dot_name(tmp_path):
    """The fast route skips the name check for paths with no dot component,
    which is only sound for a hidden name that starts with a dot."""
    with pytest.raises(ValueError):
        Root(str(tmp_path), hide="store")
    with pytest.raises(ValueError):
        Root(str(tmp_path), hide=".a/b")


def test_decoded_listings_are_the_byte_listings_decoded(tree):
    """``listdir(decoded=True)`` reads the names as ``str`` straight from
    ``scandir``: the same entries as the byte form through ``os.fsdecode``,
    undecodable bytes included, and the store still left out of the root."""
    ws, _outside, root = tree
    (ws / "a" / os.fsdecode(b"raw-\xff")).write_bytes(b"")
    os.symlink("b", ws / "a" / "l")
    os.mkfifo(ws / "a" / "fifo")
    for path in (".", "a", "/a", b"a"):
        as_bytes = root.listdir(path)
        assert sorted(root.listdir(path, decoded=True)) == sorted((os.fsdecode(n), k, i) for n, k, i in as_bytes)
        assert all(isinstance(n, bytes) for n, _k, _i in as_bytes)
    assert ".stepfs" not in {n for n, _k, _i in root.listdir(".", decoded=True)}
    assert ".hidden" in {n for n, _k, _i in root.listdir(".", decoded=True)}
    assert {n: k for n, k, _i in root.listdir("a", decoded=True)} == {
        "b": 0o040000, "l": 0o120000, "fifo": 0o010000, os.fsdecode(b"raw-\xff"): 0o100000}


@pytest.mark.parametrize("spelling", [b".stepfs\0", ".stepfs\0/secret", b"a\0/../.stepfs", b"a/b\0", "a\0"])
def test_a_nul_byte_is_refused(tree, spelling):
    """ctypes hands the kernel a C string, cut at the first NUL: a path with
    one is refused rather than resolved as its prefix (``.stepfs\\0x``
    would otherwise pass the name check and reach the store)."""
    _ws, _outside, root = tree
    assert _errno_of(root.lstat, spelling) in (errno.EINVAL, errno.EXDEV)
    assert _errno_of(root.open, spelling, os.O_RDONLY) in (errno.EINVAL, errno.EXDEV)
    assert _errno_of(root.lstat_or_none, spelling) in (errno.EINVAL, None)
    if _errno_of(root.lstat_or_none, spelling) is None:
        assert root.lstat_or_none(spelling) is None
