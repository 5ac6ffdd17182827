"""The conformance suite's machinery: case registry, the per-case context
``T`` (paths, expectations, running a step as an unprivileged user) and the
failure type.

A case is a function ``fn(t)`` registered with :func:`case`.  It raises
:class:`Fail` (or any exception, reported with its text) when the directory
under test does not behave like a local POSIX filesystem on Linux.

Two phases.  A case that ``yield``s splits into a *setup* (before the
yield) and a *check* (after it).  The runner can then run the setup in the
backing directory before the mount exists (so the check exercises files
the mount did not create: the overlay's lower layer, stepfs's committed
workspace) and the check through the mount.  Invariant for such cases:
nothing crosses the yield but names; every path is rebuilt from ``t.p()``
after it (``t.d`` changes), and no descriptor stays open across it.
"""

from __future__ import annotations

import ctypes
import errno
import inspect
import os
import pickle
import select
import signal
import stat
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

#: The unprivileged identities the permission cases switch to.
UID1, GID1 = 65531, 65531
UID2, GID2 = 65532, 65532
#: A group UID1 is a supplementary member of in some cases.
GID_EXTRA = 65533

#: An mtime/atime far in the past, with nanoseconds, set before an operation
#: that must update it (no sleep needed to see the change).
OLD_NS = 1_000_000_000_123_456_789

#: Longer than any timestamp granularity of the kernel's coarse clock
#: (jiffies at HZ=100): ctime cannot be set back, so a ctime check waits
#: this long before the operation to see the clock move.
TICK = 0.011

NAME_MAX = 255
PATH_MAX = 4096

_libc = ctypes.CDLL(None, use_errno=True)
AT_FDCWD = -100
RENAME_NOREPLACE, RENAME_EXCHANGE = 1, 2
FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 1, 2
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong]


class Fail(Exception):
    """The filesystem did not behave as the case expects."""


@dataclass
class Case:
    group: str
    name: str
    fn: Callable
    args: tuple = ()

    @property
    def id(self) -> str:
        return f"{self.group}/{self.name}"

    @property
    def two_phase(self) -> bool:
        return inspect.isgeneratorfunction(self.fn)

    @property
    def dirname(self) -> str:
        return self.id.replace("/", ".").replace("[", "_").replace("]", "")


CASES: list[Case] = []


def case(group: str, params: tuple = ()):
    """Register ``fn`` as a case of ``group``; with ``params``, one case per
    value (``name[value]``), the value passed as a second argument."""

    def register(fn):
        name = fn.__name__
        if params:
            for p in params:
                CASES.append(Case(group, f"{name}[{p}]", fn, (p,)))
        else:
            CASES.append(Case(group, name, fn))
        return fn

    return register


# -- renameat2 and fallocate, which the os module does not offer ------------------------


def renameat2(a: str, b: str, flags: int) -> None:
    if _libc.renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), flags) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), a)


def fallocate(fd: int, mode: int, offset: int, length: int) -> None:
    if _libc.fallocate(fd, mode, offset, length) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def process_umask() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    return 0o022


# -- the per-case context ------------------------------------------------------------------


def _errname(code: int) -> str:
    return errno.errorcode.get(code, str(code)) if code else "success"


@dataclass
class T:
    """Everything a case touches goes through ``d``, its own directory."""

    d: str
    notes: list[str] = field(default_factory=list)

    def p(self, *names: str) -> str:
        return os.path.join(self.d, *names)

    @contextmanager
    def opened(self, name: str, flags: int, mode: int = 0o777):
        """A descriptor of ``name`` for the ``with`` block, closed after it."""
        fd = os.open(self.p(name), flags, mode)
        try:
            yield fd
        finally:
            os.close(fd)

    # creation helpers (as the current user)
    def file(self, name: str, data: bytes = b"", mode: int = 0o644) -> str:
        path = self.p(name)
        with self.opened(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode) as fd:
            if data:
                os.write(fd, data)
        os.chmod(path, mode)  # not subject to the umask
        return path

    def mkdir(self, name: str, mode: int = 0o755) -> str:
        path = self.p(name)
        os.mkdir(path, mode)
        os.chmod(path, mode)
        return path

    def make(self, kind: str, name: str, mode: int | None = None) -> str:
        """An object of ``kind`` (regular, dir, fifo, symlink, socket, chr)."""
        path = self.p(name)
        if kind == "regular":
            return self.file(name, b"data", 0o644 if mode is None else mode)
        if kind == "dir":
            return self.mkdir(name, 0o755 if mode is None else mode)
        if kind == "fifo":
            os.mkfifo(path, 0o644 if mode is None else mode)
        elif kind == "symlink":
            os.symlink("target-of-" + name, path)
        elif kind == "chr":
            os.mknod(path, stat.S_IFCHR | (0o644 if mode is None else mode), os.makedev(1, 3))
        else:
            raise ValueError(kind)
        if mode is not None and kind != "symlink":
            os.chmod(path, mode)
        return path

    # expectations
    def check(self, cond, msg: str) -> None:
        if not cond:
            raise Fail(msg)

    def eq(self, got, want, what: str) -> None:
        if got != want:
            raise Fail(f"{what}: got {got!r}, want {want!r}")

    def err(self, fn: Callable, *args) -> int:
        """errno of ``fn(*args)``, 0 when it succeeds."""
        try:
            fn(*args)
        except OSError as exc:
            return exc.errno or -1
        return 0

    def expect(self, want: int | tuple[int, ...], fn: Callable, *args) -> None:
        """``fn(*args)`` fails with ``want`` (one errno or a tuple of them)."""
        wants = want if isinstance(want, tuple) else (want,)
        got = self.err(fn, *args)
        if got not in wants:
            raise Fail(f"{getattr(fn, '__name__', fn)}{_short(args)}: got {_errname(got)}, "
                       f"want {'/'.join(_errname(w) for w in wants)}")

    def ok(self, fn: Callable, *args):
        try:
            return fn(*args)
        except OSError as exc:
            raise Fail(f"{getattr(fn, '__name__', fn)}{_short(args)} failed: {_errname(exc.errno)}") from None

    def lst(self, name: str) -> os.stat_result:
        return os.lstat(self.p(name))

    def mode(self, name: str) -> int:
        return stat.S_IMODE(os.lstat(self.p(name)).st_mode)

    def age(self, *names: str) -> None:
        """Set atime and mtime of ``names`` (the case dir itself for '.') far back."""
        for name in names:
            os.utime(self.p(name), ns=(OLD_NS, OLD_NS), follow_symlinks=False)

    def tick(self) -> None:
        time.sleep(TICK)

    def ctimes(self, *names: str) -> list[int]:
        return [os.lstat(self.p(n)).st_ctime_ns for n in names]

    def changed(self, names: tuple[str, ...], before: list[int], field_name: str) -> None:
        """Each of ``names`` has a different ``field_name`` (st_*_ns) than ``before``."""
        for name, old in zip(names, before):
            new = getattr(os.lstat(self.p(name)), field_name)
            if new == old:
                raise Fail(f"{field_name[3:8]} of {name!r} not updated")

    # running a function as an unprivileged user
    def user(self, fn: Callable, *args, uid: int = UID1, gid: int = GID1, groups: tuple = ()):
        """``fn(*args)`` in a child with these credentials; returns its value
        or raises the child's OSError (errno only) here."""
        tag, value = run_as(uid, gid, groups, fn, args)
        if tag == "err":
            raise OSError(value, os.strerror(value))
        if tag == "exc":
            raise Fail(f"child raised {value}")
        return value

    def uerr(self, fn: Callable, *args, **creds) -> int:
        return self.err(lambda: self.user(fn, *args, **creds))

    def uexpect(self, want, fn: Callable, *args, **creds) -> None:
        wants = want if isinstance(want, tuple) else (want,)
        got = self.uerr(fn, *args, **creds)
        if got not in wants:
            raise Fail(f"as uid {creds.get('uid', UID1)}: {getattr(fn, '__name__', fn)}{_short(args)}: "
                       f"got {_errname(got)}, want {'/'.join(_errname(w) for w in wants)}")

    def uok(self, fn: Callable, *args, **creds):
        try:
            return self.user(fn, *args, **creds)
        except OSError as exc:
            raise Fail(f"as uid {creds.get('uid', UID1)}: {getattr(fn, '__name__', fn)}{_short(args)} "
                       f"failed: {_errname(exc.errno)}") from None


def _short(args: tuple) -> str:
    text = "(" + ", ".join(os.path.basename(a) if isinstance(a, str) and "/" in a else repr(a)
                           for a in args) + ")"
    return text if len(text) < 120 else text[:117] + "...)"


#: Seconds a child running as another user may take before it is killed.
CHILD_TIMEOUT = 10.0


def run_as(uid: int, gid: int, groups: tuple, fn: Callable, args: tuple):
    """Fork, drop to ``uid``/``gid`` (+``groups``), run ``fn``; return
    ``("ok", value)``, ``("err", errno)`` or ``("exc", text)``."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no locks, no threads of ours, only os calls
        code = 0
        try:
            os.close(r)
            os.setgroups(list(groups))
            os.setgid(gid)
            os.setuid(uid)
            try:
                out = ("ok", fn(*args))
            except OSError as exc:
                out = ("err", exc.errno or errno.EIO)
            except BaseException as exc:  # noqa: BLE001 - reported to the parent
                out = ("exc", f"{type(exc).__name__}: {exc}")
            os.write(w, pickle.dumps(out))
        except BaseException:  # noqa: BLE001
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    data = b""
    deadline = time.monotonic() + CHILD_TIMEOUT
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return ("exc", "child timed out")
            ready, _, _ = select.select([r], [], [], left)
            if ready:
                chunk = os.read(r, 65536)
                if not chunk:
                    break
                data += chunk
    finally:
        os.close(r)
    os.waitpid(pid, 0)
    if not data:
        return ("exc", "child died without an answer")
    return pickle.loads(data)
