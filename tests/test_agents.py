"""Agent identity of calling processes (overlayfs/agents.py), without a mount.

Real processes show the environment lookup; a fake ``/proc`` (start times
and environments by pid) with a real process's pidfd standing in for the
caller shows that a reused pid is never taken for the old process, and that
a live last caller costs no ``/proc`` read.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from overlayfs import agents
from overlayfs.agents import DEFAULT, Agents

SLEEPER = [sys.executable, "-c", "import sys; sys.stdin.read()"]


def _spawn(env_agent: str | None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "STEPFS_AGENT"}
    if env_agent is not None:
        env["STEPFS_AGENT"] = env_agent
    return subprocess.Popen(SLEEPER, stdin=subprocess.PIPE, env=env)


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
    """``/proc`` for one pid, and which real process's pidfd stands for it."""

    def __init__(self, monkeypatch, pid: int):
        self.pid = pid
        self.start = b"100"
        self.agent: str | None = "first"
        self.reads = 0
        self.stand_in: subprocess.Popen | None = None
        self.on_environ = lambda: None
        monkeypatch.setattr(agents, "_start_time", self._start_time)
        monkeypatch.setattr(agents, "_agent_from_environ", self._environ)
        monkeypatch.setattr(agents, "_pidfd", self._pidfd)

    def _start_time(self, pid: int):
        assert pid == self.pid
        self.reads += 1
        return self.start

    def _environ(self, pid: int):
        self.reads += 1
        self.on_environ()
        return self.agent

    def _pidfd(self, pid: int) -> int:
        return os.pidfd_open(self.stand_in.pid) if self.stand_in is not None else -1


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
    assert fake.reads == reads + 1  # the start time only
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
