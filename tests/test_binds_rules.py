"""Kernel-free: the seccomp filter's program (run by a small classic-BPF
interpreter over made-up ``seccomp_data``), the path matching of the run's
binds, and which names a mount's rules let ``stepfs run`` bind."""

from __future__ import annotations

import ctypes
import struct

import pytest

from stepfs.overlayfs.client import binds, seccomp


def run_bpf(prog, nr: int, arch: int, args=(0, 0, 0, 0, 0, 0)) -> int:
    data = struct.pack("<iIQ6Q", nr, arch, 0, *args)
    pc, acc = 0, 0
    while True:
        code, jt, jf, k = prog[pc]
        if code == seccomp.BPF_LD_W_ABS:
            acc = struct.unpack_from("<I", data, k)[0]
            pc += 1
        elif code == seccomp.BPF_JEQ_K:
            pc += 1 + (jt if acc == k else jf)
        elif code == seccomp.BPF_JSET_K:
            pc += 1 + (jt if acc & k else jf)
        elif code == seccomp.BPF_RET_K:
            return k
        else:
            raise AssertionError(f"unexpected opcode {code:#x}")


@pytest.mark.parametrize("arch", sorted(seccomp.ARCHES))
def test_the_filter_notifies_exactly_the_calls_that_meet_a_mountpoint(arch):
    prog = seccomp.program(arch)
    audit, _sys, calls = seccomp.ARCHES[arch]
    assert len(prog) < 20 and all(0 <= jt < 256 and 0 <= jf < 256 for _c, jt, jf, _k in prog)
    for name, nr in calls.items():
        if name != "unlinkat":
            assert run_bpf(prog, nr, audit) == seccomp.RET_USER_NOTIF, name
    # rm -rf's thousands of file unlinks never leave the kernel; its rmdirs do.
    unlinkat = calls["unlinkat"]
    assert run_bpf(prog, unlinkat, audit, (seccomp.AT_FDCWD & 0xFFFFFFFFFFFFFFFF, 1, 0, 0, 0, 0)) == seccomp.RET_ALLOW
    assert run_bpf(prog, unlinkat, audit, (3, 1, seccomp.AT_REMOVEDIR, 0, 0, 0)) == seccomp.RET_USER_NOTIF
    assert run_bpf(prog, unlinkat, audit, (3, 1, (1 << 32) | 0x100, 0, 0, 0)) == seccomp.RET_ALLOW
    # Everything else, and any call of another architecture, is allowed.
    for other in (0, 1, 2, 59, 257, 400):
        if other not in calls.values():
            assert run_bpf(prog, other, audit) == seccomp.RET_ALLOW
    for nr in calls.values():
        assert run_bpf(prog, nr, 0x40000003) == seccomp.RET_ALLOW


def test_structs_have_the_kernels_sizes():
    assert ctypes.sizeof(seccomp.Notif) == 80 and ctypes.sizeof(seccomp.Resp) == 24
    assert seccomp.IOCTL_NOTIF_RECV == (3 << 30) | (80 << 16) | (ord("!") << 8) | 0
    assert seccomp.IOCTL_NOTIF_SEND == (3 << 30) | (24 << 16) | (ord("!") << 8) | 1
    assert seccomp.as_fd(seccomp.AT_FDCWD & 0xFFFFFFFFFFFFFFFF) == seccomp.AT_FDCWD
    assert seccomp.as_fd(0xFFFFFFFF00000005) == 5


NAMES = frozenset({"node_modules", ".venv"})


@pytest.mark.parametrize("path, base, expected", [
    (b"node_modules", "/m/mnt", "node_modules"),
    (b"node_modules/", "/m/mnt", "node_modules"),
    (b"./node_modules", "/m/mnt", "node_modules"),
    (b"/m/mnt/node_modules", None, "node_modules"),
    (b"/m/mnt//.venv/", "/elsewhere", ".venv"),
    (b"../mnt/node_modules", "/m/mnt/sub", None),        # '..': not sure, let it through
    (b"mnt/node_modules", "/m", "node_modules"),
    (b"node_modules", "/m/mnt/pkg", None),                 # a nested node_modules stays with the daemon
    (b"/m/mnt/node_modules/x", None, None),
    (b"/m/mnt2/node_modules", None, None),
    (b"build", "/m/mnt", None),
    (b"node_modules", None, None),                         # unknown cwd
    (b"node_modules", "/m/mnt (deleted)", None),
    (b"", "/m/mnt", None),
    (b"\xff/node_modules", "/m/mnt", None),
])
def test_top_name(path, base, expected):
    assert binds.top_name(path, base, "/m/mnt", NAMES) == expected


def test_names_follow_the_whole_rule_list():
    defaults = ["node_modules/", ".venv/", "__pycache__/", ".next/cache/", "*.egg-info/"]
    assert binds.plan_names({"defaults": defaults}) == ["node_modules", ".venv", "__pycache__"]
    # A later negation wins; an anchored or plain name counts; globs do not.
    assert binds.plan_names({"defaults": defaults, "stepfsignore": ["!node_modules/", "/build/", "dist"],
                             "excludes": ["cache-*/"]}) == [".venv", "__pycache__", "build", "dist"]
    assert binds.plan_names({"defaults": [], "excludes": ["/.stepfs/", ".stepfsignore", "../x/"]}) == []


def test_trampoline_argv_wraps_the_command():
    argv = binds.trampoline_argv("/w", "/m", ["node_modules", ".venv"], ["sh", "-c", "true"])
    assert argv[1:3] == ["-I", "-B"] and argv[3].endswith("binds.py")
    assert argv[4:] == ["--workspace", "/w", "--mount", "/m", "--name", "node_modules", "--name", ".venv",
                        "--", "sh", "-c", "true"]
    assert binds._parse(argv[4:]) == ("/w", "/m", ["node_modules", ".venv"], ["sh", "-c", "true"])


def test_plan_falls_back_once_and_quietly_inside_a_run(monkeypatch, capsys):
    monkeypatch.setattr(binds, "_told", False)
    monkeypatch.delenv(binds.INSIDE_ENV, raising=False)
    monkeypatch.setattr(binds.os, "geteuid", lambda: 1000)
    assert binds.plan("/nowhere") is None and binds.plan("/nowhere") is None
    err = capsys.readouterr().err
    assert err.count("unversioned trees go through the mount in this run") == 1 and "needs root" in err
    monkeypatch.setattr(binds, "_told", False)
    monkeypatch.setenv(binds.INSIDE_ENV, "1")
    assert binds.plan("/nowhere") is None
    assert capsys.readouterr().err == ""


def test_plan_binds_nothing_in_a_read_only_mount(monkeypatch, capsys):
    from types import SimpleNamespace

    from stepfs.overlayfs.client import control, mounts

    monkeypatch.setattr(binds, "_told", False)
    monkeypatch.delenv(binds.INSIDE_ENV, raising=False)
    monkeypatch.setattr(binds.os, "geteuid", lambda: 0)
    monkeypatch.setattr(mounts, "find", lambda mp: SimpleNamespace(workspace="/ws"))
    answer = {"unversioned": {"defaults": ["node_modules/"]}, "readonly": None}
    monkeypatch.setattr(control, "request", lambda mp, req, timeout: answer)
    assert binds.plan("/m") == ("/ws", ["node_modules"])
    answer["readonly"] = "the store's disk is full"
    assert binds.plan("/m") is None
    assert "the mount is read-only: the store's disk is full" in capsys.readouterr().err
