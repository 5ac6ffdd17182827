"""Real-mount tier: ``stepfs run`` serves the top-level unversioned trees
from the kernel through binds in the run's own mount namespace
(``overlayfs/client/binds.py``), driven by real tools: an npm-like
installer into a ``node_modules`` that does not exist yet, ``rm -rf``,
``mv``, ``python -m venv``, a step and a rollback around such trees, and a
confined run whose symlink in ``node_modules`` points at a decoy outside."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from conftest import manifest, sh, stepfs
from mountguard import private_tmp  # noqa: F401
from stepfs.overlayfs.client import binds, mounts

pytestmark = [pytest.mark.mount,
              pytest.mark.skipif(os.geteuid() != 0, reason="binds in a mount namespace need root")]
NPM = Path(__file__).resolve().parents[1] / "bench" / "npm_like.py"
TRAMPOLINE = os.path.abspath(binds.__file__)


def bind_points(mp: Path) -> str:
    """A shell snippet printing to stderr the mount points under ``mp`` the
    command's namespace has (mountinfo's fifth field), each as 'bind: PATH'."""
    return f"awk '$5 ~ \"^{mp}/\" {{print \"bind: \" $5}}' /proc/self/mountinfo >&2"


def bound(r) -> list[str]:
    return [line[6:] for line in r.stderr.decode().splitlines() if line.startswith("bind: ")]


def supervisors(workspace: Path) -> list[int]:
    """Processes running the binds trampoline for ``workspace``."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if os.fsencode(TRAMPOLINE) in args and os.fsencode(str(workspace)) in args:
            out.append(int(pid))
    return out


def process_state(pid: int) -> bytes:
    return Path(f"/proc/{pid}/stat").read_bytes().rpartition(b")")[2].split()[0]


def wait_gone(workspace: Path, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while supervisors(workspace):
        assert time.monotonic() < deadline, f"supervisors left: {supervisors(workspace)}"
        time.sleep(0.05)


def run(workspace: Path, mp: Path, script: str, *opts: str, timeout: float = 240):
    r = stepfs("run", workspace, "--json", "--mountpoint", mp, *opts, "--", "bash", "-c", script,
               cwd=workspace, timeout=timeout)
    wait_gone(workspace)
    assert mounts.stepfs_mounts(str(workspace)) == []
    return r


def host_mounts_under(path: Path) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [line.split()[4] for line in f if line.split()[4].startswith(str(path))]


@pytest.mark.timeout(300)
def test_npm_into_a_new_node_modules_then_rm_rf_and_mv(workspace, private_tmp):
    (workspace / "package.json").write_text("{}\n")
    mp = private_tmp / "mnt"
    # node_modules does not exist when the run starts: its mkdir is made and bound for the command.
    r = run(workspace, mp, f"{sys.executable} {NPM} node_modules --files 600 && "
                           f"mkdir -p node_modules/pkg-1/node_modules/inner && {bind_points(mp)}")
    assert r.returncode == 0, r.stderr.decode()
    assert bound(r) == [f"{mp}/node_modules"]  # the nested node_modules is not bound
    assert b"go through the mount" not in r.stderr
    files = [p for p in (workspace / "node_modules").rglob("*") if p.is_file()]
    assert len(files) == 600
    assert (workspace / "node_modules/pkg-1/node_modules/inner").is_dir()
    assert json.loads(r.stdout.decode().strip().splitlines()[-1])["number"] is None  # nothing versioned
    assert host_mounts_under(private_tmp) == []  # nothing propagated out of the run's namespace
    # It exists when the next run starts: bound at once; rm -rf removes it, binds and all.
    r = run(workspace, mp, f"rmdir node_modules 2>&1 | grep -q 'Directory not empty' && {bind_points(mp)} && "
                           "rm -rf node_modules && test ! -e node_modules")
    assert r.returncode == 0, r.stderr.decode()
    assert bound(r) == [f"{mp}/node_modules"]
    assert not (workspace / "node_modules").exists()
    # mv of a bound tree (an unversioned name, then a versioned one), and rmdir of an empty one.
    r = run(workspace, mp, f"{sys.executable} {NPM} node_modules --files 40 && mv node_modules .venv && "
                           f"mv .venv vendored && mkdir .tox && rmdir .tox && {bind_points(mp)}")
    assert r.returncode == 0, r.stderr.decode()
    assert bound(r) == []
    assert not (workspace / "node_modules").exists() and not (workspace / ".tox").exists()
    assert len([p for p in (workspace / "vendored").rglob("*") if p.is_file()]) == 40
    card = json.loads(r.stdout.decode().strip().splitlines()[-1])["card"]
    assert len([f for f in card["files"] if f["path"].startswith("vendored/") and f["kind"] != "dir"]) == 40


@pytest.mark.timeout(300)
def test_venv_a_step_and_a_rollback_leave_bound_trees_untouched(workspace, private_tmp):
    (workspace / "calc.py").write_text("one\n")
    mp = private_tmp / "mnt"
    r = run(workspace, mp, f"{sys.executable} -m venv --without-pip .venv && .venv/bin/python -c 'print(7)' && "
                           f"{sys.executable} {NPM} node_modules --files 100 && echo two > calc.py && {bind_points(mp)}")
    assert r.returncode == 0, r.stderr.decode()
    assert sorted(bound(r)) == [f"{mp}/.venv", f"{mp}/node_modules"]
    assert (workspace / ".venv/pyvenv.cfg").is_file()
    card = json.loads(r.stdout.decode().strip().splitlines()[-1])["card"]
    assert [f["path"] for f in card["files"]] == ["calc.py"]
    trees = manifest(workspace / ".venv"), manifest(workspace / "node_modules")
    r = run(workspace, mp, "echo three > calc.py && touch node_modules/late.js")
    assert r.returncode == 0, r.stderr.decode()
    trees = manifest(workspace / ".venv"), manifest(workspace / "node_modules")
    result = stepfs("rollback", workspace, "0")
    assert result.returncode == 0, result.stderr
    assert (workspace / "calc.py").read_text() == "one\n"
    assert (manifest(workspace / ".venv"), manifest(workspace / "node_modules")) == trees


@pytest.mark.timeout(240)
def test_confined_run_may_write_below_a_bind_but_not_through_a_symlink_out(workspace, private_tmp, tmp_path):
    decoy = tmp_path / "decoy"
    decoy.mkdir()
    (decoy / "keep").write_text("keep me\n")
    (workspace / "node_modules").mkdir()
    (workspace / "node_modules" / "out").symlink_to(decoy)
    mp = private_tmp / "mnt"
    r = run(workspace, mp, f"{bind_points(mp)}; echo ok > node_modules/inside.js && "
                               "mkdir node_modules/pkg && echo x > node_modules/pkg/a.js; "
                               "echo bad > node_modules/out/pwned; echo rc=$? >&2; echo bad >> node_modules/out/keep; "
                               "rm -f node_modules/out/keep; mkdir node_modules/out/dir; "
                           f"mkdir .venv && echo v > .venv/f && {bind_points(mp)}; exit 0", "--confine")
    assert r.returncode == 0, r.stderr.decode()
    # Before and after the command made .venv (bound as it was made, writable below under Landlock too).
    assert bound(r) == [f"{mp}/node_modules", f"{mp}/node_modules", f"{mp}/.venv"]
    assert (workspace / ".venv/f").read_text() == "v\n"
    assert b"rc=1" in r.stderr and b"Permission denied" in r.stderr
    assert (workspace / "node_modules/inside.js").read_text() == "ok\n"
    assert (workspace / "node_modules/pkg/a.js").read_text() == "x\n"
    assert sorted(p.name for p in decoy.iterdir()) == ["keep"]
    assert (decoy / "keep").read_text() == "keep me\n"


@pytest.mark.timeout(240)
def test_a_reused_mount_shows_other_processes_what_a_run_did_below_its_binds(workspace, mount):
    m = mount(workspace)
    sh(f"{sys.executable} {NPM} node_modules --files 40", m.mountpoint)  # through the daemon: outside any run
    before = sorted(str(p) for p in m.path("node_modules").rglob("*"))
    assert len(before) > 40 and m.path("node_modules/pkg-1/index.js").is_file()
    r = stepfs("run", m.mountpoint, "--", "bash", "-c",
               f"{bind_points(Path(m.mountpoint))}; rm -rf node_modules/pkg-1 && mkdir node_modules/fresh",
               cwd=m.mountpoint, timeout=120)
    assert r.returncode == 0, r.stderr.decode()
    wait_gone(workspace)
    assert bound(r) == [f"{m.mountpoint}/node_modules"]
    # This process's kernel had cached the tree through the daemon; it sees the run's changes at once.
    assert not m.path("node_modules/pkg-1/index.js").exists() and not m.path("node_modules/pkg-1").exists()
    assert m.path("node_modules/fresh").is_dir()
    assert "fresh" in os.listdir(m.path("node_modules"))


@pytest.mark.timeout(240)
def test_a_run_inside_a_run_can_remove_a_bound_tree(workspace, private_tmp):
    (workspace / "node_modules" / "pkg").mkdir(parents=True)
    (workspace / "node_modules" / "pkg" / "index.js").write_text("x\n")
    mp = private_tmp / "mnt"
    inner = private_tmp / "inner.sh"
    inner.write_text(f"{bind_points(mp)}; rm -rf node_modules && test ! -e node_modules\n")
    r = run(workspace, mp, f"{sys.executable} -m stepfs.cli.main run . -- bash {inner}")
    assert r.returncode == 0, r.stderr.decode()
    assert bound(r) == [f"{mp}/node_modules"] and b"go through the mount" not in r.stderr
    assert not (workspace / "node_modules").exists()


#: Runs a command where seccomp(2) fails ENOSYS (installed through prctl, which stays allowed).
NO_SECCOMP = """
import ctypes, os, platform, sys
from stepfs.overlayfs.client import seccomp as s
audit, nr, _calls = s.ARCHES[platform.machine()]
prog = [(s.BPF_LD_W_ABS, 0, 0, s.OFF_ARCH), (s.BPF_JEQ_K, 0, 3, audit), (s.BPF_LD_W_ABS, 0, 0, s.OFF_NR),
        (s.BPF_JEQ_K, 0, 1, nr), (s.BPF_RET_K, 0, 0, 0x00050000 | 38), (s.BPF_RET_K, 0, 0, s.RET_ALLOW)]
table = (s._SockFilter * len(prog))(*[s._SockFilter(*i) for i in prog])
fprog = s._SockFprog(len(prog), table)
libc = ctypes.CDLL(None, use_errno=True)
assert libc.prctl(38, 1, 0, 0, 0) == 0 and libc.prctl(22, 2, ctypes.byref(fprog), 0, 0) == 0
os.execvp(sys.argv[1], sys.argv[1:])
"""


@pytest.mark.timeout(240)
def test_without_seccomp_notification_the_run_says_so_once_and_uses_the_passthrough(workspace, private_tmp):
    (workspace / "node_modules" / "pkg").mkdir(parents=True)
    (workspace / "node_modules" / "pkg" / "index.js").write_text("x\n")
    mp = private_tmp / "mnt"
    r = subprocess.run([sys.executable, "-c", NO_SECCOMP, sys.executable, "-m", "stepfs.cli.main", "run", str(workspace),
                        "--mountpoint", str(mp), "--", "bash", "-c",
                        f"{bind_points(mp)}; mkdir .venv && rm -rf node_modules && test ! -e node_modules"],
                       cwd=workspace, capture_output=True, timeout=120)
    wait_gone(workspace)
    assert mounts.stepfs_mounts(str(workspace)) == []
    assert r.returncode == 0, r.stderr.decode()
    assert bound(r) == []  # the binds made before the filter failed were taken off
    assert r.stderr.decode().count("unversioned trees go through the mount in this run (no seccomp") == 1
    assert not (workspace / "node_modules").exists() and (workspace / ".venv").is_dir()


@contextmanager
def leave_a_process(mp: Path, tmp_path: Path, workspace: Path):
    """The pid of a process a ``stepfs run`` in ``mp`` left behind in its
    namespace; killed on exit, and ``workspace``'s supervisors waited out."""
    pidfile = tmp_path / "bg.pid"
    r = stepfs("run", mp, "--", "bash", "-c",
               f"setsid sleep 300 </dev/null >/dev/null 2>&1 & echo $! > {pidfile}", cwd=mp, timeout=120)
    assert r.returncode == 0, r.stderr.decode()
    bg = int(pidfile.read_text())
    try:
        yield bg
    finally:
        try:
            os.kill(bg, 9)
        except ProcessLookupError:
            pass
        wait_gone(workspace)


@pytest.mark.timeout(240)
def test_unmount_refuses_while_a_run_left_a_process_in_its_namespace_and_force_ends_it(workspace, mount, tmp_path):
    # The run's namespace holds its own copy of the mount: unmounting ours
    # alone would leave the daemon serving the leftover process.
    m = mount(workspace)
    with leave_a_process(m.mountpoint, tmp_path, workspace) as bg:
        r = stepfs("unmount", m.mountpoint)
        assert r.returncode == 9, r.stderr.decode()
        err = r.stderr.decode()
        assert "processes left by 'stepfs run' still use it (pid " in err and str(bg) in err.split("(pid ")[1], err
        assert mounts.find(str(m.mountpoint)) is not None and os.path.exists(f"/proc/{m.pid}")
        r = stepfs("unmount", "--force", m.mountpoint)
        assert r.returncode == 0, r.stderr.decode()
        assert mounts.find(str(m.mountpoint)) is None
        assert not os.path.exists(f"/proc/{m.pid}") or process_state(m.pid) == b"Z"  # exited (our child)


@pytest.mark.timeout(240)
def test_a_run_holds_no_copy_of_another_mount(workspace, mount, tmp_path):
    # unshare copies every mount into the run's namespace: a copy of another
    # workspace's mount would keep its daemon serving and refuse its unmount
    # for as long as anything of this run lives (two agents, two mounts).
    other = tmp_path / "other"
    other.mkdir()
    (other / "x.txt").write_text("x\n")
    a = mount(other)
    m = mount(workspace)
    with leave_a_process(m.mountpoint, tmp_path, workspace) as bg:
        points = [line.split()[4] for line in Path(f"/proc/{bg}/mountinfo").read_text().splitlines()]
        assert str(m.mountpoint) in points and str(a.mountpoint) not in points
        r = stepfs("unmount", a.mountpoint)
        assert r.returncode == 0, r.stderr.decode()
        assert mounts.find(str(a.mountpoint)) is None
