"""Outside edits reach a live mount at once (overlayfs/daemon/watch.py).

The kernel caches names and attributes for ``timeouts.ENTRY_TIMEOUT`` (60 s);
an editor working in the workspace directly must still be seen promptly.
Every check polls with a deadline far below that timeout (an event seen,
not a sleep), so a change that only showed after the timeout fails."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from conftest import sh, stepfs
from stepfs.overlayfs.daemon import timeouts

pytestmark = pytest.mark.mount

#: Well below the kernel's cache timeouts: seen through the watcher, not by
#: expiry; and long enough for a watcher thread that gets a fraction of a
#: core on a loaded machine (a wait ends as soon as the change shows).
DEADLINE = 12.0
assert DEADLINE * 4 < timeouts.ENTRY_TIMEOUT


def seen(probe, want, deadline_s: float = DEADLINE) -> bool:
    """Poll ``probe()`` until it returns ``want`` (an OSError counts as its
    errno name) or the deadline passes."""
    end = time.monotonic() + deadline_s
    while True:
        try:
            got = probe()
        except OSError as exc:
            got = os.strerror(exc.errno)
        if got == want:
            return True
        if time.monotonic() > end:
            return False
        time.sleep(0.01)


def _tree(ws: Path) -> None:
    (ws / "src" / "pkg").mkdir(parents=True)
    for name in ("a.py", "b.py", "c.py", "d.py", "e.py"):
        (ws / "src" / name).write_text(f"{name} v1\n")
    (ws / "src" / "pkg" / "m.py").write_text("m v1\n")


def _cache(m) -> None:
    """Let the kernel look everything up and cache it (ls -lR, cat)."""
    sh("ls -lR > /dev/null && cat src/*.py src/pkg/*.py > /dev/null", m.mountpoint)


def test_outside_edits_are_seen_before_the_timeout(workspace, mount):
    _tree(workspace)
    m = mount(workspace)
    _cache(m)
    src = m.path("src")

    os.chmod(workspace / "src" / "b.py", 0o600)
    assert seen(lambda: (src / "b.py").stat().st_mode & 0o777, 0o600)

    os.unlink(workspace / "src" / "c.py")
    assert seen(lambda: (src / "c.py").exists(), False)
    assert seen(lambda: (src / "c.py").read_text(), "No such file or directory")

    os.rename(workspace / "src" / "d.py", workspace / "src" / "d2.py")
    assert seen(lambda: (src / "d.py").exists(), False)
    assert (src / "d2.py").read_text() == "d.py v1\n"

    (workspace / "src" / "new.py").write_text("new\n")
    assert seen(lambda: (src / "new.py").read_text(), "new\n")
    assert "new.py" in os.listdir(src)

    before = (src / "a.py").stat().st_mtime_ns
    (workspace / "src" / "a.py").write_text("a.py v2, longer\n")  # content, size, mtime
    assert seen(lambda: (src / "a.py").stat().st_mtime_ns != before, True)
    assert (src / "a.py").stat().st_size == len("a.py v2, longer\n")
    assert (src / "a.py").read_text() == "a.py v2, longer\n"


def test_save_by_rename_and_kind_changes_outside(workspace, mount):
    _tree(workspace)
    m = mount(workspace)
    _cache(m)
    src = m.path("src")
    ino = (src / "a.py").stat().st_ino
    tmp = workspace / "src" / ".a.py.swp"
    tmp.write_text("saved by an editor\n")
    os.replace(tmp, workspace / "src" / "a.py")
    assert seen(lambda: (src / "a.py").read_text(), "saved by an editor\n")
    assert (src / "a.py").stat().st_ino != ino

    os.unlink(workspace / "src" / "b.py")
    os.mkdir(workspace / "src" / "b.py")  # a file became a directory
    assert seen(lambda: (src / "b.py").is_dir(), True)
    os.symlink("a.py", workspace / "src" / "link.tmp")
    os.replace(workspace / "src" / "link.tmp", workspace / "src" / "c.py")  # a file became a symlink
    assert seen(lambda: (src / "c.py").is_symlink(), True)
    assert os.readlink(src / "c.py") == "a.py"


def test_a_directory_moved_outside(workspace, mount):
    _tree(workspace)
    m = mount(workspace)
    _cache(m)
    os.rename(workspace / "src" / "pkg", workspace / "lib")
    assert seen(lambda: m.path("src", "pkg", "m.py").exists(), False)
    assert seen(lambda: m.path("src", "pkg").exists(), False)
    assert m.path("lib", "m.py").read_text() == "m v1\n"
    # The moved directory is watched under its new name.
    (workspace / "lib" / "m.py").write_text("m v2\n")
    assert seen(lambda: m.path("lib", "m.py").read_text(), "m v2\n")


def test_names_removed_outside_can_be_created_through_the_mount(workspace, mount):
    _tree(workspace)
    m = mount(workspace)
    _cache(m)
    os.unlink(workspace / "src" / "a.py")
    os.unlink(workspace / "src" / "b.py")
    os.unlink(workspace / "src" / "e.py")
    # The kernel may still hold the names; creating them must work anyway.
    sh("echo mine > src/a.py && mkdir src/b.py && ln -s x src/e.py", m.mountpoint)
    assert m.path("src", "a.py").read_text() == "mine\n"
    assert m.path("src", "b.py").is_dir()
    assert os.readlink(m.path("src", "e.py")) == "x"
    assert not (workspace / "src" / "a.py").exists()  # staged, not published


def test_outside_edits_in_directories_the_mount_created_and_committed(workspace, mount):
    (workspace / "top").mkdir()
    m = mount(workspace)
    sh("mkdir -p top/a/b/c && echo one > top/a/b/c/f && cat top/a/b/c/f", m.mountpoint)
    r = stepfs("step", m.mountpoint, "-m", "new tree")
    assert r.returncode == 0, r.stderr
    assert (workspace / "top" / "a" / "b" / "c" / "f").read_text() == "one\n"
    assert m.path("top", "a", "b", "c", "f").read_text() == "one\n"
    (workspace / "top" / "a" / "b" / "c" / "f").write_text("two, outside\n")
    assert seen(lambda: m.path("top", "a", "b", "c", "f").read_text(), "two, outside\n")
    (workspace / "top" / "a" / "b" / "c" / "g").write_text("g\n")
    assert seen(lambda: m.path("top", "a", "b", "c", "g").read_text(), "g\n")


def test_another_mounts_step_is_seen_at_once(workspace, mount):
    _tree(workspace)
    one, two = mount(workspace), mount(workspace)
    _cache(two)
    sh("echo 'from mount one' > src/a.py && rm src/b.py", one.mountpoint)
    r = stepfs("step", one.mountpoint, "-m", "one")
    assert r.returncode == 0, r.stderr
    assert seen(lambda: two.path("src", "a.py").read_text(), "from mount one\n")
    assert seen(lambda: two.path("src", "b.py").exists(), False)


def test_without_the_watcher_the_short_timeouts_apply(workspace, mount, monkeypatch):
    """STEPFS_WATCH=0 (and any mount that cannot watch) caches for
    SHORT_TIMEOUT only: an outside edit shows after at most that long."""
    _tree(workspace)
    monkeypatch.setenv("STEPFS_WATCH", "0")
    m = mount(workspace)
    _cache(m)
    os.chmod(workspace / "src" / "b.py", 0o600)
    assert seen(lambda: m.path("src", "b.py").stat().st_mode & 0o777, 0o600,
                deadline_s=timeouts.SHORT_TIMEOUT + DEADLINE)
    os.unlink(workspace / "src" / "c.py")
    assert seen(lambda: m.path("src", "c.py").exists(), False, deadline_s=timeouts.SHORT_TIMEOUT + DEADLINE)


def test_kept_pages_never_show_old_bytes(workspace, mount):
    """Read-only opens of an unchanged workspace file keep the kernel's
    pages (keep_cache); a write through the mount, a discard and an outside
    edit of the same size must each still be read back exactly."""
    (workspace / "f").write_text("original\n")
    m = mount(workspace)
    f = m.path("f")
    assert f.read_text() == "original\n" and f.read_text() == "original\n"
    sh("printf 'agent!!!\\n' > f", m.mountpoint)
    assert f.read_text() == "agent!!!\n" and f.read_text() == "agent!!!\n"
    r = stepfs("discard", m.mountpoint, str(f))
    assert r.returncode == 0, r.stderr
    assert f.read_text() == "original\n" and f.read_text() == "original\n"
    (workspace / "f").write_text("outside\n\n")  # same size as "original\n"
    assert seen(lambda: f.read_text(), "outside\n\n")


def test_kept_pages_of_staged_files_never_show_old_bytes(workspace, mount):
    """Staged files keep the kernel's pages across read-only opens too: a
    rewrite (in place, by rename over, by another agent) and a step must
    each still be read back exactly, at every read."""
    m = mount(workspace)
    f = m.path("f")
    sh("printf 'one\\n' > f", m.mountpoint)
    assert f.read_text() == "one\n" and f.read_text() == "one\n"
    sh("printf 'two\\n' > f", m.mountpoint)  # in place, same size
    assert f.read_text() == "two\n" and f.read_text() == "two\n"
    sh("printf 'new\\n' > t && mv t f", m.mountpoint)  # rename over, same size
    assert f.read_text() == "new\n" and f.read_text() == "new\n"
    sh("printf 'oth\\n' > f", m.mountpoint, env={"STEPFS_AGENT": "other"})
    assert f.read_text() == "oth\n" and f.read_text() == "oth\n"
    r = stepfs("step", m.mountpoint, "-m", "pages")
    assert r.returncode == 0, r.stderr
    assert f.read_text() == "oth\n" and f.read_text() == "oth\n"
    sh("printf 'end\\n' > f", m.mountpoint)
    assert f.read_text() == "end\n" and f.read_text() == "end\n"


def test_discarding_a_kind_change_shows_the_workspace_kind_at_once(workspace, mount):
    (workspace / "f").write_text("a file\n")
    m = mount(workspace)
    sh("cat f > /dev/null && rm f && mkdir f && touch f/inside", m.mountpoint)
    assert m.path("f").is_dir()
    r = stepfs("discard", m.mountpoint, str(m.path("f")))
    assert r.returncode == 0, r.stderr
    assert m.path("f").is_file() and m.path("f").read_text() == "a file\n"


def test_names_removed_outside_and_recreated_at_once_never_fail(workspace, mount):
    """The watcher's event about a removal may arrive before, during or
    after the name is recreated through the mount (and after the kernel
    dropped its parent): no system call may fail with ESTALE for it
    (issue 18 item 6).  Many names, each removed outside and at once
    recreated through the mount, so the events land at every point."""
    d = workspace / "d"
    d.mkdir()
    n = 150
    for i in range(n):
        (d / f"n{i}").write_text("v1\n")
    m = mount(workspace)
    for i in range(n):
        os.stat(m.path("d", f"n{i}"))  # the kernel holds every name
    failures = []
    for i in range(n):
        os.unlink(d / f"n{i}")
        target = m.path("d", f"n{i}")
        try:
            if i % 3 == 0:
                os.mkdir(target)
            elif i % 3 == 1:
                target.write_text("mine\n")
            else:
                os.symlink("x", target)
            os.lstat(target)
        except OSError as exc:
            failures.append((i, os.strerror(exc.errno)))
    assert failures == []
    for i in range(n):  # and later, once every event has been handled
        assert seen(lambda: os.path.lexists(m.path("d", f"n{i}")), True)
    assert sorted(os.listdir(m.path("d"))) == sorted(f"n{i}" for i in range(n))
    assert not os.listdir(d)  # staged, not published
