"""Shared fixtures.  The real-mount tier goes through :func:`mount` only.

Rules for every test that mounts (see README "Tests"):

* one fixture mounts, waits until the mount is ready, and always unmounts in
  ``finally`` (then waits for the daemon to exit);
* a watchdog aborts the FUSE connection (fusectl ``abort``) shortly before
  pytest-timeout fires: a deadlocked daemon leaves clients in uninterruptible
  sleep that no signal ends, and only an abort turns that into ENOTCONN;
* a session-start sweep removes stale stepfs mounts under the temp directory
  whose daemons are dead (live mounts of other test runs are left alone).
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# The tests import the installed ``stepfs`` (``make venv``), never the
# checkout's folders as top-level packages: with the checkout off sys.path
# (``python -m pytest`` puts the working directory there), a stray
# ``import store`` fails instead of loading a second copy of the store.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT]

from stepfs.overlayfs.client import manage, mounts  # noqa: E402
from stepfs.overlayfs.daemon.protocol import daemon_alive  # noqa: E402
from pgserver import history_url, pg_server, pg_url  # noqa: E402,F401  (shared-history fixtures)
from agentprocs import agents  # noqa: E402,F401  (processes that are a mount's agents)

#: Seconds before pytest-timeout at which the watchdog aborts a test's mounts.
WATCHDOG_MARGIN = 10

#: Skips a test of the kernel's multigrain timestamps (store/tokens.py's
#: ctime proof) on a kernel that has none: they came with Linux 6.13.
needs_multigrain = pytest.mark.skipif(
    tuple(int(x) for x in os.uname().release.split("-")[0].split(".")[:2]) < (6, 13),
    reason="multigrain timestamps came with Linux 6.13")


def wait_for(cond, timeout: float = 30.0, what: str = "condition"):
    """Poll ``cond()`` until it is true (returned) or ``timeout`` seconds
    passed (the test fails): a test waits for a condition, never a fixed time."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.02)


def fuse_problem() -> str | None:
    """Why real mounts cannot run here, or None."""
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse does not exist (load the fuse module or run with --device /dev/fuse)"
    if shutil.which("fusermount3") is None:
        return "fusermount3 is missing (install Debian's fuse3 package: make deps)"
    if os.geteuid() != 0:
        return "the real-mount tier runs as root"
    return None


def _stale(entry: mounts.MountEntry) -> bool:
    run_dir = os.path.join(entry.workspace, ".stepfs", "run")
    if os.path.isdir(run_dir) and daemon_alive(run_dir, entry.mountpoint):
        return False
    try:
        os.stat(entry.mountpoint)
    except OSError as exc:
        return exc.errno in (errno.ENOTCONN, errno.ECONNABORTED, errno.EIO)
    return True


def sweep_stale_mounts() -> list[str]:
    swept = []
    tmp = os.path.realpath(tempfile.gettempdir())
    for entry in mounts.stepfs_mounts():
        if entry.mountpoint.startswith(tmp + "/") and _stale(entry):
            manage.abort_connection(entry.mountpoint)
            subprocess.run(["fusermount3", "-u", "-z", entry.mountpoint], capture_output=True)
            swept.append(entry.mountpoint)
    return swept


def pytest_sessionstart(session):
    if fuse_problem() is None:
        swept = sweep_stale_mounts()
        if swept:
            print(f"\nswept {len(swept)} stale stepfs mount(s): {swept}")


@dataclass
class Mounted:
    workspace: Path
    mountpoint: Path
    pid: int

    def path(self, *parts: str) -> Path:
        return self.mountpoint.joinpath(*parts)


def _test_timeout(request) -> float:
    marker = request.node.get_closest_marker("timeout")
    if marker and marker.args:
        return float(marker.args[0])
    return float(request.config.getini("timeout") or 120)


@pytest.fixture(autouse=True)
def daemon_crash_check(request):
    """Fail a test whose daemon crashed (a fatal signal, a fatal error in
    its log: ``mountguard.daemon_crashes``), whatever its assertions said.
    Every daemon a test starts keeps its log in its workspace, under the
    test's ``tmp_path``: the mount fixture's, ``private_tmp``'s
    (``stepfs run``, the Python API, the Docker entry point) and the CLI's.
    Torn down after them (autouse: set up first), so after the unmounts."""
    tmp = request.getfixturevalue("tmp_path") if "tmp_path" in request.fixturenames else None
    yield
    if tmp is not None:
        from mountguard import daemon_crashes

        crashed = daemon_crashes(tmp)
        if crashed:
            pytest.fail("a mount daemon of this test crashed:\n  " + "\n  ".join(crashed), pytrace=False)


@pytest.fixture
def mount(request, tmp_path):
    """Factory: ``mount(workspace, mountpoint=None) -> Mounted``.  Every mount
    made through it is unmounted after the test, whatever happened."""
    problem = fuse_problem()
    if problem:
        pytest.fail(f"REAL-MOUNT TEST CANNOT RUN: {problem}", pytrace=False)
    made: list[Mounted] = []
    aborted = threading.Event()

    def watchdog() -> None:
        aborted.set()
        for m in made:
            manage.abort_connection(str(m.mountpoint))

    timer = threading.Timer(max(5.0, _test_timeout(request) - WATCHDOG_MARGIN), watchdog)
    timer.daemon = True
    timer.start()

    def _mount(workspace: Path, mountpoint: Path | None = None, **options) -> Mounted:
        """``options`` go to ``manage.mount`` (``require_read``, ``auto_step``)."""
        mp = mountpoint or tmp_path / f"mnt{len(made)}"
        try:
            mp.mkdir()
        except FileExistsError:
            # Also a dead mount, whose stat fails with ENOTCONN (pathlib's
            # exist_ok would re-raise then); manage.mount reclaims it.
            pass
        pid = manage.mount(str(workspace), str(mp), **options)
        m = Mounted(Path(workspace), mp, pid)
        made.append(m)
        return m

    try:
        yield _mount
    finally:
        timer.cancel()
        for m in reversed(made):
            if mounts.find(str(m.mountpoint)) is None:
                continue
            try:
                manage.unmount(str(m.mountpoint))
            except Exception:
                manage.unmount(str(m.mountpoint), force=True)
        if aborted.is_set():
            pytest.fail("the watchdog aborted this test's FUSE connection: the daemon hung", pytrace=False)


@pytest.fixture
def workspace(tmp_path) -> Path:
    ws = tmp_path / "ws"
    ws.mkdir()
    return ws


@pytest.fixture
def mnt(workspace, mount) -> Mounted:
    """A workspace (empty unless the test fills it first) mounted once."""
    return mount(workspace)


def stepfs(*args: str, cwd: str | Path | None = None, input: bytes | None = None,
           timeout: float = 60) -> subprocess.CompletedProcess:
    """Run the ``stepfs`` CLI as a user would (a separate process)."""
    env = dict(os.environ)
    return subprocess.run(
        [sys.executable, "-m", "stepfs.cli.main", *map(str, args)], cwd=cwd, input=input, capture_output=True,
        timeout=timeout, env=env,
    )


def sh(cmd: str, cwd: str | Path, timeout: float = 60, check: bool = True, env: dict | None = None
       ) -> subprocess.CompletedProcess:
    """Run a shell command (a real program in the mount)."""
    result = subprocess.run(["bash", "-c", cmd], cwd=cwd, capture_output=True, timeout=timeout,
                            env={**os.environ, **(env or {})})
    if check and result.returncode != 0:
        raise AssertionError(
            f"{cmd!r} exited {result.returncode}\nstdout: {result.stdout.decode(errors='replace')}\n"
            f"stderr: {result.stderr.decode(errors='replace')}"
        )
    return result


def manifest(root: Path) -> dict[bytes, tuple]:
    """``{relative path: (kind, mode, bytes or link target)}`` of a tree,
    excluding the store: the equality tests compare trees with this."""
    out: dict[bytes, tuple] = {}
    base = os.fsencode(str(root))
    for dirpath, dirnames, filenames in os.walk(base):
        rel_dir = os.path.relpath(dirpath, base)
        if rel_dir == b".":
            dirnames[:] = [d for d in dirnames if d != b".stepfs"]
        for name in dirnames + filenames:
            full = os.path.join(dirpath, name)
            rel = os.path.normpath(os.path.join(rel_dir, name))
            st = os.lstat(full)
            if os.path.islink(full):
                out[rel] = ("symlink", None, os.readlink(full))
            elif os.path.isdir(full):
                out[rel] = ("dir", st.st_mode & 0o7777, None)
            else:
                with open(full, "rb") as f:
                    out[rel] = ("file", st.st_mode & 0o7777, f.read())
    return out
