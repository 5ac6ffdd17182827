"""Real-mount tier: a daemon unmounted while its watcher is busy exits
cleanly (issue 18 item 5).  Outside edits keep the watcher invalidating
names the kernel holds (``fuse_invalidate_path``) while the mount goes
away; libfuse tears the session down only after the watcher has stopped.
The autouse ``daemon_crash_check`` reads each daemon's log afterwards."""

from __future__ import annotations

import os
import threading
import time

import pytest

from mountguard import fatal_lines
from stepfs.overlayfs.client import manage
from stepfs.overlayfs.daemon.protocol import log_path

pytestmark = pytest.mark.mount

ROUNDS = 6
NAMES = 40


def _churn(directory, stop: threading.Event) -> int:
    """Edit files in ``directory`` (outside the mount) until ``stop``."""
    n = 0
    while not stop.is_set():
        for i in range(NAMES):
            p = os.path.join(directory, f"f{i}")
            with open(p, "w") as f:
                f.write(str(n))
            n += 1
        for i in range(0, NAMES, 2):
            os.unlink(os.path.join(directory, f"f{i}"))
    return n


@pytest.mark.timeout(300)
def test_unmount_while_the_watcher_invalidates(workspace, mount):
    d = workspace / "d"
    d.mkdir()
    for i in range(NAMES):
        (d / f"f{i}").write_text("start")
    for r in range(ROUNDS):
        m = mount(workspace, workspace.parent / f"mnt-teardown-{r}")
        # The kernel learns every name (so each outside event reaches libfuse).
        for i in range(NAMES):
            os.stat(m.path("d", f"f{i}")) if os.path.exists(m.path("d", f"f{i}")) else None
        stop = threading.Event()
        churn = threading.Thread(target=_churn, args=(str(d), stop))
        churn.start()
        try:
            deadline = time.monotonic() + 0.3  # let events pile up: the watcher is busy at the unmount
            while time.monotonic() < deadline:
                os.listdir(m.path("d"))
            manage.unmount(str(m.mountpoint))
        finally:
            stop.set()
            churn.join()
        log = log_path(str(workspace), str(m.mountpoint))
        assert fatal_lines(__import__("pathlib").Path(log)) == [], open(log).read()[-4000:]
        for i in range(NAMES):
            (d / f"f{i}").write_text("again")
