"""Robustness through a real mount (the ``mount`` fixture).

* A daemon SIGKILLed right after ``mv`` of a directory holding a staged
  subtree: after the next mount every file is there, under the old name or
  the new one (never both, never neither), with its content.
* A process that exec()s with a new ``STEPFS_AGENT`` is the new agent from
  then on, even when the process already made requests before its exec (a
  shell's redirection opens the file in the forked child, before the exec
  of the command).
"""

from __future__ import annotations

import os
import select
import subprocess

import pytest

from conftest import sh, stepfs

pytestmark = pytest.mark.mount


@pytest.mark.timeout(90)
def test_a_daemon_killed_right_after_a_directory_move_keeps_every_file(workspace, mount):
    (workspace / "w").mkdir()
    (workspace / "w" / "old.txt").write_bytes(b"from the workspace\n")
    m = mount(workspace)
    files = {f"sub/f{i}.txt": f"staged {i}\n".encode() for i in range(20)}
    files["sub/deeper/g.txt"] = b"deeper\n"
    sh("mkdir -p d/sub/deeper w/new && " + " && ".join(
        f"printf '{data.decode()[:-1]}\\n' > d/{name}" for name, data in files.items()
    ) + " && printf 'in w\\n' > w/new/h.txt && sync d/sub/deeper/g.txt", cwd=m.mountpoint)
    # `sync FILE` fsyncs the file, which writes every recorded staged row
    # (a bare `sync` never reaches a FUSE daemon: the kernel sends SYNCFS to
    # virtiofs only), so the store holds every file before the moves.
    files = {f"d/{k}": v for k, v in files.items()}
    files["w/new/h.txt"] = b"in w\n"
    files["w/old.txt"] = b"from the workspace\n"
    # Both moves and the kill in one shell: no time for the row timer.
    pidfd = os.pidfd_open(m.pid)
    try:
        sh(f"mv d e && mv w v && kill -9 {m.pid}", cwd=m.mountpoint, check=False)
        assert select.select([pidfd], [], [], 30)[0], "the daemon did not die"
    finally:
        os.close(pidfd)
    again = mount(workspace, m.mountpoint)
    moved = {"d/": "e/", "w/": "v/"}
    for name, data in files.items():
        old_path, new_path = again.path(name), again.path(moved[name[:2]] + name[2:])
        here = [p for p in (old_path, new_path) if p.exists()]
        assert len(here) == 1, (name, here)
        assert here[0].read_bytes() == data, name
    # Each move happened entirely or not at all.
    for old, new in (("d", "e"), ("w", "v")):
        assert again.path(old).exists() != again.path(new).exists(), (old, new)


@pytest.mark.timeout(90)
def test_a_process_that_execs_with_a_new_agent_is_that_agent(workspace, mount):
    """--require-read tells the agents apart: the default agent has read
    ``f.txt``, agent ``b`` has not, so ``b`` may not write it.  The forked
    shell opens ``log.txt`` (as the default agent) before it exec()s ``sh``
    with ``STEPFS_AGENT=b``: the same pid, a new agent.  Likewise a script
    in the mount run as agent ``c``."""
    (workspace / "f.txt").write_bytes(b"original\n")
    (workspace / "tool.sh").write_bytes(b"#!/bin/sh\necho by-c > f.txt\n")
    (workspace / "tool.sh").chmod(0o755)
    m = mount(workspace, require_read=True)
    env = {k: v for k, v in os.environ.items() if k != "STEPFS_AGENT"}
    cmd = "cat f.txt > /dev/null && STEPFS_AGENT=b sh -c 'echo by-b > f.txt' > log.txt"
    result = subprocess.run(["bash", "-c", cmd], cwd=m.mountpoint, capture_output=True, env=env, timeout=60)
    assert result.returncode != 0, "agent b wrote a file it never read: it was taken for the default agent"
    assert b"Permission denied" in result.stderr, result.stderr
    assert m.path("f.txt").read_bytes() == b"original\n"
    assert "last error (b): /f.txt: EACCES" in m.path(".stepfs", "status").read_text()
    # Python's subprocess starts a child by vfork; the kernel opens the
    # script in the mount for its exec while the child still shares its
    # parent's memory (and environment).
    result = subprocess.run(["./tool.sh"], cwd=m.mountpoint, capture_output=True, timeout=60,
                            env={**env, "STEPFS_AGENT": "c"})
    assert result.returncode != 0 and b"Permission denied" in result.stderr, result
    assert "last error (c): /f.txt: EACCES" in m.path(".stepfs", "status").read_text()
    # The default agent, which read it, may write it.
    result = subprocess.run(["bash", "-c", "echo by-default > f.txt"], cwd=m.mountpoint, capture_output=True,
                            env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    assert m.path("f.txt").read_bytes() == b"by-default\n"


@pytest.mark.timeout(90)
def test_a_discard_elsewhere_keeps_the_link_count_of_a_removed_hard_link(workspace, mount):
    """``rm b`` of a workspace file linked as ``a`` and ``b``: ``a`` shows one
    link, also after ``stepfs discard`` of an unrelated path (and two once
    ``b`` itself is discarded)."""
    (workspace / "a").write_bytes(b"linked\n")
    os.link(workspace / "a", workspace / "b")
    (workspace / "other.txt").write_bytes(b"other\n")
    m = mount(workspace)
    sh("rm b && echo staged > other.txt", cwd=m.mountpoint)
    assert sh("stat -c %h a", cwd=m.mountpoint).stdout == b"1\n"
    assert stepfs("discard", m.mountpoint, "other.txt").returncode == 0
    assert sh("stat -c %h a", cwd=m.mountpoint).stdout == b"1\n"
    assert not m.path("b").exists()
    assert stepfs("discard", m.mountpoint, "b").returncode == 0
    assert sh("stat -c %h a b", cwd=m.mountpoint).stdout == b"2\n2\n"
