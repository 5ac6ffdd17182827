"""Lookups through kept directory descriptors (core/dirhandles.py) on real
mounts: after a directory the mount has looked in is renamed, replaced or
moved out of the workspace (from outside, by a step, by a rollback), names
in it are answered from the directory now at that path, well before any
timeout; and ``git status`` sees every change."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from conftest import sh, stepfs
from stepfs.overlayfs.client import control
from test_mount_watch import seen

pytestmark = [pytest.mark.mount, pytest.mark.timeout(120)]


def looked_in(m, *parts: str) -> None:
    """Have the kernel look names up in that directory (so the mount keeps it)."""
    assert m.path(*parts).exists()


def test_a_directory_replaced_outside(workspace, mount):
    (workspace / "d").mkdir()
    (workspace / "d" / "old").write_text("old\n")
    m = mount(workspace)
    looked_in(m, "d", "old")
    os.rename(workspace / "d", workspace / "d-aside")
    (workspace / "d").mkdir()
    (workspace / "d" / "new").write_text("new\n")
    assert seen(lambda: m.path("d", "new").read_text(), "new\n")
    # A name the kernel held in the old directory: looked up again (Watcher: new_epoch).
    assert seen(lambda: m.path("d", "old").exists(), False)
    assert not m.path("d", "absent-before").exists()
    (workspace / "d" / "absent-before").write_text("now\n")
    assert seen(lambda: m.path("d", "absent-before").read_text(), "now\n")
    assert m.path("d-aside", "old").read_text() == "old\n"


def test_a_directory_moved_out_of_the_workspace(workspace, mount, tmp_path):
    (workspace / "d").mkdir()
    (workspace / "d" / "f").write_text("f\n")
    m = mount(workspace)
    looked_in(m, "d", "f")
    decoy = tmp_path / "decoy"
    os.rename(workspace / "d", decoy)
    (decoy / "planted").write_text("outside\n")
    assert seen(lambda: m.path("d").exists(), False)
    assert not m.path("d", "planted").exists()
    assert control.request(str(m.mountpoint), {"op": "ping"})["ok"]


def test_steps_that_replace_a_directory(workspace, mount):
    (workspace / "d").mkdir()
    (workspace / "d" / "old").write_text("old\n")
    m = mount(workspace)
    looked_in(m, "d", "old")
    # A file in its place, then a directory again: a new one in the workspace.
    sh("rm -r d && echo file > d", m.mountpoint)
    assert stepfs("step", m.mountpoint, "-m", "file").returncode == 0
    sh("rm d && mkdir d && echo mine > d/mine", m.mountpoint)
    assert stepfs("step", m.mountpoint, "-m", "dir again").returncode == 0
    (workspace / "d" / "outside").write_text("outside\n")  # into the directory the step made
    assert seen(lambda: m.path("d", "outside").read_text(), "outside\n")
    assert m.path("d", "mine").read_text() == "mine\n" and not m.path("d", "old").exists()


def test_a_rollback_that_brings_a_directory_back(workspace, mount):
    (workspace / "d").mkdir()
    (workspace / "d" / "f").write_text("v1\n")
    m = mount(workspace)
    first = json.loads(stepfs("step", "--json", "--allow-empty", m.mountpoint).stdout)["number"]
    looked_in(m, "d", "f")
    sh("mv d d-v1 && mkdir d && echo v2 > d/g", m.mountpoint)
    assert stepfs("step", m.mountpoint, "-m", "v2").returncode == 0
    looked_in(m, "d", "g")
    r = stepfs("rollback", m.mountpoint, str(first))
    assert r.returncode == 0, r.stderr
    (workspace / "d" / "outside").write_text("outside\n")  # into the directory the rollback made
    assert seen(lambda: m.path("d", "outside").read_text(), "outside\n")
    assert m.path("d", "f").read_text() == "v1\n"
    assert not m.path("d", "g").exists() and not m.path("d-v1").exists()


def test_git_status_sees_outside_changes_to_its_directories(workspace, mount):
    repo = workspace / "repo"
    (repo / "src" / "pkg").mkdir(parents=True)
    for i in range(20):
        (repo / "src" / "pkg" / f"m{i}.py").write_text(f"x = {i}\n")
    sh("git init -q && git add -A && git -c user.name=t -c user.email=t@t commit -qm init", repo)
    m = mount(workspace)
    assert sh("git status --porcelain", m.path("repo")).stdout == b""
    # Outside: the package directory is swapped for an edited copy.
    shutil.copytree(repo / "src" / "pkg", repo / "src" / "pkg2")
    (repo / "src" / "pkg2" / "m3.py").write_text("x = 'changed'\n")
    os.rename(repo / "src" / "pkg", repo / "src" / "pkg-old")
    os.rename(repo / "src" / "pkg2", repo / "src" / "pkg")
    assert seen(lambda: sh("git status --porcelain --untracked-files=no", m.path("repo")).stdout,
                b" M src/pkg/m3.py\n")
