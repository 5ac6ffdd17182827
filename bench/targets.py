"""The filesystems under test: stepfs and its references.

Each target turns a prepared *case* (a directory holding ``lower/``, the
workspace content, plus room for ``upper/``, ``work/`` and ``mnt/``) into the
directory a workload runs in:

* ``native``          ``lower/`` itself, no mount;
* ``overlay``         kernel overlayfs (``mount -t overlay``), lower/upper/work;
* ``fuse-overlayfs``  the Debian package, same directories, run in the
                      foreground as our child so its pid is known;
* ``passthrough``     ``bench/passthrough.py`` over ``lower/`` (mfusepy,
                      libfuse3, single-threaded, stepfs's timeouts);
* ``stepfs``          ``overlayfs.manage.mount`` of ``lower/`` as the workspace.

Invariant: :meth:`Target.mounted` unmounts in ``finally`` and waits for its
daemon to exit, whatever happened inside; :data:`LIVE` lists the mounts
currently made by this process so a last-resort sweep (``sweep``) can
detach them if an unmount itself failed.  Nothing here ever touches a mount
it did not make.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from stepfs.overlayfs.client import manage, mounts
from stepfs.overlayfs.daemon import timeouts

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent

READY_TIMEOUT = 30.0
EXIT_TIMEOUT = 30.0

#: mountpoint -> how to detach it lazily, for mounts made and not yet unmounted.
LIVE: dict[str, list[str]] = {}


def stepfs_fuse_options() -> dict[str, float]:
    """The kernel cache timeouts a watching stepfs mount uses
    (``overlayfs/daemon/timeouts.py``, passed by ``fuse_ops.run``), so the passthrough
    reference follows any change there (other work tunes them)."""
    return {"attr_timeout": timeouts.ATTR_TIMEOUT, "entry_timeout": timeouts.ENTRY_TIMEOUT,
            "negative_timeout": timeouts.NEGATIVE_TIMEOUT}


class Target:
    name = ""
    description = ""

    def problem(self) -> str | None:
        """Why this target cannot run on this machine, or None."""
        return None

    @contextmanager
    def mounted(self, case: Path, env: dict | None = None) -> Iterator[Path]:
        raise NotImplementedError


class Native(Target):
    name = "native"
    description = "the directory itself, no mount"

    @contextmanager
    def mounted(self, case: Path, env: dict | None = None) -> Iterator[Path]:
        yield case / "lower"


def _dirs(case: Path) -> tuple[Path, Path, Path, Path]:
    lower, upper, work, mnt = (case / n for n in ("lower", "upper", "work", "mnt"))
    for d in (upper, work, mnt):
        d.mkdir(exist_ok=True)
    return lower, upper, work, mnt


def _wait_mounted(mp: Path, proc: subprocess.Popen | None, what: str) -> None:
    """Poll the mount table (no stat of the mountpoint) until ``mp`` appears."""
    deadline = time.monotonic() + READY_TIMEOUT
    while time.monotonic() < deadline:
        if mounts.find(str(mp)) is not None:
            return
        if proc is not None and proc.poll() is not None:
            err = proc.stderr.read().decode(errors="replace").strip() if proc.stderr else ""
            raise RuntimeError(f"{what} exited with {proc.returncode} before mounting: {err}")
        time.sleep(0.01)
    raise RuntimeError(f"{what} did not mount {mp} within {READY_TIMEOUT:.0f} s")


def _fuse_unmount(mp: Path, proc: subprocess.Popen | None) -> None:
    """``fusermount3 -u``, lazily if busy; then wait for the daemon to exit
    (kill it only if it outlives the timeout)."""
    if mounts.find(str(mp)) is not None:
        result = subprocess.run(["fusermount3", "-u", str(mp)], capture_output=True)
        if result.returncode != 0:
            subprocess.run(["fusermount3", "-u", "-z", str(mp)], capture_output=True)
    if proc is not None:
        try:
            proc.wait(timeout=EXIT_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class KernelOverlay(Target):
    name = "overlay"
    description = "kernel overlayfs (mount -t overlay)"

    def problem(self) -> str | None:
        if os.geteuid() != 0:
            return "mounting kernel overlayfs needs root"
        with open("/proc/filesystems") as f:
            if not any(line.split()[-1] == "overlay" for line in f if line.strip()):
                return "the kernel has no overlay filesystem"
        return None

    @contextmanager
    def mounted(self, case: Path, env: dict | None = None) -> Iterator[Path]:
        lower, upper, work, mnt = _dirs(case)
        opts = f"lowerdir={lower},upperdir={upper},workdir={work}"
        subprocess.run(["mount", "-t", "overlay", "overlay", "-o", opts, str(mnt)], check=True,
                       capture_output=True)
        LIVE[str(mnt)] = ["umount", "-l", str(mnt)]
        try:
            yield mnt
        finally:
            result = subprocess.run(["umount", str(mnt)], capture_output=True)
            if result.returncode != 0:
                subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
            LIVE.pop(str(mnt), None)


class FuseOverlayfs(Target):
    name = "fuse-overlayfs"
    # Its default entry/attribute timeout is 1e9 s (it assumes the lower
    # layers never change), against stepfs's 1 s: warm metadata rows differ
    # mostly by that.
    description = "fuse-overlayfs (Debian package), foreground child, its default timeouts (1e9 s)"

    def problem(self) -> str | None:
        if shutil.which("fuse-overlayfs") is None:
            return "fuse-overlayfs is not installed (run bench/install-deps.sh or make bench)"
        return None

    @contextmanager
    def mounted(self, case: Path, env: dict | None = None) -> Iterator[Path]:
        lower, upper, work, mnt = _dirs(case)
        opts = f"lowerdir={lower},upperdir={upper},workdir={work}"
        with _foreground_fuse(["fuse-overlayfs", "-f", "-o", opts, str(mnt)], mnt, "fuse-overlayfs"):
            yield mnt


@contextmanager
def _foreground_fuse(cmd: list[str], mnt: Path, label: str, env: dict | None = None) -> Iterator[None]:
    """Run a FUSE server in the foreground as our child, wait until it has
    mounted ``mnt``, and always unmount and reap it."""
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env=env)
    LIVE[str(mnt)] = ["fusermount3", "-u", "-z", str(mnt)]
    try:
        _wait_mounted(mnt, proc, label)
        yield
    finally:
        _fuse_unmount(mnt, proc)
        LIVE.pop(str(mnt), None)
        if proc.stderr:
            proc.stderr.close()


class Passthrough(Target):
    name = "passthrough"
    description = "minimal mfusepy passthrough (libfuse3, single-threaded, stepfs timeouts)"

    @contextmanager
    def mounted(self, case: Path, env: dict | None = None) -> Iterator[Path]:
        lower, _upper, _work, mnt = _dirs(case)
        opts = stepfs_fuse_options()
        cmd = [sys.executable, str(BENCH_DIR / "passthrough.py"), str(lower), str(mnt)]
        for key, value in opts.items():
            cmd += [f"--{key.replace('_', '-')}", str(value)]
        with _foreground_fuse(cmd, mnt, "the passthrough", env={**os.environ, "FUSE_LIBRARY_NAME": "fuse3"}):
            yield mnt


class Stepfs(Target):
    name = "stepfs"
    description = "stepfs (overlayfs.manage.mount of lower/ as the workspace)"

    def __init__(self) -> None:
        self.pid: int | None = None  # the daemon of the current mount (for the profiler)

    @contextmanager
    def mounted(self, case: Path, env: dict | None = None) -> Iterator[Path]:
        lower, _upper, _work, mnt = _dirs(case)
        with stepfs_mount(lower, mnt, env) as pid:
            self.pid = pid
            try:
                yield mnt
            finally:
                self.pid = None


@contextmanager
def stepfs_mount(workspace: Path, mnt: Path, env: dict | None = None, **options) -> Iterator[int]:
    """Mount ``workspace`` at ``mnt`` through the library; yields the daemon
    pid.  ``env`` is added to the daemon's environment (e.g. ``STEPFS_GUARD``);
    ``options`` go to ``manage.mount`` (e.g. ``default_excludes=False``)."""
    mnt.mkdir(exist_ok=True)
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        pid = manage.mount(str(workspace), str(mnt), **options)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    LIVE[str(mnt)] = ["fusermount3", "-u", "-z", str(mnt)]
    try:
        yield pid
    finally:
        try:
            manage.unmount(str(mnt))
        except Exception as exc:  # busy or hung: force, and say so
            print(f"bench: unmount of {mnt} failed ({exc}); forcing", file=sys.stderr)
            manage.unmount(str(mnt), force=True)
        LIVE.pop(str(mnt), None)


def sweep(root: Path) -> list[str]:
    """Detach every mount this process made that is still listed (an unmount
    failed), then any mount left below ``root`` (ours by construction).
    Returns the mountpoints detached."""
    done = []
    for mp, cmd in list(LIVE.items()):
        subprocess.run(cmd, capture_output=True)
        LIVE.pop(mp, None)
        done.append(mp)
    prefix = str(root).rstrip("/") + "/"
    for entry in reversed(mounts.table()):
        if entry.mountpoint.startswith(prefix):
            if entry.fstype.startswith("fuse"):
                manage.abort_connection(entry.mountpoint)
                subprocess.run(["fusermount3", "-u", "-z", entry.mountpoint], capture_output=True)
            else:
                subprocess.run(["umount", "-l", entry.mountpoint], capture_output=True)
            done.append(entry.mountpoint)
    return done


ALL: dict[str, type[Target]] = {
    cls.name: cls for cls in (Native, KernelOverlay, FuseOverlayfs, Passthrough, Stepfs)
}
