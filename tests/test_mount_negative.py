"""Cached negative names never hide a name that appeared (StepFS._negative,
KernelCache._expire_negatives).

A watching mount lets the kernel keep "no such name" for
``timeouts.NEGATIVE_TIMEOUT`` (60 s): a warm ``git status`` then asks the
daemon nothing about the files it probes and does not find.  Every test
first has the kernel cache a name as absent (checked through ``ping``), then
makes the name appear by a route that does not go through this mount's
kernel (an outside edit, another mount's step, a rollback, a discard, a new
layer), and checks that the name shows well before the timeout: expired by
the mount, not by age."""

from __future__ import annotations

import json
import os
import time

import pytest

from conftest import sh, stepfs
from stepfs.overlayfs.client import control
from stepfs.overlayfs.daemon import timeouts
from test_mount_watch import DEADLINE, seen

pytestmark = pytest.mark.mount

assert DEADLINE * 4 < timeouts.NEGATIVE_TIMEOUT


def ping(m) -> dict:
    return control.request(str(m.mountpoint), {"op": "ping"})


def absent(m, *names: str) -> None:
    """Look each name up (twice: the second from the kernel's cache) until
    the mount has recorded negatives (at least that many).  A lookup
    answered while the watcher still tells the kernel about an earlier
    outside change is not recorded (that change may be about the name),
    and the watcher's forget of a directory expires the names below it:
    on a busy machine the event that made a name absent can still be in
    flight, so the names are looked up again until they are recorded."""
    end = time.monotonic() + DEADLINE
    while True:
        for name in names:
            assert not os.path.lexists(m.path(*name.split("/")))
            assert not os.path.lexists(m.path(*name.split("/")))
        if ping(m)["negatives_noted"] >= len(names):
            return
        assert time.monotonic() < end, f"no negatives recorded for {names}: {ping(m)}"
        time.sleep(0.02)


def test_negatives_are_cached_on_this_mount(mnt):
    # Pins the lever: a kernel or libfuse without it still works, slower.
    assert ping(mnt)["negatives_cached"] is True
    absent(mnt, "nothing-here")


def test_names_created_outside_show_at_once(workspace, mount):
    (workspace / "src").mkdir()
    (workspace / "elsewhere").write_text("moved in\n")
    m = mount(workspace)
    absent(m, "src/new.py", "src/newdir", "src/moved", "deep")
    (workspace / "src" / "new.py").write_text("new\n")
    (workspace / "src" / "newdir").mkdir()
    os.rename(workspace / "elsewhere", workspace / "src" / "moved")
    (workspace / "deep" / "a" / "b").mkdir(parents=True)
    (workspace / "deep" / "a" / "b" / "f").write_text("f\n")
    assert seen(lambda: m.path("src", "new.py").read_text(), "new\n")
    assert seen(lambda: m.path("src", "newdir").is_dir(), True)
    assert seen(lambda: m.path("src", "moved").read_text(), "moved in\n")
    assert seen(lambda: m.path("deep", "a", "b", "f").read_text(), "f\n")
    # Through the mount a cached negative is simply replaced.
    sh("echo mine > src/mine && mkdir src/minedir", m.mountpoint)
    assert m.path("src", "mine").read_text() == "mine\n" and m.path("src", "minedir").is_dir()


def test_a_name_removed_and_recreated_outside(workspace, mount):
    (workspace / "f").write_text("v1\n")
    m = mount(workspace)
    assert m.path("f").read_text() == "v1\n"
    os.unlink(workspace / "f")
    assert seen(lambda: m.path("f").exists(), False)
    absent(m, "f")
    (workspace / "f").write_text("v2\n")
    assert seen(lambda: m.path("f").read_text(), "v2\n")


def test_another_mounts_step_shows_at_once(workspace, mount):
    (workspace / "src").mkdir()
    one, two = mount(workspace), mount(workspace)
    absent(two, "src/from-one", "newdir")
    sh("echo 'from mount one' > src/from-one && mkdir newdir && echo x > newdir/x", one.mountpoint)
    r = stepfs("step", one.mountpoint, "-m", "one")
    assert r.returncode == 0, r.stderr
    assert seen(lambda: two.path("src", "from-one").read_text(), "from mount one\n")
    assert seen(lambda: two.path("newdir", "x").read_text(), "x\n")


def test_rollback_brings_back_a_name_at_once(workspace, mount):
    (workspace / "keep").write_text("keep\n")
    (workspace / "d").mkdir()
    (workspace / "d" / "inner").write_text("inner\n")
    m = mount(workspace)
    first = json.loads(stepfs("step", "--json", "--allow-empty", m.mountpoint).stdout)["number"]
    sh("rm keep && rm -r d", m.mountpoint)
    r = stepfs("step", m.mountpoint, "-m", "removed")
    assert r.returncode == 0, r.stderr
    absent(m, "keep", "d")
    out = stepfs("rollback", m.mountpoint, str(first))
    assert out.returncode == 0, out.stderr
    assert m.path("keep").read_text() == "keep\n"
    assert m.path("d", "inner").read_text() == "inner\n"


def test_discard_brings_back_a_name_at_once(workspace, mount):
    (workspace / "f").write_text("workspace\n")
    m = mount(workspace)
    sh("rm f", m.mountpoint)
    absent(m, "f")
    r = stepfs("discard", m.mountpoint, str(m.path("f")))
    assert r.returncode == 0, r.stderr
    assert m.path("f").read_text() == "workspace\n"


def test_a_new_layer_shows_at_once(mnt):
    root = mnt.mountpoint
    mnt.path("f").write_text("f\n")
    number = json.loads(stepfs("step", "--json", root).stdout)["number"]
    nxt = str(number + 1)
    time.sleep(0.5)  # the step's own events handled: they would keep any name from being cached
    before = ping(mnt)["negatives_noted"]
    assert not mnt.path(".stepfs", "layers", nxt).exists()
    assert not mnt.path(".stepfs", "layers", nxt).exists()
    absent(mnt, "plain")  # an ordinary name is cached at this moment
    assert ping(mnt)["negatives_noted"] == before + 1
    mnt.path("g").write_text("g\n")
    assert json.loads(stepfs("step", "--json", root).stdout)["number"] == number + 1
    assert mnt.path(".stepfs", "layers", nxt).is_dir()


def test_unversioned_names_are_never_cached_absent(workspace, mount):
    # node_modules is unversioned by default: the watcher does not watch
    # it, and a run's bind mount writes to it past the mount's kernel.
    (workspace / "node_modules").mkdir()
    m = mount(workspace)
    before = ping(m)["negatives_noted"]
    assert not m.path("node_modules", "pkg").exists()
    assert not m.path("node_modules", "pkg").exists()
    assert ping(m)["negatives_noted"] == before
    (workspace / "node_modules" / "pkg").write_text("pkg\n")
    assert m.path("node_modules", "pkg").read_text() == "pkg\n"  # no wait: nothing was cached


def test_a_mount_that_cannot_watch_caches_no_negative(workspace, mount, monkeypatch):
    monkeypatch.setenv("STEPFS_WATCH", "0")
    m = mount(workspace)
    assert ping(m)["negatives_cached"] is False
    assert not m.path("f").exists() and not m.path("f").exists()
    assert ping(m)["negatives_noted"] == 0
    (workspace / "f").write_text("f\n")
    assert m.path("f").read_text() == "f\n"  # no wait: nothing was cached
