"""A ctypes binding of Linux Landlock, and the trampoline that applies it.

Landlock lets an unprivileged process restrict itself, irrevocably for it
and every process it starts, to the filesystem hierarchies (and TCP ports)
a ruleset allows.  Three system calls do it: ``landlock_create_ruleset``
(which, with :data:`CREATE_RULESET_VERSION`, also answers the kernel's ABI
version), ``landlock_add_rule`` and ``landlock_restrict_self``; the last
needs ``PR_SET_NO_NEW_PRIVS`` first.

A :class:`Ruleset` is built in the caller's process (opening each rule's
path there, so a bad path is reported before anything starts) and only its
descriptor crosses to the child.  Running this file as a script is the
trampoline: ``python landlock.py --ruleset-fd N -- COMMAND...`` restricts
itself with that ruleset and ``execvp``s the command, so the restriction
covers exactly the command and its children, never stepfs itself.  It
imports nothing outside the standard library, so it runs by path from any
install layout.

Rights are those of the running kernel's ABI: asking for a right the
kernel does not know is an error there, and a right not handled is simply
not restricted, so :func:`fs_rights` and :func:`net_rights` give the set
the ABI has (REFER from ABI 2, TRUNCATE from 3, TCP from 4, IOCTL_DEV
from 5).

Caveats (kernel limits, not this binding's): file metadata (``chmod``,
``chown``, ``utimes``, xattrs) is not restricted by any ABI up to 7; a
descriptor opened before the restriction keeps its access; UDP and unix
sockets are not covered by the TCP rules.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import stat
import sys

#: ``landlock_create_ruleset``, ``landlock_add_rule``, ``landlock_restrict_self``:
#: the same numbers on every architecture (they come after the unified table).
SYS_CREATE_RULESET, SYS_ADD_RULE, SYS_RESTRICT_SELF = 444, 445, 446
CREATE_RULESET_VERSION = 1 << 0
RULE_PATH_BENEATH = 1
RULE_NET_PORT = 2
PR_SET_NO_NEW_PRIVS = 38

# Filesystem access rights, with the ABI that introduced them.
FS_EXECUTE = 1 << 0
FS_WRITE_FILE = 1 << 1
FS_READ_FILE = 1 << 2
FS_READ_DIR = 1 << 3
FS_REMOVE_DIR = 1 << 4
FS_REMOVE_FILE = 1 << 5
FS_MAKE_CHAR = 1 << 6
FS_MAKE_DIR = 1 << 7
FS_MAKE_REG = 1 << 8
FS_MAKE_SOCK = 1 << 9
FS_MAKE_FIFO = 1 << 10
FS_MAKE_BLOCK = 1 << 11
FS_MAKE_SYM = 1 << 12
FS_REFER = 1 << 13  # ABI 2: link or rename into another directory
FS_TRUNCATE = 1 << 14  # ABI 3
FS_IOCTL_DEV = 1 << 15  # ABI 5: ioctl on character and block devices

NET_BIND_TCP = 1 << 0  # ABI 4
NET_CONNECT_TCP = 1 << 1  # ABI 4

FS_READ = FS_EXECUTE | FS_READ_FILE | FS_READ_DIR
#: The rights that make sense on a file (not a directory) rule; the kernel
#: refuses a file rule with any other (EINVAL).
FS_FILE_RIGHTS = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE | FS_IOCTL_DEV

_ABI_FS = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 4: (1 << 15) - 1}


def fs_rights(abi: int) -> int:
    """Every filesystem right ABI ``abi`` knows."""
    if abi < 1:
        return 0
    return _ABI_FS.get(abi, (1 << 16) - 1)


def net_rights(abi: int) -> int:
    """Every TCP right ABI ``abi`` knows (none before ABI 4)."""
    return NET_BIND_TCP | NET_CONNECT_TCP if abi >= 4 else 0


class LandlockError(OSError):
    """A Landlock system call failed; ``errno`` says why."""


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1  # the kernel's struct is __attribute__((packed)): 12 bytes
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


class _NetPortAttr(ctypes.Structure):
    _fields_ = [("allowed_access", ctypes.c_uint64), ("port", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.prctl.restype = ctypes.c_int


def _call(number: int, *args) -> int:
    result = _libc.syscall(ctypes.c_long(number), *args)
    if result < 0:
        err = ctypes.get_errno()
        raise LandlockError(err, os.strerror(err))
    return result


def abi_version() -> int:
    """The kernel's Landlock ABI version.  Raises :class:`LandlockError`
    where Landlock is not there: ENOSYS (not built, or filtered by a
    seccomp policy), EOPNOTSUPP (built but not enabled at boot)."""
    if platform.system() != "Linux":
        raise LandlockError(errno.ENOSYS, "Landlock is a Linux feature")
    return _call(SYS_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(CREATE_RULESET_VERSION))


def unavailable_reason(err: int) -> str:
    """Why Landlock is unavailable, for an error ``err`` of :func:`abi_version`."""
    return {errno.ENOSYS: "the kernel has no Landlock system calls (not built in, or filtered by seccomp)",
            errno.EOPNOTSUPP: "Landlock is built into the kernel but not enabled (add 'landlock' to the lsm= "
                              "boot parameter)"}.get(err, os.strerror(err))


class Ruleset:
    """An open Landlock ruleset: what is handled (denied unless a rule
    allows it) and the rules.  Closing it after the child has its copy of
    the descriptor is the caller's job (a context manager)."""

    def __init__(self, abi: int, handled_fs: int, handled_net: int = 0):
        attr = _RulesetAttr(handled_fs, handled_net, 0)
        # Older kernels reject a struct larger than they know (E2BIG), so
        # pass only the fields this ABI has: scoped from 6, net from 4.
        size = 24 if abi >= 6 else 16 if abi >= 4 else 8
        self.abi = abi
        self.handled_fs = handled_fs
        self.handled_net = handled_net
        self.fd = _call(SYS_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))

    def allow_path(self, path: str, access: int) -> None:
        """Allow ``access`` (masked to what is handled, and to file rights
        if ``path`` is not a directory) beneath ``path``."""
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        try:
            if not stat.S_ISDIR(os.fstat(fd).st_mode):
                access &= FS_FILE_RIGHTS
            access &= self.handled_fs
            if access:
                attr = _PathBeneathAttr(access, fd)
                _call(SYS_ADD_RULE, ctypes.c_int(self.fd), ctypes.c_int(RULE_PATH_BENEATH), ctypes.byref(attr),
                      ctypes.c_uint32(0))
        finally:
            os.close(fd)

    def allow_port(self, port: int, access: int) -> None:
        access &= self.handled_net
        if access:
            attr = _NetPortAttr(access, port)
            _call(SYS_ADD_RULE, ctypes.c_int(self.fd), ctypes.c_int(RULE_NET_PORT), ctypes.byref(attr),
                  ctypes.c_uint32(0))

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "Ruleset":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def restrict_self(ruleset_fd: int) -> None:
    """Set no-new-privileges and enforce the ruleset on this process (and,
    through fork and exec, on everything it starts).  Irrevocable."""
    if _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise LandlockError(err, os.strerror(err))
    _call(SYS_RESTRICT_SELF, ctypes.c_int(ruleset_fd), ctypes.c_uint32(0))


def trampoline_argv(ruleset_fd: int, command: list[str]) -> list[str]:
    """The argv that runs ``command`` restricted by the ruleset at
    ``ruleset_fd`` (which the child must inherit: ``pass_fds``).

    ``-I -B``: the trampoline itself ignores PYTHON* variables, the user
    site, its own directory on ``sys.path`` (no neighbour module can shadow
    the standard library here) and bytecode writing; the command still
    gets the whole environment.
    """
    return [sys.executable, "-I", "-B", os.path.abspath(__file__), "--ruleset-fd", str(ruleset_fd),
            "--", *command]


#: The trampoline's exit status when it could not restrict itself (the
#: command was not started); 127/126 as a shell when exec failed.
TRAMPOLINE_FAILED = 125


def _main(argv: list[str]) -> int:
    if len(argv) < 4 or argv[0] != "--ruleset-fd" or argv[2] != "--":
        print("usage: landlock.py --ruleset-fd N -- COMMAND...", file=sys.stderr)
        return 2
    fd, command = int(argv[1]), argv[3:]
    try:
        restrict_self(fd)
    except OSError as exc:
        print(f"stepfs: could not confine {command[0]}: {exc.strerror}; it was not started.", file=sys.stderr)
        return TRAMPOLINE_FAILED
    os.close(fd)
    try:
        os.execvp(command[0], command)
    except FileNotFoundError:
        print(f"stepfs: {command[0]}: command not found", file=sys.stderr)
        return 127
    except OSError as exc:
        print(f"stepfs: cannot run {command[0]}: {exc.strerror}", file=sys.stderr)
        return 126


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
