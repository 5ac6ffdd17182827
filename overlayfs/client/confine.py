"""Confinement policy: where a command run through a mount may write.

A confined command may write only beneath its mount, in a private
temporary directory (``TMPDIR`` points there; removed afterwards), to the
terminal and null devices (``/dev/null``, ``/dev/tty``, ``/dev/pts``,
``/dev/ptmx``) and beneath each ``--allow-write`` path.  It may read and
execute everywhere, or with ``--allow-read`` only beneath the mount, the
writable paths, the system directories (:data:`SYSTEM_READ`), the Python
that runs stepfs, and the paths named.  ``--no-network`` denies every TCP
bind and connect but the ``--allow-connect`` ports (Landlock ABI 4).

:func:`plan` turns a :class:`Policy` into Landlock rules without touching
the kernel (unit-tested on every ABI); :func:`prepare` checks the kernel,
builds the ruleset and the temporary directory; the command then runs
through the trampoline in ``landlock.py``, which restricts itself and
execs it, so stepfs's own process stays unrestricted (it must still
commit and unmount).  Where Landlock is missing or too old, it raises
:class:`ConfinementUnavailable` before anything starts: never a silent
unconfined run.

What a ``--allow-write`` may not be: the workspace, anything inside it
(its store above all) or anything containing it: writes to the workspace
go through the mount, where they are staged.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field

from stepfs.store.errors import ConfinementUnavailable, ContainmentError, InputError

from stepfs.overlayfs.client import landlock as ll

log = logging.getLogger("stepfs.run")

#: Devices a program needs to run at all, opened for writing (a shell's
#: ``2>/dev/null``, a terminal's prompts, a pseudo-terminal for ``script``).
DEVICES = ("/dev/null", "/dev/tty", "/dev/pts", "/dev/ptmx")
#: Read (and execute) with ``--allow-read``: what programs need to start.
SYSTEM_READ = ("/bin", "/sbin", "/usr", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/opt", "/proc",
               "/sys", "/dev", "/run")
MIN_ABI_NETWORK = 4


@dataclass
class Policy:
    """What the user asked for (paths as given; :func:`plan` resolves them)."""

    mountpoint: str
    workspace: str | None = None
    allow_write: list[str] = field(default_factory=list)
    #: None: read everywhere.
    allow_read: list[str] | None = None
    no_network: bool = False
    allow_connect: list[int] = field(default_factory=list)

    @property
    def restricts_network(self) -> bool:
        return self.no_network or bool(self.allow_connect)


@dataclass
class Plan:
    """Landlock rules for one ABI: what is handled, and what is allowed where."""

    abi: int
    handled_fs: int
    handled_net: int
    paths: list[tuple[str, int]]
    ports: list[tuple[int, int]]
    tmpdir: str
    writable: list[str]

    def describe(self) -> dict:
        """The run's confinement as ``status`` reports it."""
        reads = "everywhere" if any(p == "/" for p, a in self.paths if a & ll.FS_READ_FILE) else sorted(
            {p for p, a in self.paths if a & ll.FS_READ_FILE})
        network = "any" if not self.handled_net else sorted(p for p, _ in self.ports) or "none"
        return {"confined": True, "mechanism": "landlock", "abi": self.abi, "writable": self.writable,
                "readable": reads, "tcp_connect": network}


def require(policy: Policy) -> int:
    """The kernel's Landlock ABI, if it can apply ``policy``; else
    :class:`ConfinementUnavailable` with what to do."""
    try:
        abi, reason = ll.abi_version(), ""
    except ll.LandlockError as exc:
        abi, reason = 0, ll.unavailable_reason(exc.errno)
    check_abi(policy, abi, reason)
    return abi


def check_abi(policy: Policy, abi: int, reason: str = "") -> None:
    """Refuse ``policy`` on Landlock ABI ``abi`` (0: none, for ``reason``)
    if that ABI cannot enforce it."""
    if abi < 1:
        raise ConfinementUnavailable(
            f"--confine needs Linux Landlock and this system has none ({reason or 'no Landlock ABI'}); run on "
            f"Linux 5.13 or later with Landlock enabled, or run without --confine knowing that writes outside "
            f"the mount are not prevented.")
    if policy.restricts_network and abi < MIN_ABI_NETWORK:
        raise ConfinementUnavailable(
            f"--no-network and --allow-connect need Landlock ABI {MIN_ABI_NETWORK} (Linux 6.7) and this kernel "
            f"has ABI {abi}; drop those options or run on a newer kernel.")


def _existing(path: str, option: str) -> str:
    real = os.path.realpath(os.path.expanduser(path))
    if not os.path.exists(real):
        raise InputError(f"{option} {path}: no such file or directory; create it first or name an existing path.")
    return real


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def check(policy: Policy) -> None:
    """Refuse bad paths before anything is mounted or started."""
    ws = os.path.realpath(policy.workspace) if policy.workspace else None
    for path in policy.allow_write:
        real = _existing(path, "--allow-write")
        if ws is not None and (_within(real, ws) or _within(ws, real)):
            raise ContainmentError(
                f"--allow-write {path} would let the command write the workspace {ws} (or its store) directly; "
                f"its writes to the workspace go through the mount, so name a path outside the workspace.")
    for path in policy.allow_read or []:
        _existing(path, "--allow-read")
    for port in policy.allow_connect:
        if not 0 < port < 65536:
            raise InputError(f"--allow-connect {port} is not a TCP port; name a number from 1 to 65535.")


def _code_roots() -> list[str]:
    """Where the Python running stepfs and stepfs's own code live (for
    ``stepfs hook-commit`` from inside a run with ``--allow-read``): three
    levels above this file is the checkout, or ``site-packages/stepfs``
    when installed; either holds every stepfs package."""
    code = os.path.abspath(__file__)
    for _ in range(3):
        code = os.path.dirname(code)
    return [sys.prefix, sys.base_prefix, code]


def plan(policy: Policy, abi: int, tmpdir: str) -> Plan:
    """The rules of ``policy`` on ABI ``abi`` (kernel-free)."""
    check(policy)
    check_abi(policy, abi)
    fs_all = ll.fs_rights(abi)
    handled_net = ll.net_rights(abi) if policy.restricts_network else 0
    mount = os.path.realpath(policy.mountpoint)
    writable = [mount, tmpdir] + [os.path.realpath(os.path.expanduser(p)) for p in policy.allow_write]
    paths: list[tuple[str, int]] = []
    if policy.allow_read is None:
        paths.append(("/", ll.FS_READ))
    else:
        readable = list(SYSTEM_READ) + _code_roots() + [os.path.realpath(os.path.expanduser(p))
                                                           for p in policy.allow_read]
        seen: set[str] = set()
        for p in readable:
            if p not in seen and os.path.exists(p):
                seen.add(p)
                paths.append((p, ll.FS_READ))
    paths += [(p, fs_all) for p in writable]
    dev_rights = ll.FS_READ_FILE | ll.FS_WRITE_FILE | ll.FS_READ_DIR | ll.FS_TRUNCATE | ll.FS_IOCTL_DEV
    paths += [(d, dev_rights & fs_all) for d in DEVICES if os.path.exists(d)]
    ports = [(port, ll.NET_CONNECT_TCP) for port in sorted(set(policy.allow_connect))] if handled_net else []
    return Plan(abi, fs_all, handled_net, paths, ports, tmpdir, writable + [d for d in DEVICES if os.path.exists(d)])


class Confinement:
    """A prepared confinement: the ruleset (its descriptor goes to the
    child), the private temporary directory, and how to start a command
    under them.  Close it once the command has ended."""

    def __init__(self, policy: Policy, abi: int):
        self.tmpdir = tempfile.mkdtemp(prefix="stepfs-confine-")
        try:
            self.plan = plan(policy, abi, self.tmpdir)
            self.ruleset = ll.Ruleset(abi, self.plan.handled_fs, self.plan.handled_net)
            try:
                for path, access in self.plan.paths:
                    self.ruleset.allow_path(path, access)
                for port, access in self.plan.ports:
                    self.ruleset.allow_port(port, access)
            except BaseException:
                self.ruleset.close()
                raise
        except BaseException:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
            raise

    def argv(self, command: list[str]) -> list[str]:
        return ll.trampoline_argv(self.ruleset.fd, command)

    @property
    def pass_fds(self) -> tuple[int, ...]:
        return (self.ruleset.fd,)

    def env(self) -> dict[str, str]:
        return {"TMPDIR": self.tmpdir, "STEPFS_CONFINED": f"landlock-abi{self.plan.abi}"}

    def describe(self) -> dict:
        return self.plan.describe()

    def close(self) -> None:
        self.ruleset.close()
        shutil.rmtree(self.tmpdir, ignore_errors=True)

    def __enter__(self) -> "Confinement":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def prepare(policy: Policy) -> Confinement:
    """Check the kernel and build the confinement of ``policy`` (raises
    :class:`ConfinementUnavailable`, :class:`InputError`, :class:`ContainmentError`)."""
    return Confinement(policy, require(policy))


def register_run(mountpoint: str, pid: int, command: list[str], confinement: Confinement | None) -> None:
    """Tell the mount's daemon that process ``pid`` runs ``command`` there,
    and whether it is confined (``MOUNT/.stepfs/status``, ``stepfs status``).
    A daemon that does not answer only loses this line of its status."""
    from stepfs.overlayfs.client import control
    from stepfs.store.errors import StepfsError

    detail = confinement.describe() if confinement is not None else {"confined": False}
    try:
        control.request(mountpoint, {"op": "run", "pid": pid, "command": command, "confinement": detail},
                        timeout=5.0)
    except StepfsError as exc:
        log.warning("the mount %s could not record the run: %s", mountpoint, exc)
