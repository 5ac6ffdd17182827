"""Unversioned trees at native speed for ``stepfs run``: the workspace's own
top-level unversioned directories bound over the mount's, in a mount
namespace of the run only (README "Unversioned paths").

A bind mount lets the kernel serve ``MOUNT/node_modules`` without the
daemon, but it has edges, each handled here:

* binds visible to every process need root and break a bare
  ``fusermount3 -u``: the run gets its own mount namespace (``unshare``,
  every mount made private so nothing propagates out), and the binds live
  and die with it;
* ``rmdir`` and ``rename`` of a mountpoint fail with EBUSY before the
  daemon is asked, and a directory made during the run (``npm install``
  makes ``node_modules``) must become fast too: a seccomp user-notification
  filter (``seccomp.py``) sends those calls to a supervisor, which detaches
  a bind about to be removed or renamed (the call then goes to the daemon
  as it would without binds), and for a ``mkdir`` of a top-level
  unversioned name makes the directory through the mount and binds it;
* a mount made from inside a FUSE request handler deadlocks: the
  supervisor is a process of the run, never the daemon.

The trampoline (this file run by path: ``python binds.py --workspace WS
--mount MNT --name N... -- COMMAND...``) unshares, binds what exists, then
forks: the child installs the filter, hands the listener to the parent and
execs the command (or the Landlock trampoline); the parent is the
supervisor, single-threaded (a threaded process cannot enter a namespace),
forwarding the signals ``stepfs run`` sends it and ending with the
command's status.  Whatever cannot be matched for sure is let through: the
worst case is the passthrough's speed (or EBUSY), never a path outside the
workspace (sources are opened beneath it without following a symlink;
directories are made through the mount, whose daemon contains them).

Standard library only when run as the trampoline (``seccomp.py`` is loaded
by path); :func:`plan_names` and :func:`trampoline_argv` are the caller's side.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import select
import signal
import socket
import sys

if __package__:
    from stepfs.overlayfs.client import seccomp
else:  # run by path as the trampoline (python -I): load the neighbour by its path
    import importlib.util

    _spec = importlib.util.spec_from_file_location(
        "stepfs_seccomp", os.path.join(os.path.dirname(os.path.abspath(__file__)), "seccomp.py"))
    seccomp = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(seccomp)

CLONE_NEWNS = 0x00020000
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
MNT_DETACH = 2
SI_KERNEL = 0x80
#: Set for the command of a run with binds (its namespace and filter are inherited by nested runs).
INSIDE_ENV = "STEPFS_BINDS"
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
GLOB_CHARS = set("*?[\\!")

#: A mountinfo field's escaped byte (``\\040`` for a space).
_OCTAL = re.compile(r"\\([0-7]{3})")
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.signalfd.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]


def _check(result: int) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


# -- the caller's side (stepfs run) ------------------------------------------------


def plan_names(rules: dict) -> list[str]:
    """The top-level names worth binding under a mount's rules (``rules``:
    its status's ``unversioned``): plain one-name directory patterns
    (``node_modules/``, ``/.venv/``) the whole rule list still calls
    unversioned as a directory at the root.  Glob patterns stay with the
    passthrough."""
    from stepfs.store.ignorefile import Matcher, parse_lenient

    texts = [*rules.get("defaults", []), *rules.get("stepfsignore", []), *rules.get("excludes", [])]
    patterns, _problems = parse_lenient(texts)
    matcher = Matcher(patterns)
    out: list[str] = []
    for text in texts:
        name = text.strip().strip("/")
        if (not name or "/" in name or name in (".", "..", ".stepfs", ".stepfsignore") or text.startswith("!")
                or GLOB_CHARS & set(name) or name in out):
            continue
        if matcher.match(name, True):
            out.append(name)
    return out


_told = False


def plan(mountpoint: str) -> tuple[str, list[str]] | None:
    """(workspace, names to bind) for a run in ``mountpoint``; None when
    nothing is to be bound or binding is impossible here (said once on
    stderr: the run then uses the mount's passthrough, as any process does)."""
    global _told
    from stepfs.overlayfs.client import control, mounts
    from stepfs.store.errors import StepfsError

    if os.environ.get(INSIDE_ENV):
        return None  # a run inside a run: the outer supervisor serves it (a second listener is refused: EBUSY)
    if seccomp.machine() not in seccomp.ARCHES:
        reason = f"no seccomp filter for {seccomp.machine()}"
    elif os.geteuid() != 0:
        reason = "binding them in the run's own mount namespace needs root"
    else:
        entry = mounts.find(mountpoint)
        try:
            ping = control.request(mountpoint, {"op": "ping"}, timeout=5.0)
            rules = ping.get("unversioned") or {}
            if ping.get("readonly"):  # the daemon refuses writes: a bind must not get round it
                rules, reason = None, f"the mount is read-only: {ping['readonly']}"
        except StepfsError as exc:
            rules, reason = None, f"the mount did not say its rules: {exc}"
        if rules is not None and entry is not None and entry.workspace:
            names = plan_names(rules)
            return (entry.workspace, names) if names else None
        if rules is not None:
            reason = "no workspace for the mount"
    if not _told:
        _told = True
        print(f"stepfs: unversioned trees go through the mount in this run ({reason}).", file=sys.stderr)
    return None


def forget(mountpoint: str, names: list[str]) -> None:
    """After a run: the daemon never saw what the run did below its binds,
    so make the kernel of every other process look those trees up again
    (the mount caches names and attributes for a minute)."""
    from stepfs.overlayfs.client import control
    from stepfs.store.errors import StepfsError

    try:
        control.request(mountpoint, {"op": "invalidate", "paths": ["/" + n for n in names]}, timeout=10.0)
    except StepfsError as exc:
        print(f"stepfs: the mount {mountpoint} may show its unversioned trees as they were for a minute ({exc}).",
              file=sys.stderr)


def trampoline_argv(workspace: str, mountpoint: str, names: list[str], command: list[str]) -> list[str]:
    """The argv that runs ``command`` (already wrapped by Landlock's
    trampoline if confined) under the binds of ``names``."""
    argv = [sys.executable, "-I", "-B", os.path.abspath(__file__), "--workspace", workspace, "--mount", mountpoint]
    for name in names:
        argv += ["--name", name]
    return argv + ["--", *command]


# -- which directory a call names ------------------------------------------------


def top_name(path: bytes, base: str | None, mount: str, names: frozenset[str] | set[str]) -> str | None:
    """The name in ``names`` if ``path`` (relative to ``base``, the caller's
    directory, when not absolute) is exactly ``mount/NAME``; else None.
    A ``..`` anywhere, or an unknown base, is "not sure": None."""
    try:
        text = os.fsdecode(path)
    except UnicodeError:
        return None
    parts = [p for p in text.split("/") if p not in ("", ".")]
    if not parts or parts[-1] not in names:  # the cheap test first: most calls stop here
        return None
    if not text.startswith("/"):
        if base is None or not base.startswith("/"):
            return None
        parts = [p for p in base.split("/") if p not in ("", ".")] + parts
    if ".." in parts:
        return None
    return parts[-1] if "/" + "/".join(parts[:-1]) == mount else None


# -- the namespace ----------------------------------------------------------------


def enter_namespace() -> None:
    """A mount namespace of our own whose mounts never propagate out."""
    _check(_libc.unshare(CLONE_NEWNS))
    _check(_libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None))


def drop_other_stepfs_mounts(mount: str) -> None:
    """Detach, in this namespace only, the other stepfs mounts ``unshare``
    copied into it: a copy held here keeps their daemons serving and makes
    their ``stepfs unmount`` refuse (``mounts.holders_elsewhere``) for as
    long as anything of this run lives.  The run's own mount stays."""
    own = os.path.normpath(os.path.abspath(mount))
    others = []
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields, _, tail = line.partition(" - ")
                fields = fields.split()
                if len(fields) > 4 and tail.split(maxsplit=1)[:1] == ["fuse.stepfs"]:
                    point = _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), fields[4])
                    if point != own:
                        others.append(point)
    except OSError:
        return
    for point in sorted(others, key=len, reverse=True):  # inner mounts first
        try:
            _check(_libc.umount2(os.fsencode(point), MNT_DETACH))
        except OSError:
            pass  # gone meanwhile: nothing to hold


class Binds:
    """The binds of one run: ``mount/NAME`` showing ``workspace/NAME``."""

    def __init__(self, workspace: str, mount: str, names: list[str]):
        self.ws_fd = os.open(workspace, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        self.mount = os.path.realpath(mount)
        self.names = frozenset(names)
        self.bound: set[str] = set()

    def bind(self, name: str) -> bool:
        """Bind ``workspace/NAME`` over ``mount/NAME`` if both are real
        directories (neither a symlink); False if not bound."""
        src = dst = -1
        try:
            src = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.ws_fd)
            mfd = os.open(self.mount, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                dst = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=mfd)
            finally:
                os.close(mfd)
            _check(_libc.mount(f"/proc/self/fd/{src}".encode(), f"/proc/self/fd/{dst}".encode(), None,
                               MS_BIND, None))
        except OSError:
            return False
        finally:
            for fd in (src, dst):
                if fd >= 0:
                    os.close(fd)
        self.bound.add(name)
        return True

    def empty(self, name: str) -> bool:
        """Whether ``workspace/NAME`` has no entries (True if it cannot be read:
        then the call decides)."""
        try:
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.ws_fd)
        except OSError:
            return True
        try:
            with os.scandir(fd) as entries:
                return next(entries, None) is None
        finally:
            os.close(fd)

    def detach(self, name: str) -> None:
        """Take the bind off ``mount/NAME`` (lazily: open descriptors in it keep working)."""
        self.bound.discard(name)
        try:
            _check(_libc.umount2(os.fsencode(os.path.join(self.mount, name)), MNT_DETACH))
        except OSError:
            pass

    def detach_all(self) -> None:
        for name in list(self.bound):
            self.detach(name)


# -- the supervisor ------------------------------------------------------------------


def _caller_dir(pid: int, dirfd: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/cwd" if dirfd == seccomp.AT_FDCWD else f"/proc/{pid}/fd/{dirfd}")
    except OSError:
        return None


def _umask(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


class Supervisor:
    """Answers the filter's notifications for :class:`Binds`."""

    def __init__(self, binds: Binds, listener: int):
        self.binds = binds
        self.fd = listener
        self.calls = seccomp.names()
        seccomp.sync_wakeups(listener)

    def _name(self, n, dirfd_arg: int | None, path_arg: int) -> str | None:
        path = seccomp.read_string(n.pid, n.args[path_arg])
        if path is None:
            return None
        dirfd = seccomp.AT_FDCWD if dirfd_arg is None else seccomp.as_fd(n.args[dirfd_arg])
        if not path.startswith(b"/"):
            tail = path.rstrip(b"/").rpartition(b"/")[2]
            if os.fsdecode(tail) not in self.binds.names:
                return None  # the cheap test before reading the caller's directory
        base = None if path.startswith(b"/") else _caller_dir(n.pid, dirfd)
        name = top_name(path, base, self.binds.mount, self.binds.names)
        # What we read was the caller's only if it still waits (pids are recycled).
        return name if name is not None and seccomp.id_valid(self.fd, n.id) else None

    def handle(self, n) -> None:
        call = self.calls.get(n.nr)
        try:
            if call in ("mkdir", "mkdirat"):
                name = self._name(n, None, 0) if call == "mkdir" else self._name(n, 0, 1)
                if name is not None and name not in self.binds.bound:
                    mode = n.args[1 if call == "mkdir" else 2] & 0o7777
                    return self._make(n, name, mode)
            elif call in ("rmdir", "unlinkat"):
                name = self._name(n, None, 0) if call == "rmdir" else self._name(n, 0, 1)
                if name in self.binds.bound:
                    if not self.binds.empty(name):
                        # What the call would answer without the bind; the tree stays fast ('rmdir x || true').
                        return seccomp.respond(self.fd, n.id, error=errno.ENOTEMPTY)
                    self.binds.detach(name)
            elif call in ("rename", "renameat", "renameat2"):
                ends = ((None, 0), (None, 1)) if call == "rename" else ((0, 1), (2, 3))
                for dirfd_arg, path_arg in ends:
                    name = self._name(n, dirfd_arg, path_arg)
                    if name in self.binds.bound:
                        self.binds.detach(name)
        except Exception:  # noqa: BLE001  not sure: let the call run as it would without binds
            pass
        seccomp.respond(self.fd, n.id, cont=True)

    def _make(self, n, name: str, mode: int) -> None:
        """``mkdir mount/NAME`` on the caller's behalf, through the mount (the
        daemon contains it), then the bind; answered with the mkdir's result."""
        try:
            os.mkdir(os.path.join(self.binds.mount, name), mode & ~_umask(n.pid))
        except OSError as exc:
            return seccomp.respond(self.fd, n.id, error=exc.errno or errno.EIO)
        self.binds.bind(name)
        seccomp.respond(self.fd, n.id, val=0)

    def serve_once(self) -> bool:
        """Answer one notification; False when no process uses the filter any more."""
        try:
            n = seccomp.recv(self.fd)
            if n is not None:
                self.handle(n)
        except OSError as exc:  # a supervisor that died would fail the command's mkdirs with ENOSYS
            print(f"stepfs: binds: {exc}", file=sys.stderr)
        return True

    def idle(self, timeout: float) -> bool:
        """Whether the filter has no users left (waiting up to ``timeout``)."""
        ready = select.poll()
        ready.register(self.fd, select.POLLIN)
        for _fd, ev in ready.poll(int(timeout * 1000)):
            if ev & select.POLLIN:
                self.serve_once()
                return False
            if ev & (select.POLLHUP | select.POLLERR):
                return True
        return False


class _SigInfo(ctypes.Structure):
    _fields_ = [("signo", ctypes.c_uint32), ("errno", ctypes.c_int32), ("code", ctypes.c_int32),
                ("rest", ctypes.c_uint8 * 116)]


def _signalfd(signals) -> int:
    mask = (ctypes.c_ulong * (128 // ctypes.sizeof(ctypes.c_ulong)))()
    bits = 8 * ctypes.sizeof(ctypes.c_ulong)
    for s in signals:
        mask[(s - 1) // bits] |= 1 << ((s - 1) % bits)
    fd = _libc.signalfd(-1, ctypes.byref(mask), os.O_CLOEXEC)
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return fd


def supervise(sup: Supervisor | None, child: int) -> int:
    """Serve until the command ends, forwarding signals sent to us (a
    terminal's reached the command already); the command's wait status.
    Its own children, if any outlive it, keep a server until they end."""
    wanted = {*FORWARDED, signal.SIGCHLD}
    sfd = _signalfd(wanted)
    poll = select.poll()
    if sup is not None:
        poll.register(sup.fd, select.POLLIN)
    poll.register(sfd, select.POLLIN)
    status = None
    while status is None:
        for fd, ev in poll.poll():
            if fd != sfd:
                if not ev & select.POLLIN:
                    poll.unregister(fd)  # no user left but the command's zombie: wait for SIGCHLD
                    continue
                sup.serve_once()
            elif fd == sfd:
                info = _SigInfo()
                if os.readv(sfd, [info]) != ctypes.sizeof(info):
                    continue
                if info.signo != signal.SIGCHLD:
                    if info.code != SI_KERNEL:
                        try:
                            os.kill(child, info.signo)
                        except ProcessLookupError:
                            pass
                    continue
                pid, st = os.waitpid(child, os.WNOHANG)
                if pid == child:
                    status = st
    os.close(sfd)
    if sup is not None and not sup.idle(0.05) and os.fork() == 0:
        # Left-over children of the command: serve them until none is left
        # (their mkdir/rmdir would fail ENOSYS with no listener).
        try:
            os.setsid()
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):  # nobody waiting on the run's output waits for us too
                os.dup2(null, fd)
            while not sup.idle(60.0):
                pass
        finally:
            os._exit(0)
    return status


def _exit_like(status: int) -> None:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {sig})
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.waitstatus_to_exitcode(status))


def _exec(command: list[str]) -> None:
    try:
        os.execvp(command[0], command)
    except FileNotFoundError:
        print(f"stepfs: {command[0]}: command not found", file=sys.stderr)
        os._exit(127)
    except OSError as exc:
        print(f"stepfs: cannot run {command[0]}: {exc.strerror}", file=sys.stderr)
        os._exit(126)


def _fallback_note(reason: str) -> None:
    print(f"stepfs: unversioned trees go through the mount in this run ({reason}).", file=sys.stderr)


def _parse(argv: list[str]) -> tuple[str, str, list[str], list[str]]:
    ws = mnt = None
    names: list[str] = []
    i = 0
    while i < len(argv) and argv[i] != "--":
        opt, value = argv[i], argv[i + 1]
        if opt == "--workspace":
            ws = value
        elif opt == "--mount":
            mnt = value
        elif opt == "--name":
            names.append(value)
        else:
            raise SystemExit(f"binds.py: unknown option {opt}")
        i += 2
    if ws is None or mnt is None or i + 1 >= len(argv):
        raise SystemExit("usage: binds.py --workspace WS --mount MNT [--name N]... -- COMMAND...")
    return ws, mnt, names, argv[i + 1:]


def main(argv: list[str]) -> None:
    ws, mnt, names, command = _parse(argv)
    try:
        enter_namespace()
        drop_other_stepfs_mounts(mnt)
        binds = Binds(ws, mnt, names)
    except OSError as exc:
        _fallback_note(f"no mount namespace: {exc.strerror}")
        _exec(command)
    for name in sorted(binds.names):
        binds.bind(name)
    parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {*FORWARDED, signal.SIGCHLD})
    child = os.fork()
    if child == 0:
        parent_end.close()
        try:
            listener = seccomp.install()
        except OSError as exc:
            fds_sent = False
            child_end.sendall(f"no:{exc.strerror}".encode())
        else:
            fds_sent = True
            socket.send_fds(child_end, [b"ok"], [listener])
            os.close(listener)  # the command must never answer its own calls
        child_end.recv(2)  # "go": the parent has the listener, or has taken the binds off
        child_end.close()
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        if fds_sent:
            os.environ[INSIDE_ENV] = "1"
        _exec(command)
    child_end.close()
    msg, fds, _flags, _addr = socket.recv_fds(parent_end, 256, 1)
    if not fds:
        binds.detach_all()  # without the filter an rmdir of a bind would fail EBUSY
        _fallback_note(f"no seccomp user notification: {msg.decode(errors='replace')[3:]}")
        parent_end.sendall(b"go")
        parent_end.close()
        _exit_like(supervise(None, child))
    os.umask(0)  # the caller's umask is applied to each mkdir made for it
    parent_end.sendall(b"go")
    parent_end.close()
    _exit_like(supervise(Supervisor(binds, fds[0]), child))


if __name__ == "__main__":
    main(sys.argv[1:])
