"""The mount's readahead window (``overlayfs/daemon/libfuse/readahead.py``):
raised after INIT and cut into READs that fit libfuse's splice pipe, so a
sequential reader costs a quarter of the READs, and never written for
anything but a FUSE mount."""

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


def _super_options(mountpoint) -> set[str]:
    """The superblock options of the mount at ``mountpoint`` (mountinfo)."""
    target = os.path.realpath(mountpoint)
    with open("/proc/self/mountinfo") as f:
        for line in f:
            before, _, after = line.partition(" - ")
            if before.split()[4] == target:
                return set(after.split()[2].split(","))
    raise AssertionError(f"{target} is not in mountinfo")


@pytest.mark.timeout(60)
def test_reads_are_cut_to_fit_the_splice_pipe_and_unaligned_reads_stay_exact(workspace, mount):
    data = os.urandom((3 << 20) + 12345)
    (workspace / "big.bin").write_bytes(data)
    m = mount(workspace)
    assert f"max_read={readahead.READ_BYTES}" in _super_options(m.mountpoint)
    with open(m.path("big.bin"), "rb", buffering=0) as f:
        for offset, size in ((0, 3 << 20), (777, 1 << 20), ((3 << 20) - 5, 1 << 20), (len(data) - 3, 10)):
            assert os.pread(f.fileno(), size, offset) == data[offset:offset + size]


def test_a_directory_that_is_not_a_fuse_mount_is_left_alone(tmp_path):
    before = _window(tmp_path)
    assert readahead.set_window(str(tmp_path), before + 4) is False
    assert _window(tmp_path) == before
    assert readahead.set_window(str(tmp_path / "missing")) is False
