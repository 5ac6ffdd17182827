"""Agent identity of a calling process (FUSE-free).

One mount is one agent (:data:`DEFAULT`) unless the caller's environment
carries ``STEPFS_AGENT=<name>``; children inherit their parent's environment,
so a subtask and everything it starts are one agent.  The environment is read
from ``/proc/<pid>/environ`` once per process and cached; the cache entry is
keyed by the process start time so a reused pid is never mistaken for the
old process.

Threading: called under the view's lock (or from the single FUSE thread).
"""

from __future__ import annotations

DEFAULT = "default"
ENV_NAME = b"STEPFS_AGENT="
_CACHE_LIMIT = 4096


def _start_time(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # comm may contain spaces and parentheses: split after the last ')'.
    fields = data[data.rfind(b")") + 2:].split()
    return fields[19].decode() if len(fields) > 19 else None


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


class Agents:
    """pid -> agent name, cached per process."""

    def __init__(self, default: str = DEFAULT):
        self.default = default
        self._cache: dict[int, tuple[str | None, str]] = {}

    def of(self, pid: int) -> str:
        if pid <= 0:
            return self.default
        start = _start_time(pid)
        hit = self._cache.get(pid)
        if hit is not None and hit[0] == start:
            return hit[1]
        agent = _agent_from_environ(pid) or self.default
        if len(self._cache) >= _CACHE_LIMIT:
            self._cache.clear()
        self._cache[pid] = (start, agent)
        return agent
