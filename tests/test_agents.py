"""Agent identity of calling processes (overlayfs/core/agents.py), without a mount.

Real processes show the environment lookup, and that a process that
exec()s with a new ``STEPFS_AGENT`` is the new agent at once; a fake
``/proc`` (identities and environments by pid) with a real process's pidfd
and environ descriptor standing in for the caller shows that a reused pid
is never taken for the old process, and that a live last caller costs no
``/proc`` read.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from stepfs.overlayfs.core import agents
from stepfs.overlayfs.core.agents import DEFAULT, Agents

SLEEPER = [sys.executable, "-c", "import sys; print('up', flush=True); sys.stdin.read()"]


def _spawn(env_agent: str | None) -> subprocess.Popen:
    """A process that waits for its stdin to close, once it runs (its exec
    has ended: a process in the middle of its exec has no environment yet)."""
    env = {k: v for k, v in os.environ.items() if k != "STEPFS_AGENT"}
    if env_agent is not None:
        env["STEPFS_AGENT"] = env_agent
    p = subprocess.Popen(SLEEPER, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    assert p.stdout.readline() == b"up\n"
    return p


def _end(p: subprocess.Popen) -> None:
    p.stdin.close()
    p.wait()


def test_real_processes_get_the_agent_of_their_environment():
    named, plain = _spawn("sub-1"), _spawn(None)
    try:
        a = Agents()
        assert a.of(named.pid) == "sub-1"
        assert a.of(plain.pid) == DEFAULT
        assert a.of(named.pid) == "sub-1"
        assert a.of(0) == DEFAULT  # a request without a caller (release)
    finally:
        _end(named)
        _end(plain)


class FakeProc:
    """``/proc`` for one pid (whose parent is gone unless ``parent_image``
    is set), and which real process's pidfd and environ stand for it."""

    PARENT = 4141

    def __init__(self, monkeypatch, pid: int):
        self.pid = pid
        self.start = b"100"
        self.image = b"7000-7100"
        self.parent_image: bytes | None = None
        self.agent: str | None = "first"
        self.reads = 0
        self.stand_in: subprocess.Popen | None = None
        self.on_environ = lambda: None
        monkeypatch.setattr(agents, "_proc_stat", self._proc_stat)
        monkeypatch.setattr(agents, "_agent_from_environ", self._environ)
        monkeypatch.setattr(agents, "_pidfd", self._pidfd)
        monkeypatch.setattr(agents, "_environ_fd", self._environ_fd)

    def _proc_stat(self, pid: int):
        if pid == self.PARENT:
            return None if self.parent_image is None else (b"1@" + self.parent_image, 1, self.parent_image)
        assert pid == self.pid
        self.reads += 1
        return self.start + b"@" + self.image, self.PARENT, self.image

    def _environ(self, pid: int):
        self.reads += 1
        self.on_environ()
        return self.agent

    def _pidfd(self, pid: int) -> int:
        return os.pidfd_open(self.stand_in.pid) if self.stand_in is not None else -1

    def _environ_fd(self, pid: int) -> int:
        return os.open(f"/proc/{self.stand_in.pid}/environ", os.O_RDONLY) if self.stand_in is not None else -1


@pytest.fixture
def fake(monkeypatch):
    f = FakeProc(monkeypatch, pid=4242)
    yield f
    if f.stand_in is not None and f.stand_in.poll() is None:
        _end(f.stand_in)


def test_a_live_last_caller_costs_no_proc_read(fake):
    fake.stand_in = _spawn(None)
    a = Agents()
    assert a.of(fake.pid) == "first"
    reads = fake.reads
    for _ in range(5):
        assert a.of(fake.pid) == "first"
    assert fake.reads == reads


def test_a_reused_pid_is_never_the_old_process(fake):
    fake.stand_in = _spawn(None)
    a = Agents()
    assert a.of(fake.pid) == "first"
    # The caller exits and a new process gets its pid.
    _end(fake.stand_in)
    fake.stand_in = _spawn(None)
    fake.start, fake.agent = b"200", "second"
    assert a.of(fake.pid) == "second"
    assert a.of(fake.pid) == "second"


def test_without_a_pidfd_the_start_time_decides(fake):
    """A thread id (pidfd_open refuses it): every call reads the start time,
    the environment only when the start time changed."""
    a = Agents()
    assert a.of(fake.pid) == "first"
    reads = fake.reads
    fake.agent = "changed environment of the same process"  # not read again
    assert a.of(fake.pid) == "first"
    assert fake.reads == reads + 1  # the identity only
    fake.start, fake.agent = b"300", "third"
    assert a.of(fake.pid) == "third"


def test_a_caller_that_exits_during_the_lookup_is_not_cached_by_pidfd(fake):
    """The pidfd is opened before /proc is read; if that process is already
    gone afterwards, what was read may belong to a successor: no fast path."""
    fake.stand_in = _spawn(None)
    fake.on_environ = lambda: _end(fake.stand_in)  # exits while its environment is read
    a = Agents()
    assert a.of(fake.pid) == "first"
    reads = fake.reads
    assert a.of(fake.pid) == "first"
    assert fake.reads > reads  # looked up again (start time), not trusted


def test_a_process_sharing_its_parents_image_takes_no_fast_path(fake):
    """A vfork child before its exec (environment at its parent's addresses):
    its exec would leave the environ descriptor readable, so every call
    checks the identity, and the exec (a new image) reads the new agent."""
    fake.stand_in = _spawn(None)
    fake.parent_image = fake.image
    a = Agents()
    assert a.of(fake.pid) == "first"
    reads = fake.reads
    assert a.of(fake.pid) == "first"
    assert fake.reads == reads + 1  # the identity, every time
    fake.image, fake.agent = b"9000-9100", "exec'd"
    assert a.of(fake.pid) == "exec'd"
    reads = fake.reads
    assert a.of(fake.pid) == "exec'd"
    assert fake.reads == reads  # its own image now: the fast path


EXECS = r"""
import os, sys
sys.stdin.readline()
env = {**os.environ, "STEPFS_AGENT": "after-exec"}
os.execve(sys.executable, [sys.executable, "-c", "import sys; print('exec done', flush=True); sys.stdin.read()"], env)
"""


def test_a_process_that_execs_with_a_new_agent_is_looked_up_again():
    """The same pid, the same start time, a new image and environment: the
    cached agent (fast path and identity cache alike) must not outlive the exec."""
    env = {k: v for k, v in os.environ.items() if k != "STEPFS_AGENT"}
    p = subprocess.Popen([sys.executable, "-c", "print('up', flush=True)\n" + EXECS], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, env={**env, "STEPFS_AGENT": "before-exec"})
    assert p.stdout.readline() == b"up\n"
    other = _spawn(None)
    try:
        fast, slow = Agents(), Agents()
        assert fast.of(p.pid) == "before-exec"
        assert fast.of(p.pid) == "before-exec"  # the fast path
        assert slow.of(p.pid) == "before-exec"
        assert slow.of(other.pid) == DEFAULT  # p is no longer the last caller: the identity cache decides
        p.stdin.write(b"go\n")
        p.stdin.flush()
        assert p.stdout.readline() == b"exec done\n"
        assert fast.of(p.pid) == "after-exec"
        assert slow.of(p.pid) == "after-exec"
        assert fast.of(p.pid) == "after-exec"
    finally:
        _end(p)
        _end(other)
