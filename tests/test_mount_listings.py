"""Kernel-cached directory listings never go stale (libfuse.lowlevel.ListingCache).

A stepfs mount lets the kernel keep each directory's listing across
opendir calls (what makes a warm ``git status`` cheap).  Every test lists a
directory twice first, so the listing is cached, then changes it by one
route (through the mount, outside edit, step, discard, rollback) and checks
that real programs (``ls``, ``find``, Python's listdir) see the new set.
Outside edits are polled with a deadline far below the cache timeouts: seen
through the watcher's invalidation, not by expiry."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import sh, stepfs
from stepfs.overlayfs.client import control
from test_mount_watch import seen

pytestmark = pytest.mark.mount


def ls(d: Path) -> list[str]:
    """The listing as ``ls -A`` prints it (a real program, its own opendir)."""
    return sh("LC_ALL=C ls -A", d).stdout.decode().split()


def cached(d: Path) -> list[str]:
    """List ``d`` twice (the second listing is served from the kernel's
    cache) and return what both showed."""
    first = ls(d)
    assert sorted(os.listdir(d)) == first
    return first


def test_listings_are_cached_on_this_mount(mnt):
    # Pins the lever itself: if libfuse's layout is not the known one the
    # mount still works, but git status and ls -R lose their warm speed.
    assert control.request(str(mnt.mountpoint), {"op": "ping"})["listings_cached"] is True


def test_changes_through_the_mount_show_in_cached_listings(workspace, mount):
    (workspace / "d").mkdir()
    (workspace / "d" / "a").write_text("a\n")
    (workspace / "e").mkdir()
    m = mount(workspace)
    d, e = m.path("d"), m.path("e")
    assert cached(d) == ["a"] and cached(e) == []
    sh("echo b > b && mkdir sub && ln -s a link", d)
    assert cached(d) == ["a", "b", "link", "sub"]
    sh("rm b && rmdir sub && mv a a2", d)
    assert cached(d) == ["a2", "link"]
    sh("mv d/a2 e/moved && mv d/link e/", m.mountpoint)  # across directories: both listings change
    assert cached(d) == [] and cached(e) == ["link", "moved"]
    os.link(e / "moved", d / "hard")
    assert cached(d) == ["hard"]
    assert sh("find . -type f | sort", m.mountpoint).stdout.decode().split() == ["./d/hard", "./e/moved"]


def test_outside_edits_show_in_cached_listings(workspace, mount):
    (workspace / "d").mkdir()
    (workspace / "d" / "a").write_text("a\n")
    (workspace / "d" / "b").write_text("b\n")
    m = mount(workspace)
    d = m.path("d")
    assert cached(d) == ["a", "b"] and "d" in cached(m.mountpoint)
    (workspace / "d" / "new").write_text("new\n")
    assert seen(lambda: ls(d), ["a", "b", "new"])
    os.unlink(workspace / "d" / "a")
    assert seen(lambda: ls(d), ["b", "new"])
    os.rename(workspace / "d" / "b", workspace / "d" / "b2")
    assert seen(lambda: ls(d), ["b2", "new"])
    (workspace / "d" / "sub").mkdir()
    assert seen(lambda: ls(d), ["b2", "new", "sub"])
    assert cached(d / "sub") == []
    (workspace / "d" / "sub" / "deep").write_text("deep\n")
    assert seen(lambda: ls(d / "sub"), ["deep"])
    os.rename(workspace / "d", workspace / "d2")  # the root's listing
    assert seen(lambda: sorted(os.listdir(m.mountpoint)), ["d2"])
    assert ls(m.path("d2", "sub")) == ["deep"]


def test_step_and_discard_keep_cached_listings_true(workspace, mount):
    (workspace / "keep").write_text("keep\n")
    m = mount(workspace)
    root = m.mountpoint
    m.path("staged").write_text("staged\n")
    m.path("dir").mkdir()
    m.path("dir", "inner").write_text("inner\n")
    assert cached(root) == ["dir", "keep", "staged"] and cached(m.path("dir")) == ["inner"]
    assert stepfs("step", root).returncode == 0
    assert cached(root) == ["dir", "keep", "staged"] and cached(m.path("dir")) == ["inner"]
    # After a step the workspace holds those names; outside edits still show.
    os.unlink(workspace / "staged")
    assert seen(lambda: ls(root), ["dir", "keep"])
    # Discard drops staged names (the workspace shows through again).
    m.path("dropme").write_text("x\n")
    m.path("dir", "dropme2").write_text("y\n")
    assert cached(root) == ["dir", "dropme", "keep"] and cached(m.path("dir")) == ["dropme2", "inner"]
    out = stepfs("discard", "--json", root, "dropme", "dir/dropme2")
    assert out.returncode == 0, out.stderr
    assert sorted(json.loads(out.stdout)["discarded"]) == ["dir/dropme2", "dropme"]
    assert ls(root) == ["dir", "keep"] and ls(m.path("dir")) == ["inner"]


def test_rollback_shows_the_old_listings(workspace, mount):
    (workspace / "base").write_text("base\n")
    m = mount(workspace)
    root = m.mountpoint
    first = json.loads(stepfs("step", "--json", "--allow-empty", root).stdout)["number"]
    # A later layer adds a nested directory, a file, and removes one.
    sh("mkdir -p new/deeper && echo x > new/deeper/f && echo y > added && rm base", root)
    later = json.loads(stepfs("step", "--json", root).stdout)["number"]
    assert cached(root) == ["added", "new"] and cached(m.path("new")) == ["deeper"]
    assert cached(m.path("new", "deeper")) == ["f"]
    out = stepfs("rollback", "--json", root, str(first))
    assert out.returncode == 0, out.stderr
    assert ls(root) == ["base"]
    assert sh("find . | sort", root).stdout.decode().split() == [".", "./base"]
    # Undo the rollback: the later layer's names come back.
    assert stepfs("rollback", root, str(later)).returncode == 0
    assert ls(root) == ["added", "new"] and ls(m.path("new", "deeper")) == ["f"]


def test_layers_listing_is_never_cached(mnt):
    root = mnt.mountpoint
    layers = mnt.path(".stepfs", "layers")
    before = cached(layers)
    mnt.path("f").write_text("f\n")
    number = json.loads(stepfs("step", "--json", root).stdout)["number"]
    assert ls(layers) == sorted(before + [str(number)])
    assert ls(layers / str(number)) == ["f"]


def test_a_mount_that_cannot_watch_caches_no_listing(workspace, mount, monkeypatch):
    (workspace / "a").write_text("a\n")
    monkeypatch.setenv("STEPFS_WATCH", "0")
    m = mount(workspace)
    assert control.request(str(m.mountpoint), {"op": "ping"})["listings_cached"] is False
    assert cached(m.mountpoint) == ["a"]
    (workspace / "b").write_text("b\n")
    assert ls(m.mountpoint) == ["a", "b"]  # the very next listing: nothing was cached
