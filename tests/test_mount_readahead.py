"""The mount's readahead window (``overlayfs/daemon/libfuse/readahead.py``):
raised after INIT so a sequential reader costs a quarter of the READs, and
never written for anything but a FUSE mount."""

from __future__ import annotations

import hashlib
import os
import time

import pytest

from stepfs.overlayfs.daemon.libfuse import readahead

pytestmark = pytest.mark.mount


def _window(path) -> int:
    dev = os.stat(path).st_dev
    with open(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb") as f:
        return int(f.read())


@pytest.mark.timeout(60)
def test_a_mount_reads_ahead_in_larger_windows_and_serves_the_same_bytes(workspace, mount):
    data = os.urandom(8 << 20)
    (workspace / "big.bin").write_bytes(data)
    m = mount(workspace)
    deadline = time.monotonic() + 20  # a side thread writes it just after INIT
    while _window(m.mountpoint) != readahead.WINDOW_KIB and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _window(m.mountpoint) == readahead.WINDOW_KIB
    with open(m.path("big.bin"), "rb") as f:
        h = hashlib.sha256()
        while chunk := f.read(1 << 20):
            h.update(chunk)
    assert h.digest() == hashlib.sha256(data).digest()


def test_a_directory_that_is_not_a_fuse_mount_is_left_alone(tmp_path):
    before = _window(tmp_path)
    assert readahead.set_window(str(tmp_path), before + 4) is False
    assert _window(tmp_path) == before
    assert readahead.set_window(str(tmp_path / "missing")) is False
