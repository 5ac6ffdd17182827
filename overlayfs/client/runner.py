"""The command of ``stepfs run`` as a child process (no FUSE import): its
result, and the signals stepfs receives while it runs.  The mounting and
committing around it are ``api.run_command``'s.

:func:`run_in` starts it, confined by a :class:`confine.Policy` if one is
given (through the Landlock trampoline, so only the command and its
children are restricted), and registers it with the mount's daemon either
way, so ``MOUNT/.stepfs/status`` can say whether it is confined.

Signals (``forward_signals=True``, main thread only; the CLI uses it):

* while mounting, SIGINT, SIGTERM and SIGHUP are only recorded, and the
  command is then not started at all (exit code 128+N);
* while the command runs they are blocked and taken with ``sigtimedwait``,
  which tells where each came from: one sent by the kernel on behalf of the
  terminal (``si_code == SI_KERNEL``: Ctrl-C, hangup) already reached the
  whole foreground process group, command included, so it is not sent a
  second time (two Ctrl-C in a row mean "quit" to many agents); any other
  (``kill``, ``docker stop``) is forwarded to the command;
* after the command has ended they are recorded and dropped: the commit and
  the unmount always finish.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

from stepfs.overlayfs.client import binds as binds_mod
from stepfs.overlayfs.client import confine as confine_mod


log = logging.getLogger("stepfs.run")

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
#: ``siginfo.si_code`` of a signal the kernel generated itself (a terminal's
#: Ctrl-C or hangup); ``kill(2)`` gives SI_USER.  Not exported by ``signal``.
SI_KERNEL = 0x80


@dataclass
class RunResult:
    command: list[str]
    #: The command's exit status; 128+N if signal N ended it (or stopped
    #: it from starting), 127/126 if it could not be started, as in a shell.
    exit_code: int
    #: The layer the command's changes became; None if it changed nothing.
    number: int | None
    mountpoint: str
    #: The command ran in an existing mount (left mounted afterwards).
    reused: bool
    #: The directory the command ran in (inside the mount).
    cwd: str
    #: The workspace's absolute path.
    workspace: str = ""
    started: bool = True
    #: Signals stepfs received while it ran, and those it passed on to the
    #: command (one from the terminal reaches the command directly).
    signals: list[int] = field(default_factory=list)
    forwarded: list[int] = field(default_factory=list)
    #: How the command was confined (``Plan.describe``), None if it was not.
    confined: dict | None = None


def run_in(mountpoint: str, command: list[str], policy: "confine_mod.Policy | None", sig: "Signals",
           phase: Callable[[str], None], *, env: dict, fast_unversioned: bool = True, **popen) -> tuple[int, bool, dict | None]:
    """Start ``command`` in the mount (confined by ``policy`` if given),
    register it with the daemon, wait; (status, started, confinement).
    ``fast_unversioned``: bind the top-level unversioned trees where the
    system allows (``binds.py``); else they go through the daemon."""
    confinement = None
    if policy is not None:
        policy.mountpoint = mountpoint
        confinement = confine_mod.prepare(policy)
    try:
        argv = confinement.argv(command) if confinement else command
        if confinement:
            env = {**env, **confinement.env()}
            popen["pass_fds"] = confinement.pass_fds
        bound = binds_mod.plan(mountpoint) if fast_unversioned else None
        if bound is not None:
            # Unversioned trees served by the kernel in the run's own mount namespace (binds.py).
            argv = binds_mod.trampoline_argv(bound[0], mountpoint, bound[1], argv)
        if confinement or bound is not None:
            if _missing(command[0], env.get("PATH", os.defpath), popen.get("cwd")):
                # The trampoline always starts; say "not started" as an unconfined run would.
                log.error("%s: command not found", command[0])
                return 127, False, confinement.describe() if confinement else None
        phase("running")
        try:
            code, started = sig.run(argv, env=env, on_start=lambda pid: confine_mod.register_run(
                mountpoint, pid, command, confinement), **popen)
        finally:
            if bound is not None:
                binds_mod.forget(mountpoint, bound[1])
        return code, started, confinement.describe() if confinement else None
    finally:
        if confinement:
            confinement.close()


class Signals:
    """The signal policy of :func:`run_command` (see the module docstring).
    Inactive outside the main thread or when forwarding is off: then the
    process's own handlers stay in charge."""

    def __init__(self, enabled: bool):
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        # A signal the caller ignores stays ignored, for us and (through exec)
        # for the command: 'nohup stepfs run ...' must survive a hangup.
        self.signals = [s for s in FORWARDED if self.enabled and signal.getsignal(s) != signal.SIG_IGN]
        self.received: list[int] = []
        self.forwarded: list[int] = []
        self._old_handlers: dict[int, object] = {}

    def __enter__(self) -> "Signals":
        if self.enabled:
            for signum in self.signals:
                self._old_handlers[signum] = signal.signal(signum, self._record)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._old_handlers.items():
            signal.signal(signum, handler)

    def _record(self, signum, _frame) -> None:
        self.received.append(signum)

    def run(self, command: list[str], on_start: Callable[[int], None] = lambda _pid: None,
            **popen) -> tuple[int, bool]:
        """Start the command, wait for it (forwarding signals); returns
        (exit status, started).  ``on_start`` gets the child's pid."""
        if not self.enabled:
            proc = _start(command, **popen)
            if proc is None:
                return _not_started(command), False
            on_start(proc.pid)
            try:
                return _status(proc.wait()), True
            except BaseException:
                # The caller is unwinding (KeyboardInterrupt in a harness):
                # the command must not outlive its mount.
                _stop(proc)
                raise
        with self._blocked() as old_mask:
            # The child must not inherit the blocked mask (exec keeps it).
            proc = _start(command, preexec_fn=lambda: signal.pthread_sigmask(signal.SIG_SETMASK, old_mask),
                          **popen)
            if proc is None:
                return _not_started(command), False
            on_start(proc.pid)
            wanted = {*self.signals, signal.SIGCHLD}
            while proc.poll() is None:
                info = signal.sigtimedwait(wanted, 1.0)  # SIGCHLD wakes us when the command ends
                if info is None or info.si_signo == signal.SIGCHLD:
                    continue
                self.received.append(info.si_signo)
                if info.si_code == SI_KERNEL and _in_our_group(proc.pid):
                    continue  # the terminal already delivered it to the command
                try:
                    proc.send_signal(info.si_signo)
                    self.forwarded.append(info.si_signo)
                except ProcessLookupError:
                    pass
            return _status(proc.returncode), True

    @contextmanager
    def _blocked(self) -> Iterator[set]:
        wanted = {*self.signals, signal.SIGCHLD}
        old = signal.pthread_sigmask(signal.SIG_BLOCK, wanted)
        try:
            yield old
        finally:
            # Take what is still pending before unblocking, so it is recorded
            # rather than delivered in the middle of the commit.
            while (info := signal.sigtimedwait(wanted, 0)) is not None:
                if info.si_signo != signal.SIGCHLD:
                    self.received.append(info.si_signo)
            signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _start(command: list[str], **popen) -> subprocess.Popen | None:
    try:
        return subprocess.Popen(command, **popen)
    except FileNotFoundError:
        log.error("%s: command not found", command[0])
    except OSError as exc:
        log.error("cannot run %s: %s", command[0], exc.strerror)
    return None


STOP_GRACE = 10.0


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after STOP_GRACE seconds."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(STOP_GRACE)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _missing(name: str, path: str, cwd: str | None) -> bool:
    import shutil

    if "/" in name:
        return not os.path.exists(os.path.join(cwd or os.getcwd(), name))
    return shutil.which(name, path=path) is None


def _not_started(command: list[str]) -> int:
    import shutil

    return 127 if shutil.which(command[0]) is None and not os.path.exists(command[0]) else 126


def _status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def _in_our_group(pid: int) -> bool:
    try:
        return os.getpgid(pid) == os.getpgrp()
    except ProcessLookupError:
        return True
