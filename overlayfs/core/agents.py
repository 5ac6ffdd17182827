"""Agent identity of a calling process (FUSE-free).

One mount is one agent (:data:`DEFAULT`) unless the caller's environment
carries ``STEPFS_AGENT=<name>``; children inherit their parent's environment,
so a subtask and everything it starts are one agent.  The environment is read
from ``/proc/<pid>/environ`` once per process image and cached; the cache
entry is keyed by the process's *identity* from ``/proc/<pid>/stat``: its
start time (a reused pid is never mistaken for the old process) and the
addresses of its environment (``env_start``, ``env_end``), which every
``execve`` sets anew (the new image's stack, randomised by ASLR), so a
process that exec()s with another ``STEPFS_AGENT`` -- a shell's forked child
that opened a redirection in the mount before it exec()s the command, or
the kernel opening a script in the mount for the exec -- is looked up again.

Fast path: consecutive requests mostly come from one process (``tar -x``
sends ten per file).  For the last caller the cache also holds a pidfd
(``pidfd_open``) and a descriptor of its ``/proc/<pid>/environ``, both
opened *before* its ``/proc`` files were read.  While the pidfd does not
poll readable that very process is alive (its pid was not reused), and
while a one-byte ``pread`` of the environ descriptor still returns a byte
its memory image is the one whose environment was read: the kernel pins the
address space an environ descriptor was opened on, and reads give nothing
once that address space is gone (``execve`` replaced it, or the process
exited).  Two system calls, no ``/proc`` file opened or parsed.  No fast
path for:

* a pid that pidfd_open refuses (a thread other than the main one: FUSE
  reports thread ids): the identity path decides;
* a process whose environment lies at its parent's addresses: a
  ``vfork`` child (``posix_spawn``, Python's ``subprocess``) shares its
  parent's address space until its exec, so that exec would not end the
  space the descriptor pins.  (A ``fork`` child before its exec looks
  the same and takes the identity path too, until it exec()s.)
* a process with an empty environment (its reads return nothing anyway).

Known limit: with address-space randomisation off, an exec whose new
environment lands at exactly the old addresses (same stack top, same total
size of arguments and environment) keeps the cached agent on the identity
path.

Threading: called under the view's lock (or from the single FUSE thread).
"""

from __future__ import annotations

import os
import select

DEFAULT = "default"
ENV_NAME = b"STEPFS_AGENT="
_CACHE_LIMIT = 4096


def _proc_stat(pid: int) -> tuple[bytes, int, bytes] | None:
    """``(identity, ppid, image)`` from ``/proc/<pid>/stat``, or None when
    it cannot be read.  ``image``: fields 50-51 (``env_start``, ``env_end``;
    empty on kernels before 3.5 or without ptrace access); ``identity``: the
    start time (field 22, clock ticks since boot) and ``image``."""
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
    # fields[i] is field i + 3 of proc(5).
    fields = data[data.rfind(b")") + 2:].split(b" ", 50)
    if len(fields) <= 20:
        return None
    image = fields[47] + b"-" + fields[48] if len(fields) > 49 and fields[48] != b"0" else b""
    return fields[19] + b"@" + image, int(fields[1]), image


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


def _environ_fd(pid: int) -> int:
    """A descriptor of ``/proc/<pid>/environ`` (pins its address space), or -1."""
    try:
        return os.open(f"/proc/{pid}/environ", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return -1


def _same_image(fd: int) -> bool:
    """The address space ``fd`` (an environ descriptor) was opened on is
    still in use, and its environment is not empty."""
    try:
        return os.pread(fd, 1, 0) != b""
    except OSError:
        return False


def _private_image(st: tuple[bytes, int, bytes]) -> bool:
    """The process does not share its parent's address space (see the
    module doc: not a ``vfork`` child before its exec).  Unknown addresses
    count as shared; a parent that is gone shares nothing any more."""
    _identity, ppid, image = st
    if not image:
        return False
    parent = _proc_stat(ppid) if ppid > 0 else None
    return parent is None or parent[2] != image


class Agents:
    """pid -> agent name, cached per process image."""

    def __init__(self, default: str = DEFAULT):
        self.default = default
        # pid -> (identity, agent, private image)
        self._cache: dict[int, tuple[bytes | None, str, bool]] = {}
        # The last caller: pid, agent, a poller of its pidfd and its environ
        # descriptor (None and -1: no fast path for it).
        self._last_pid = 0
        self._last_agent = default
        self._last_fd = -1
        self._last_env = -1
        self._last_poll: select.poll | None = None

    def of(self, pid: int) -> str:
        if pid <= 0:
            return self.default
        if pid == self._last_pid:
            if self._last_poll is None:
                agent, _private, new_image = self._lookup(pid)
                if not new_image:
                    return agent  # no fast path for this caller (module doc)
                # exec()ed: the new image may have a fast path
            elif not self._last_poll.poll(0) and _same_image(self._last_env):
                return self._last_agent  # the same live process, not exec()ed since (module doc)
        # Both before the lookup: see _remember.
        fd = _pidfd(pid)
        env = _environ_fd(pid) if fd >= 0 else -1
        agent, private, _new = self._lookup(pid)
        self._remember(pid, agent, fd, env, private)
        return agent

    def _lookup(self, pid: int) -> tuple[str, bool, bool]:
        """``(agent, private image, read anew)`` of ``pid``."""
        st = _proc_stat(pid)
        identity = st[0] if st is not None else None
        hit = self._cache.get(pid)
        if hit is not None and hit[0] == identity:
            return hit[1], hit[2], False
        agent = _agent_from_environ(pid) or self.default
        private = st is not None and _private_image(st)
        if len(self._cache) >= _CACHE_LIMIT:
            self._cache.clear()
        self._cache[pid] = (identity, agent, private)
        return agent, private, True

    def _remember(self, pid: int, agent: str, fd: int, env: int, private: bool) -> None:
        """Make ``pid`` the last caller.  ``fd`` (pidfd) and ``env`` (environ
        descriptor) were opened before ``agent`` was looked up; they are
        kept, as the fast path, only if that process is still alive now
        (the /proc files read belonged to it: no reused pid) and still has
        that image (an exec in between would have given ``agent`` of the new
        image to the old one's descriptor: the next call looks up again)."""
        self.close()
        poller = None
        if fd >= 0 and env >= 0 and private:
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            if poller.poll(0) or not _same_image(env):  # exited meanwhile: what we read may be another's
                poller = None
        if poller is None:
            for d in (fd, env):
                if d >= 0:
                    os.close(d)
            fd = env = -1
        self._last_pid, self._last_agent, self._last_poll = pid, agent, poller
        self._last_fd, self._last_env = fd, env

    def close(self) -> None:
        """Drop the last caller's descriptors."""
        for d in (self._last_fd, self._last_env):
            if d >= 0:
                os.close(d)
        self._last_pid, self._last_fd, self._last_env, self._last_poll = 0, -1, -1, None
