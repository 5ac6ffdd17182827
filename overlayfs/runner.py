"""``stepfs run`` as a library call: one command, one mount, one step (no FUSE import).

:func:`run_command` picks a mount of the workspace (the one the caller named
or stands in, else any live one, else a new private one), runs the command
with its working directory mapped into the mount (``WS/sub`` becomes
``MOUNT/sub``), commits the mount's open step when the command exits
(message: the command line; meta ``exit_code``), and unmounts what it
mounted, whatever happened.  A command that changed nothing makes no layer.

With ``confine`` (a :class:`client.confine.Policy` without its mountpoint,
which is filled in) the command runs under Landlock (``client/confine.py``):
the kernel is checked before anything is mounted, and the command starts
through the trampoline, so only it and its children are restricted.  Every
command started is registered with the mount's daemon, confined or not, so
``MOUNT/.stepfs/status`` can say which.

Caveat: a reused mount commits its whole open step, including what other
writers staged there before the command started; ``private=True`` always
mounts afresh.

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
import shlex
import signal
import subprocess
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

from store.errors import StepfsError

from . import api, mounts
from .client import confine as confine_mod

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


def run_command(command: list[str], workspace: "api.Workspace | str | os.PathLike | None" = None, *,
                message: str | None = None, meta: dict | None = None,
                mountpoint: str | os.PathLike | None = None, private: bool = False,
                cwd: str | os.PathLike | None = None, env: dict | None = None,
                stdin=None, stdout=None, stderr=None,
                forward_signals: bool = False,
                on_phase: Callable[[str], None] | None = None,
                confine: "confine_mod.Policy | None" = None) -> RunResult:
    """Run ``command`` in a mount of ``workspace`` and commit what it changed.

    ``workspace``: a :class:`api.Workspace`, or a path (workspace, mount, or
    a path inside either; a plain directory becomes a workspace); None means
    the one ``cwd`` is in.  ``cwd`` (default: the current directory) is
    mapped into the mount; outside the workspace the command runs at the
    mount's root.  ``env`` is added to the environment, with
    ``STEPFS_WORKSPACE`` and ``STEPFS_MOUNT`` set.  ``on_phase`` is called
    with "mounting", "running", "committing", "unmounting".

    Raises :class:`StepfsError` if the mount or the commit fails; a failed
    commit carries the command's status as ``exc.command_exit_code`` (its
    changes stay staged in the store, see :meth:`api.Workspace.step`).
    """
    if not command:
        raise ValueError("run_command needs a command")
    command = [os.fspath(c) for c in command]
    phase = on_phase or (lambda _name: None)
    start_dir = os.path.abspath(os.fspath(cwd) if cwd is not None else os.getcwd())
    if confine is not None:
        confine_mod.require(confine)  # first: where the kernel cannot, touch nothing
    ws, standing_in = _resolve(workspace, start_dir)
    if confine is not None:
        confine.workspace = ws.path
        confine_mod.check(confine)  # before mounting
    with _Signals(forward_signals) as sig:
        phase("mounting")
        if mountpoint is not None:
            m = ws.mount(mountpoint, reuse=True)
        elif private:
            m = ws.mount()
        else:
            m = standing_in or ws._live_mount(None) or ws.mount()
        try:
            run_cwd = _map_cwd(ws, m, start_dir)
            result = RunResult(command, 0, None, m.path, reused=not m.owned, cwd=run_cwd, workspace=ws.path)
            child_env = {**os.environ, **(env or {}), "STEPFS_WORKSPACE": ws.path, "STEPFS_MOUNT": m.path,
                         "PWD": run_cwd}
            if sig.received:
                result.started = False
                result.exit_code = 128 + sig.received[0]
            else:
                result.exit_code, result.started, result.confined = _run_in(
                    m.path, command, confine, sig, phase, cwd=run_cwd, env=child_env, stdin=stdin,
                    stdout=stdout, stderr=stderr)
            result.signals, result.forwarded = list(sig.received), list(sig.forwarded)
            if result.started:
                phase("committing")
                step_meta = {"exit_code": str(result.exit_code), **(meta or {})}
                try:
                    result.number = m.step(message if message is not None else shlex.join(command),
                                           meta=step_meta)
                except StepfsError as exc:
                    exc.command_exit_code = result.exit_code
                    raise
        finally:
            if m.owned:
                phase("unmounting")
                m.unmount()
    return result


def _run_in(mountpoint: str, command: list[str], policy, sig: "_Signals", phase, *, env: dict,
            **popen) -> tuple[int, bool, dict | None]:
    """Start ``command`` in the mount (confined by ``policy`` if given),
    register it with the daemon, wait; (status, started, confinement)."""
    confinement = None
    if policy is not None:
        policy.mountpoint = mountpoint
        confinement = confine_mod.prepare(policy)
    try:
        argv = confinement.argv(command) if confinement else command
        if confinement:
            env = {**env, **confinement.env()}
            popen["pass_fds"] = confinement.pass_fds
            if _missing(command[0], env.get("PATH", os.defpath), popen.get("cwd")):
                # The trampoline always starts; say "not started" as an unconfined run would.
                log.error("%s: command not found", command[0])
                return 127, False, confinement.describe()
        phase("running")
        code, started = sig.run(argv, env=env, on_start=lambda pid: confine_mod.register_run(
            mountpoint, pid, command, confinement), **popen)
        return code, started, confinement.describe() if confinement else None
    finally:
        if confinement:
            confinement.close()


def run_confined(mountpoint: str | os.PathLike, command: list[str], policy: "confine_mod.Policy", *,
                 cwd: str | os.PathLike | None = None, env: dict | None = None, stdin=None, stdout=None,
                 stderr=None, forward_signals: bool = False) -> RunResult:
    """``stepfs confine``: run ``command`` confined to an existing mount
    (which a harness manages: nothing is mounted, committed or unmounted).
    ``cwd`` defaults to the current directory if it is inside the mount,
    else the mount's root."""
    from store.errors import NotMountedError

    mp = os.path.abspath(os.fspath(mountpoint))
    entry = mounts.find(mp)
    if entry is None or entry.workspace is None:
        raise NotMountedError(f"{mp} is not a stepfs mount; mount the workspace there first ('stepfs mount WS {mp}').")
    policy.mountpoint, policy.workspace = mp, entry.workspace
    confine_mod.check(policy)
    confine_mod.require(policy)
    here = os.path.abspath(os.fspath(cwd) if cwd is not None else os.getcwd())
    run_cwd = here if here == mp or here.startswith(mp.rstrip("/") + "/") else mp
    command = [os.fspath(c) for c in command]
    result = RunResult(command, 0, None, mp, reused=True, cwd=run_cwd, workspace=entry.workspace)
    child_env = {**os.environ, **(env or {}), "STEPFS_WORKSPACE": entry.workspace, "STEPFS_MOUNT": mp,
                 "PWD": run_cwd}
    with _Signals(forward_signals) as sig:
        result.exit_code, result.started, result.confined = _run_in(
            mp, command, policy, sig, lambda _name: None, cwd=run_cwd, env=child_env, stdin=stdin,
            stdout=stdout, stderr=stderr)
        result.signals, result.forwarded = list(sig.received), list(sig.forwarded)
    return result


def _resolve(workspace, start_dir: str) -> tuple[api.Workspace, "api.Mount | None"]:
    """The workspace, and the live mount of it that the caller named or
    stands in (to be reused), if any."""
    named = None
    if isinstance(workspace, api.Workspace):
        ws = workspace
    else:
        named = os.path.abspath(os.path.expanduser(os.fspath(workspace))) if workspace is not None else None
        ws = api.open_workspace(named if named is not None else start_dir, create=named is not None)
    for probe in (named, start_dir):
        entry = mounts.containing(probe) if probe is not None else None
        if entry is not None and entry.workspace == ws.path:
            return ws, api.Mount(ws, entry.mountpoint, pid=None, owned=False)
    return ws, None


def _map_cwd(ws: api.Workspace, m: api.Mount, start_dir: str) -> str:
    rel = api.relative_to_workspace(ws, start_dir)
    if rel is None:
        return m.path
    mapped = os.path.join(m.path, rel) if rel else m.path
    if not os.path.isdir(mapped):
        log.warning("%s does not exist in the mount; running at its root", mapped)
        return m.path
    return mapped


class _Signals:
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

    def __enter__(self) -> "_Signals":
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
