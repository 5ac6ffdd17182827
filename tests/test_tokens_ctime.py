"""Which devices may skip the racy-window hash (``tokens.learn_fine_ctime``),
tried on a real file system whose timestamps are whole seconds: an ext4
image with 128-byte inodes, loop-mounted (needs root, as the real-mount
tier does).  There a same-size rewrite in the same second keeps the stat
token, so the probe must refuse the device, and the hash is what catches
the rewrite."""

from __future__ import annotations

import os
import subprocess

import pytest

from stepfs.overlayfs.core.errors import Stale
from stepfs.overlayfs.core.view import Overlay
from stepfs.store import tokens
from stepfs.store.workspace import Workspace

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def coarse_fs(tmp_path):
    """A directory on an 8 MiB ext4 whose inodes hold timestamps in seconds."""
    image, mnt = tmp_path / "coarse.img", tmp_path / "coarse"
    with open(image, "wb") as f:
        f.truncate(8 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-I", "128", str(image)], check=True, capture_output=True)
    mnt.mkdir()
    subprocess.run(["mount", "-o", "loop", str(image), str(mnt)], check=True, capture_output=True)
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@pytest.fixture
def coarse_view(coarse_fs, monkeypatch):
    monkeypatch.setattr(tokens, "FINE_CTIME_DEVICES", set())
    root = coarse_fs / "ws"
    root.mkdir()
    (root / "x").write_bytes(b"version one\n")
    ws = Workspace.open(str(root), create=True)
    view = Overlay(ws, "/mnt/coarse")
    try:
        yield ws, view
    finally:
        view.close()
        ws.close()


def _read_then_rewrite(ws: Workspace, view: Overlay) -> str:
    """Agent a reads x, then an editor rewrites it right away with the same
    size; the token a recorded."""
    fh = view.open("/x", os.O_RDONLY, agent="a")
    try:
        before = view.read(fh, 100, 0)
    finally:
        view.release(fh)
    with open(os.path.join(ws.path, "x"), "r+b") as f:
        f.write(before.swapcase())
    return view.observed["a"]["/x"]


def test_the_probe_refuses_a_file_system_with_timestamps_in_seconds(coarse_fs, monkeypatch):
    monkeypatch.setattr(tokens, "FINE_CTIME_DEVICES", set())  # nothing proven earlier in this process
    assert tokens.fs_type(os.stat(coarse_fs).st_dev) == "ext4"  # on the list: the probe itself decides
    assert not tokens.learn_fine_ctime(str(coarse_fs))
    assert os.stat(coarse_fs).st_dev not in tokens.FINE_CTIME_DEVICES
    assert os.listdir(coarse_fs) == ["lost+found"]  # the probe's file had no name


def test_there_the_hash_catches_a_same_second_rewrite(coarse_view):
    ws, view = coarse_view
    assert not tokens.learn_fine_ctime(ws.tmp_dir)
    seen = _read_then_rewrite(ws, view)
    assert tokens.HASH_SEP in seen
    with pytest.raises(Stale):
        view.open("/x", os.O_WRONLY, agent="a")


def test_a_device_trusted_without_proof_would_miss_it(coarse_view):
    """What the probe protects: trusting this device by hand, the same
    rewrite keeps the token and the stale writer is let through."""
    ws, view = coarse_view
    tokens.FINE_CTIME_DEVICES.add(os.stat(ws.path).st_dev)
    for _ in range(10):
        seen = _read_then_rewrite(ws, view)
        assert tokens.HASH_SEP not in seen
        if seen == view.record_token("/x"):
            break  # the rewrite kept the token (else it crossed a second: again)
    else:
        pytest.fail("10 rewrites right after a read each moved a token whose times are whole seconds")
    fh = view.open("/x", os.O_WRONLY, agent="a")  # not stale: the lost update the hash prevents
    view.release(fh)


def test_a_full_file_system_is_not_proven_and_stops_nothing(tmp_path, monkeypatch):
    """The probe's one-byte writes fail with ENOSPC on a full tmpfs (a file
    system it would otherwise prove): not proven, and no error for the
    daemon starting."""
    monkeypatch.setattr(tokens, "FINE_CTIME_DEVICES", set())  # a tmpfs device number may be reused
    full = tmp_path / "full"
    full.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(full)], check=True, capture_output=True)
    try:
        fd = os.open(full / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            while True:
                os.write(fd, b"\0" * 4096)
        except OSError:
            pass
        finally:
            os.close(fd)
        assert tokens.fs_type(os.stat(full).st_dev) == "tmpfs"
        assert not tokens.learn_fine_ctime(str(full))
        assert os.stat(full).st_dev not in tokens.FINE_CTIME_DEVICES
    finally:
        subprocess.run(["umount", str(full)], capture_output=True)
