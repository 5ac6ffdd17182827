"""Agent identity of a calling process (FUSE-free).

One mount is one agent (:data:`DEFAULT`) unless the caller's environment
carries ``STEPFS_AGENT=<name>``; children inherit their parent's environment,
so a subtask and everything it starts are one agent.  The environment is read
from ``/proc/<pid>/environ`` once per process and cached; the cache entry is
keyed by the process start time so a reused pid is never mistaken for the
old process.

Fast path: consecutive requests mostly come from one process (``tar -x``
sends ten per file).  For the last caller the cache also holds a pidfd
(``pidfd_open``), opened *before* its ``/proc`` files were read: while the
pidfd does not poll readable that very process is alive, so its pid cannot
have been reused and the cached agent is still its own, without reading
``/proc/<pid>/stat`` again.  A pid that pidfd_open refuses (a thread other
than the main one: FUSE reports thread ids) takes the start-time path.

Known limit (as before): a process that calls ``execve`` with a new
``STEPFS_AGENT`` keeps the agent cached for its pid before the exec.

Threading: called under the view's lock (or from the single FUSE thread).
"""

from __future__ import annotations

import os
import select

DEFAULT = "default"
ENV_NAME = b"STEPFS_AGENT="
_CACHE_LIMIT = 4096


def _start_time(pid: int) -> bytes | None:
    """Field 22 of ``/proc/<pid>/stat`` (start time in clock ticks since boot)."""
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        data = os.read(fd, 4096)
    except OSError:
        return None
    finally:
        os.close(fd)
    # comm may contain spaces and parentheses: split after the last ')'.
    fields = data[data.rfind(b")") + 2:].split(b" ", 20)
    return fields[19] if len(fields) > 20 else None


def _agent_from_environ(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read()
    except OSError:
        return None
    for item in env.split(b"\0"):
        if item.startswith(ENV_NAME):
            name = item[len(ENV_NAME):].decode("utf-8", "replace").strip()
            return name or None
    return None


def _pidfd(pid: int) -> int:
    """A pidfd of ``pid``, or -1 (not a thread-group leader, gone, or no
    pidfd support)."""
    try:
        return os.pidfd_open(pid)
    except (OSError, AttributeError):
        return -1


class Agents:
    """pid -> agent name, cached per process."""

    def __init__(self, default: str = DEFAULT):
        self.default = default
        self._cache: dict[int, tuple[bytes | None, str]] = {}
        # The last caller: pid, agent, and a poller of its pidfd (None: no pidfd).
        self._last_pid = 0
        self._last_agent = default
        self._last_fd = -1
        self._last_poll: select.poll | None = None

    def of(self, pid: int) -> str:
        if pid <= 0:
            return self.default
        if pid == self._last_pid:
            if self._last_poll is None:
                return self._lookup(pid)  # no pidfd for this caller (a thread)
            if not self._last_poll.poll(0):
                return self._last_agent  # the same live process (module doc)
        fd = _pidfd(pid)  # before the lookup: see _remember
        agent = self._lookup(pid)
        self._remember(pid, agent, fd)
        return agent

    def _lookup(self, pid: int) -> str:
        start = _start_time(pid)
        hit = self._cache.get(pid)
        if hit is not None and hit[0] == start:
            return hit[1]
        agent = _agent_from_environ(pid) or self.default
        if len(self._cache) >= _CACHE_LIMIT:
            self._cache.clear()
        self._cache[pid] = (start, agent)
        return agent

    def _remember(self, pid: int, agent: str, fd: int) -> None:
        """Make ``pid`` the last caller.  ``fd`` was opened before ``agent``
        was looked up; it is kept only if that process is still alive now,
        i.e. the /proc files read belonged to it."""
        self.close()
        poller = None
        if fd >= 0:
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            if poller.poll(0):  # exited meanwhile: what we read may be another process's
                os.close(fd)
                fd, poller = -1, None
        self._last_pid, self._last_agent, self._last_fd, self._last_poll = pid, agent, fd, poller

    def close(self) -> None:
        """Drop the last caller's pidfd."""
        if self._last_fd >= 0:
            os.close(self._last_fd)
        self._last_pid, self._last_fd, self._last_poll = 0, -1, None
