"""Run a command on a kernel without Landlock, really: a seccomp filter
makes the three Landlock system calls fail with ENOSYS (as on a kernel
built without them) for this process and everything it starts.

    python tests/nolandlock.py COMMAND [ARG...]

Classic BPF, installed through ``prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER)``
after ``PR_SET_NO_NEW_PRIVS``.  The filter first checks the audit
architecture (x86_64 or aarch64, where the calls are 444 to 446); on any
other architecture the launcher refuses to start rather than pretend.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys

AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
LANDLOCK_FIRST, LANDLOCK_LAST = 444, 446
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO, SECCOMP_RET_KILL_PROCESS = 0x7FFF0000, 0x00050000, 0x80000000
ENOSYS = 38
# BPF opcodes: ld word absolute, jump if equal / greater-or-equal / greater, return.
LD_W_ABS, JEQ_K, JGE_K, JGT_K, RET_K = 0x20, 0x15, 0x35, 0x25, 0x06
OFFSET_NR, OFFSET_ARCH = 0, 4  # struct seccomp_data: int nr; __u32 arch; ...


class SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8),
                ("k", ctypes.c_uint32)]


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]


def program(arch: int) -> list[tuple[int, int, int, int]]:
    return [
        (LD_W_ABS, 0, 0, OFFSET_ARCH),
        (JEQ_K, 1, 0, arch),  # another architecture's calls (x32, compat): refuse to guess
        (RET_K, 0, 0, SECCOMP_RET_KILL_PROCESS),
        (LD_W_ABS, 0, 0, OFFSET_NR),
        (JGE_K, 0, 2, LANDLOCK_FIRST),  # below 444: allow
        (JGT_K, 1, 0, LANDLOCK_LAST),  # above 446: allow
        (RET_K, 0, 0, SECCOMP_RET_ERRNO | ENOSYS),
        (RET_K, 0, 0, SECCOMP_RET_ALLOW),
    ]


def main(argv: list[str]) -> int:
    arch = AUDIT_ARCH.get(platform.machine())
    if arch is None:
        print(f"nolandlock: no filter for {platform.machine()}", file=sys.stderr)
        return 2
    insns = program(arch)
    filters = (SockFilter * len(insns))(*[SockFilter(*i) for i in insns])
    prog = SockFprog(len(insns), filters)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 or \
            libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
        err = ctypes.get_errno()
        print(f"nolandlock: cannot install the filter: {os.strerror(err)}", file=sys.stderr)
        return 2
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
