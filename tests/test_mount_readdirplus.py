"""Listings carry attributes (READDIRPLUS, ``_FUSE._readdir_plus``).

The kernel asks for a listing with attributes and then uses them without
a lookup per name: what a listing delivers must be what ``getattr`` would
answer, and every invariant ``getattr`` keeps (a directory is watched
before the kernel holds it; every shown name of a multi-link workspace
file is recorded) must hold for names the kernel only ever listed."""

from __future__ import annotations

import os
import stat

import pytest

from conftest import sh
from test_mount_watch import DEADLINE, seen

pytestmark = pytest.mark.mount


def _attrs(path) -> tuple:
    st = os.lstat(path)
    return stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), st.st_nlink, st.st_size


def test_listed_entries_have_the_attributes_getattr_gives(workspace, mount):
    d = workspace / "d"
    (d / "sub" / "deeper").mkdir(parents=True)
    (d / "plain.txt").write_bytes(b"x" * 1234)
    os.chmod(d / "plain.txt", 0o640)
    (d / "a").write_bytes(b"linked\n")
    os.link(d / "a", d / "b")
    os.symlink("plain.txt", d / "link")
    m = mount(workspace)
    sh("printf 'staged bytes' > d/staged.txt && chmod 600 d/staged.txt", m.mountpoint)
    # The kernel is told about b by a listing only, then loses one name.
    sh("ls d > /dev/null", m.mountpoint)
    sh("rm d/b", m.mountpoint)
    sh("ls d > /dev/null", m.mountpoint)

    md = m.path("d")
    assert sorted(os.listdir(md)) == ["a", "link", "plain.txt", "staged.txt", "sub"]
    assert _attrs(md / "plain.txt") == (stat.S_IFREG, 0o640, 1, 1234)
    assert _attrs(md / "a") == (stat.S_IFREG, stat.S_IMODE(os.stat(d / "a").st_mode), 1, 7)
    assert _attrs(md / "link") == (stat.S_IFLNK, 0o777, 1, len("plain.txt"))
    assert _attrs(md / "staged.txt") == (stat.S_IFREG, 0o600, 1, len("staged bytes"))
    sub = os.stat(d / "sub")
    assert _attrs(md / "sub") == (stat.S_IFDIR, stat.S_IMODE(sub.st_mode), 3, sub.st_size)
    assert os.stat(d / "a").st_nlink == 2  # the workspace is untouched until a step


def test_outside_edit_in_a_directory_that_was_only_listed(workspace, mount):
    (workspace / "top" / "sub").mkdir(parents=True)
    (workspace / "top" / "sub" / "f.txt").write_text("v1\n")
    m = mount(workspace)
    # Listings only: the kernel learns top/sub and top/sub/f.txt from them.
    sh("ls top > /dev/null && ls top/sub > /dev/null", m.mountpoint)
    assert os.stat(m.path("top/sub/f.txt")).st_size == 3

    (workspace / "top" / "sub" / "f.txt").write_text("version two\n")
    assert seen(lambda: os.stat(m.path("top/sub/f.txt")).st_size, len("version two\n"), DEADLINE)
    (workspace / "top" / "sub" / "new.txt").write_text("n\n")
    assert seen(lambda: "new.txt" in os.listdir(m.path("top/sub")), True, DEADLINE)


def test_a_listing_longer_than_one_reply(workspace, mount):
    """Hundreds of entries take many replies; a reply after the first is a
    READDIRPLUS resuming at the last offset when names were looked up
    meanwhile (``ls -l``'s stats between two getdents calls): every name
    once, each with its own attributes."""
    big = workspace / "big"
    big.mkdir()
    names = {f"f{i:04d}" + "x" * (60 + i % 37): i for i in range(600)}
    for name, i in names.items():
        (big / name).write_bytes(b"y" * i)
    m = mount(workspace)
    sh("printf 'new' > big/staged-one && rm big/f0007" + "x" * 67, m.mountpoint)
    long_listing = sh("ls -l big", m.mountpoint).stdout.decode().splitlines()[1:]
    assert {line.split()[-1]: int(line.split()[4]) for line in long_listing} == {
        n: i for n, i in names.items() if i != 7} | {"staged-one": 3}
    listed = os.listdir(m.path("big"))
    assert len(listed) == len(set(listed)) == len(names)
    want = {n: i for n, i in names.items() if i != 7}
    want["staged-one"] = 3
    assert {n: os.lstat(m.path("big", n)).st_size for n in listed} == want
