"""fuse-overlayfs as a reference target: a context manager that mounts it
in the foreground as our child (with ``allow_other``, so the permission
cases' unprivileged children can enter), waits for the mount table to show
it, and always unmounts and reaps it."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from stepfs.overlayfs.client import mounts

READY_TIMEOUT = 20.0
EXIT_TIMEOUT = 10.0


def problem() -> str | None:
    if shutil.which("fuse-overlayfs") is None:
        return "fuse-overlayfs is not installed (make deps installs it: docker/install-system-deps.sh)"
    return None


@contextmanager
def fuse_overlayfs(lower: Path, base: Path) -> Iterator[Path]:
    """Mount ``lower`` + an empty upper layer at ``base/mnt``; yields the mountpoint."""
    upper, work, mnt = base / "upper", base / "work", base / "mnt"
    for d in (upper, work, mnt):
        d.mkdir(mode=0o755)
    opts = f"lowerdir={lower},upperdir={upper},workdir={work},allow_other"
    proc = subprocess.Popen(["fuse-overlayfs", "-f", "-o", opts, str(mnt)], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + READY_TIMEOUT
        while mounts.find(str(mnt)) is None:
            if proc.poll() is not None:
                err = proc.stderr.read().decode(errors="replace").strip() if proc.stderr else ""
                raise RuntimeError(f"fuse-overlayfs exited with {proc.returncode} before mounting: {err}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"fuse-overlayfs did not mount {mnt} within {READY_TIMEOUT:.0f} s")
            time.sleep(0.01)
        mnt.chmod(0o755)
        yield mnt
    finally:
        if mounts.find(str(mnt)) is not None:
            if subprocess.run(["fusermount3", "-u", str(mnt)], capture_output=True).returncode != 0:
                subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True)
        try:
            proc.wait(timeout=EXIT_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stderr:
            proc.stderr.close()
