"""What keeps a second ``ls -lR`` / ``git status`` cheap stays correct:
the kernel's POSIX ACL cache (FUSE_CAP_POSIX_ACL) and the view's reused
workspace listings (overlayfs/core/listings.py) through a real mount, and the
adapter's direct stat fill (no kernel)."""

from __future__ import annotations

import ctypes
import errno
import os
import stat as stat_mod
import struct
import time
from types import SimpleNamespace

import mfusepy
import pytest

from conftest import sh, stepfs
from stepfs.overlayfs.daemon import fuse_ops
from stepfs.overlayfs.daemon.libfuse import highlevel, statbuf
from stepfs.overlayfs.core.listings import settled
from viewkit import open_view

# A minimal access ACL equal to mode 0644 (posix_acl_xattr format, version 2).
_ANY = 0xFFFFFFFF
ACL_0644 = struct.pack("<I", 2) + b"".join(
    struct.pack("<HHI", tag, perm, _ANY) for tag, perm in ((0x01, 6), (0x04, 4), (0x20, 4)))


def _errno(fn, *args) -> int:
    with pytest.raises(OSError) as info:
        fn(*args)
    return info.value.errno


def test_posix_acls_are_asked_for_only_when_the_kernel_offers_them():
    ops = fuse_ops.StepFS.__new__(fuse_ops.StepFS)
    ops.kernel_cache = ops.watcher = ops.on_ready = None
    ops.view = SimpleNamespace()
    offered = SimpleNamespace(capable=fuse_ops.FUSE_CAP_POSIX_ACL | 1, want=1)
    ops.init_with_config(offered, None)
    assert offered.want == fuse_ops.FUSE_CAP_POSIX_ACL | 1
    not_offered = SimpleNamespace(capable=1, want=1)
    ops.init_with_config(not_offered, None)
    assert not_offered.want == 1


@pytest.mark.mount
def test_xattrs_of_every_namespace_with_the_kernel_acl_cache(workspace, mount):
    (workspace / "d").mkdir()
    (workspace / "d" / "f").write_bytes(b"x")
    os.chmod(workspace / "d" / "f", 0o644)
    os.setxattr(workspace / "d" / "f", "user.kept", b"K")
    m = mount(workspace)
    sh("ls -lR > /dev/null", m.mountpoint)  # ls -l asks every file for its ACL
    f, d = m.path("d", "f"), m.path("d")
    for _ in range(2):  # asked of the daemon, then answered from the kernel's cache
        for path in (f, d):
            for name in ("system.posix_acl_access", "security.selinux", "trusted.x"):
                assert _errno(os.getxattr, path, name) == errno.ENODATA, (path, name)
        assert _errno(os.getxattr, d, "system.posix_acl_default") == errno.ENODATA
    assert os.getxattr(f, "user.kept") == b"K"
    assert os.listxattr(f) == ["user.kept"]

    # ACLs cannot be set (the view keeps user.* only), before or after a
    # chmod (which makes the kernel forget what it cached).
    assert _errno(os.setxattr, f, "system.posix_acl_access", ACL_0644) == errno.EOPNOTSUPP
    os.chmod(f, 0o600)
    assert _errno(os.setxattr, f, "system.posix_acl_access", ACL_0644) == errno.EOPNOTSUPP
    assert _errno(os.getxattr, f, "system.posix_acl_access") == errno.ENODATA
    assert os.stat(f).st_mode & 0o7777 == 0o600
    assert _errno(os.setxattr, f, "trusted.x", b"1") == errno.EOPNOTSUPP

    os.setxattr(f, "user.new", b"N")
    os.setxattr(d, "user.dir", b"D")
    assert sorted(os.listxattr(f)) == ["user.kept", "user.new"]
    assert os.getxattr(d, "user.dir") == b"D"
    assert os.listxattr(workspace / "d" / "f") == ["user.kept"], "the workspace is untouched before a step"


@pytest.mark.mount
def test_outside_changes_show_in_the_next_listing_at_once(workspace, mount, monkeypatch):
    """A listing the view keeps is checked against the directory on every
    readdir, so an outside change shows in the very next listing (no
    polling).  Run without the watcher, so the kernel caches no listing
    and every listing reaches the view; a watching mount's kernel-cached
    listings are covered by tests/test_mount_listings.py."""
    monkeypatch.setenv("STEPFS_WATCH", "0")
    d = workspace / "src"
    d.mkdir()
    for name in ("a.py", "b.py"):
        (d / name).write_text(name)
    m = mount(workspace)
    while not settled(os.lstat(d), time.time_ns()):  # old enough to be kept
        time.sleep(0.01)
    src = m.path("src")
    assert sorted(os.listdir(src)) == ["a.py", "b.py"]
    assert sorted(os.listdir(src)) == ["a.py", "b.py"]

    (d / "c.py").write_text("c")
    assert sorted(os.listdir(src)) == ["a.py", "b.py", "c.py"]
    os.unlink(d / "a.py")
    assert sorted(os.listdir(src)) == ["b.py", "c.py"]
    os.rename(d / "b.py", d / "z.py")
    assert sorted(os.listdir(src)) == ["c.py", "z.py"]
    os.unlink(d / "c.py")
    os.mkdir(d / "c.py")
    assert {e.name: e.is_dir() for e in os.scandir(src)} == {"c.py": True, "z.py": False}

    # Through the mount and back out again: a staged name merges with the
    # kept workspace listing, and a step moves it into the workspace.
    (src / "new.py").write_text("n")
    assert sorted(os.listdir(src)) == ["c.py", "new.py", "z.py"]
    r = stepfs("step", m.mountpoint, "-m", "new.py")
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(d)) == ["c.py", "new.py", "z.py"]
    assert sorted(os.listdir(src)) == ["c.py", "new.py", "z.py"]
    (d / "outside.py").write_text("o")
    os.unlink(d / "new.py")
    assert sorted(os.listdir(src)) == ["c.py", "outside.py", "z.py"]


def test_the_direct_stat_fill_matches_mfusepy_for_every_attribute_shape(tmp_path):
    """``_FUSE._getattr_raw`` fills the stat struct itself for the view's usual
    attribute dicts (mfusepy's set_st_attrs looks every key up by name);
    both fills must give the same struct, and the usual dicts must take
    the direct one."""
    ws, view = open_view(tmp_path)
    root = tmp_path / "ws"
    (root / "f").write_bytes(b"12345")
    (root / "d").mkdir()
    os.symlink("f", root / "l")
    os.mknod(root / "c", stat_mod.S_IFCHR | 0o600, os.makedev(1, 3))
    view.mkdir("/nd", 0o750, owner=(0, 0), agent="a")
    view.release(view.create("/nf", 0o640, os.O_WRONLY, owner=(0, 0), agent="a"))
    view.chmod("/d", 0o700)
    fast = highlevel._FUSE.__new__(highlevel._FUSE)
    fast.encoding, fast.errors = "utf-8", "surrogateescape"
    for path in ("/", "/f", "/d", "/l", "/c", "/nd", "/nf"):
        attrs = view.getattr(path)
        assert attrs.keys() in (statbuf._STAT_KEYS, statbuf._STAT_KEYS_RDEV), path
        fast.operations = SimpleNamespace(getattr=lambda p, fh, attrs=attrs: attrs)
        got, want = mfusepy.c_stat(), mfusepy.c_stat()
        assert fast._getattr_raw(path.encode(), ctypes.addressof(got), None) == 0
        mfusepy.set_st_attrs(want, attrs, use_ns=True)
        assert bytes(got) == bytes(want), path
    assert os.major(view.getattr("/c")["st_rdev"]) == 1
