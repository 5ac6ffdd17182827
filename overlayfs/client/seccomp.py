"""A ctypes binding of seccomp user notification, for the namespace binds
of ``stepfs run`` (``binds.py``).

The filter (:func:`program`) asks the supervisor about exactly the calls
that can meet a bind mountpoint: ``mkdir``/``mkdirat`` (a top-level
unversioned directory being made), ``rmdir``, ``unlinkat`` *with*
``AT_REMOVEDIR`` (BPF tests the flags, so the thousands of plain unlinks
of an ``rm -rf`` never leave the kernel), and ``rename``/``renameat``/
``renameat2``.  Everything else, and every call of another architecture
than the one the filter was built for, is allowed without a word.

Standard library only: ``binds.py`` runs by path as a trampoline and loads
this file next to it.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform

# Classic BPF opcodes (linux/filter.h) and seccomp return values.
BPF_LD_W_ABS = 0x20
BPF_JEQ_K = 0x15
BPF_JSET_K = 0x45
BPF_RET_K = 0x06
RET_ALLOW = 0x7FFF0000
RET_USER_NOTIF = 0x7FC00000

SECCOMP_SET_MODE_FILTER = 1
FILTER_FLAG_NEW_LISTENER = 1 << 3
USER_NOTIF_FLAG_CONTINUE = 1
AT_FDCWD = -100
AT_REMOVEDIR = 0x200

# struct seccomp_data: int nr; u32 arch; u64 ip; u64 args[6] (little-endian
# low word of an argument at 16 + 8*i).
OFF_NR, OFF_ARCH = 0, 4


def off_arg(i: int) -> int:
    return 16 + 8 * i


#: Per architecture: the AUDIT_ARCH value, the seccomp(2) number and the
#: calls the filter sends to the supervisor (aarch64 has only the *at forms).
ARCHES = {
    "x86_64": (0xC000003E, 317, {"rename": 82, "mkdir": 83, "rmdir": 84, "mkdirat": 258, "unlinkat": 263,
                                  "renameat": 264, "renameat2": 316}),
    "aarch64": (0xC00000B7, 277, {"mkdirat": 34, "unlinkat": 35, "renameat": 38, "renameat2": 276}),
}

# ioctls on the listener: _IOWR('!', 0, struct seccomp_notif) and so on.
IOCTL_NOTIF_RECV = 0xC0502100
IOCTL_NOTIF_SEND = 0xC0182101
IOCTL_NOTIF_ID_VALID = 0x40082102
IOCTL_NOTIF_SET_FLAGS = 0x40082104  # Linux 6.6
USER_NOTIF_FD_SYNC_WAKE_UP = 1


class SeccompUnavailable(OSError):
    """This kernel or architecture cannot run the filter; ``strerror`` says why."""


def machine() -> str:
    return platform.machine()


def program(arch: str) -> list[tuple[int, int, int, int]]:
    """The filter for ``arch`` as (code, jt, jf, k) instructions."""
    audit, _nr, calls = ARCHES[arch]
    # Symbolic jumps ("allow"/"notify"/0) are resolved to offsets at the end.
    prog: list[list] = [[BPF_LD_W_ABS, 0, 0, OFF_ARCH], [BPF_JEQ_K, 0, "allow", audit],
                        [BPF_LD_W_ABS, 0, 0, OFF_NR]]
    for name, nr in calls.items():
        if name != "unlinkat":
            prog.append([BPF_JEQ_K, "notify", 0, nr])
    prog.append([BPF_JEQ_K, 0, "allow", calls["unlinkat"]])
    prog.append([BPF_LD_W_ABS, 0, 0, off_arg(2)])
    prog.append([BPF_JSET_K, "notify", "allow", AT_REMOVEDIR])
    labels = {"allow": len(prog), "notify": len(prog) + 1}
    prog.append([BPF_RET_K, 0, 0, RET_ALLOW])
    prog.append([BPF_RET_K, 0, 0, RET_USER_NOTIF])
    out = []
    for i, (code, jt, jf, k) in enumerate(prog):
        jt = labels[jt] - i - 1 if isinstance(jt, str) else jt
        jf = labels[jf] - i - 1 if isinstance(jf, str) else jf
        out.append((code, jt, jf, k))
    return out


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(_SockFilter))]


class Notif(ctypes.Structure):
    """struct seccomp_notif (80 bytes)."""
    _fields_ = [("id", ctypes.c_uint64), ("pid", ctypes.c_uint32), ("flags", ctypes.c_uint32),
                ("nr", ctypes.c_int32), ("arch", ctypes.c_uint32), ("ip", ctypes.c_uint64),
                ("args", ctypes.c_uint64 * 6)]


class Resp(ctypes.Structure):
    """struct seccomp_notif_resp (24 bytes)."""
    _fields_ = [("id", ctypes.c_uint64), ("val", ctypes.c_int64), ("error", ctypes.c_int32),
                ("flags", ctypes.c_uint32)]


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]
_libc.process_vm_readv.restype = ctypes.c_ssize_t
_libc.process_vm_readv.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                                   ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_ulong]


def install(arch: str | None = None) -> int:
    """Install the filter on the calling thread (inherited through fork and
    exec); returns the listener descriptor (close-on-exec).  Needs
    CAP_SYS_ADMIN or no-new-privileges set first."""
    arch = arch or machine()
    if arch not in ARCHES:
        raise SeccompUnavailable(errno.ENOSYS, f"no seccomp filter for the {arch} architecture")
    insns = program(arch)
    table = (_SockFilter * len(insns))(*[_SockFilter(*i) for i in insns])
    fprog = _SockFprog(len(insns), table)
    fd = _libc.syscall(ctypes.c_long(ARCHES[arch][1]), ctypes.c_uint(SECCOMP_SET_MODE_FILTER),
                       ctypes.c_uint(FILTER_FLAG_NEW_LISTENER), ctypes.byref(fprog))
    if fd < 0:
        err = ctypes.get_errno()
        raise SeccompUnavailable(err, os.strerror(err))
    return fd


def sync_wakeups(fd: int) -> bool:
    """Ask the kernel to switch straight between a caller and the
    supervisor (Linux 6.6+): each notification is a round trip, and on a
    busy machine the wake-ups dominate.  False where the kernel has no such flag."""
    return _libc.ioctl(fd, IOCTL_NOTIF_SET_FLAGS, ctypes.c_void_p(USER_NOTIF_FD_SYNC_WAKE_UP)) == 0


def names(arch: str | None = None) -> dict[int, str]:
    """Call number -> name of the calls the filter notifies."""
    return {nr: name for name, nr in ARCHES[arch or machine()][2].items()}


def recv(fd: int) -> Notif | None:
    """The next notification; None if its caller died before it was read."""
    n = Notif()  # the kernel refuses a buffer that is not zeroed
    while _libc.ioctl(fd, IOCTL_NOTIF_RECV, ctypes.byref(n)) != 0:
        err = ctypes.get_errno()
        if err == errno.EINTR:
            continue
        if err == errno.ENOENT:
            return None
        raise OSError(err, os.strerror(err))
    return n


def respond(fd: int, notif_id: int, *, cont: bool = False, error: int = 0, val: int = 0) -> None:
    """Answer a notification: let the call run (``cont``), or fail it with
    ``error`` (an errno), or succeed with ``val``.  A caller that died
    meanwhile is not an error."""
    r = Resp(notif_id, 0 if cont else val, 0 if cont else -error, USER_NOTIF_FLAG_CONTINUE if cont else 0)
    if _libc.ioctl(fd, IOCTL_NOTIF_SEND, ctypes.byref(r)) != 0:
        err = ctypes.get_errno()
        if err != errno.ENOENT:
            raise OSError(err, os.strerror(err))


def id_valid(fd: int, notif_id: int) -> bool:
    """Whether the caller of ``notif_id`` still waits (so what was read of
    its memory was its own, not a recycled pid's)."""
    value = ctypes.c_uint64(notif_id)
    return _libc.ioctl(fd, IOCTL_NOTIF_ID_VALID, ctypes.byref(value)) == 0


PATH_MAX = 4096
PAGE = 4096


def read_string(pid: int, addr: int, limit: int = PATH_MAX) -> bytes | None:
    """The NUL-terminated string at ``addr`` in process ``pid``; None if it
    cannot be read whole (unmapped, longer than ``limit``)."""
    if not addr:
        return None
    out = bytearray()
    while len(out) < limit:
        want = min(PAGE - (addr % PAGE), limit - len(out))  # never cross into a page that may be unmapped
        buf = ctypes.create_string_buffer(want)
        local, remote = _IoVec(ctypes.cast(buf, ctypes.c_void_p), want), _IoVec(addr, want)
        got = _libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if got <= 0:
            return None
        chunk = buf.raw[:got]
        end = chunk.find(b"\0")
        if end >= 0:
            out += chunk[:end]
            return bytes(out)
        out += chunk
        addr += got
    return None


def as_fd(value: int) -> int:
    """A descriptor argument as the signed int the kernel reads (AT_FDCWD)."""
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value
