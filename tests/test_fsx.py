"""Real-mount tier: random-operation data integrity (conformance/fsx.py, in
the manner of fsx) in a stepfs mount with steps committed in between, the
same against fuse-overlayfs for reference, and fio's own verifier.

Knobs for longer runs: ``STEPFS_FSX_OPS`` (operations of the small-file
runs, default 3000), ``STEPFS_FSX_SEED`` (default 1), e.g.
``STEPFS_FSX_OPS=200000 STEPFS_FSX_SEED=7 pytest tests/test_fsx.py``.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from conformance import fuse_overlay
from conformance.fsx import Fsx
from stepfs.overlayfs.client import manage

pytestmark = pytest.mark.mount

OPS = int(os.environ.get("STEPFS_FSX_OPS", "3000"))
SEED = int(os.environ.get("STEPFS_FSX_SEED", "1"))


def _report(capsys, label: str, ex: Fsx, extra: str = "") -> None:
    with capsys.disabled():
        print(f"\nfsx {label}: {ex.ops_done} operations (seed {ex.seed}){extra}: the file matched the model "
              f"throughout ({', '.join(f'{k} {v}' for k, v in ex.counts.items())})")


def _stepping(m, workspace, commits: list[int]):
    """A checkpoint that commits a step and compares the committed workspace
    file with the model: alternately with the file closed, and with it open
    after an fsync (the descriptor then goes on writing over its own commit)."""
    target = manage.resolve(str(m.mountpoint))

    def checkpoint(ex: Fsx) -> None:
        closed = len(commits) % 2 == 0
        if closed:
            ex.close()
        else:
            os.fsync(ex.fd)
        commits.extend(manage.step(target, message=f"fsx op {ex.ops_done}", allow_empty=True))
        ex.check_file(str(workspace / "f"))
        if closed:
            ex.fd = os.open(ex.path, os.O_RDWR)

    return checkpoint


def _run_in_stepfs(workspace, mount, capsys, label: str, ops: int, every: int, **sizes) -> None:
    m = mount(workspace)
    commits: list[int] = []
    ex = Fsx(str(m.path("f")), SEED, **sizes)
    try:
        ex.run(ops, every=every, checkpoint=_stepping(m, workspace, commits))
    finally:
        ex.close()
    manage.step(manage.resolve(str(m.mountpoint)), message="fsx end", allow_empty=True)
    ex.check_file(str(workspace / "f"))
    ex.check_file(str(m.path("f")))
    assert len(commits) == ops // every and commits == sorted(commits)
    _report(capsys, label, ex, f", {len(commits)} steps committed in between")


def test_fsx_small_file_with_steps(workspace, mount, capsys):
    _run_in_stepfs(workspace, mount, capsys, "stepfs", OPS, every=250)


def test_fsx_file_across_chunks_with_steps(workspace, mount, capsys):
    # Up to 3 MiB: objects of several 1 MiB chunks, holes across chunk ends.
    _run_in_stepfs(workspace, mount, capsys, "stepfs 3 MiB", max(OPS // 10, 100), every=100,
                   max_size=3 << 20, max_len=320 << 10)


def test_fsx_fuse_overlayfs_reference(tmp_path, capsys):
    problem = fuse_overlay.problem()
    if problem:
        pytest.fail(f"REFERENCE TARGET MISSING: {problem}", pytrace=False)
    lower = tmp_path / "lower"
    lower.mkdir()
    with fuse_overlay.fuse_overlayfs(lower, tmp_path) as mnt:
        ex = Fsx(str(mnt / "f"), SEED)

        def checkpoint(ex: Fsx) -> None:  # the upper layer holds what fsync made durable
            os.fsync(ex.fd)
            ex.check_file(str(tmp_path / "upper" / "f"))

        try:
            ex.run(OPS, every=250, checkpoint=checkpoint)
        finally:
            ex.close()
    _report(capsys, "fuse-overlayfs", ex)


FIO_JOB = ["--name=stepfs", "--size=8M", "--bs=4k", "--rw=randwrite", "--verify=crc32c", "--ioengine=psync",
           "--verify_fatal=1", "--randseed=7", "--minimal", "--verify_state_save=0"]


def test_fio_random_writes_verify_in_mount_and_after_commit(workspace, mount):
    if shutil.which("fio") is None:
        pytest.fail("fio is missing (make deps installs it: docker/install-system-deps.sh)", pytrace=False)
    m = mount(workspace)
    # Writes and verifies (reads back every block's crc32c) through the mount.
    run = subprocess.run(["fio", f"--filename={m.path('fio.dat')}", *FIO_JOB], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    manage.step(manage.resolve(str(m.mountpoint)), message="fio")
    # The committed file verifies too; and the verifier is not vacuous.
    check = ["fio", f"--filename={workspace / 'fio.dat'}", "--verify_only", *FIO_JOB]
    run = subprocess.run(check, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    with open(workspace / "fio.dat", "r+b") as f:
        f.seek(4096 * 100 + 200)
        f.write(b"corrupt!")
    run = subprocess.run(check, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "verify failed" in run.stderr


def test_fsx_detects_a_file_that_differs_from_its_model(tmp_path):
    """The exerciser is not vacuous: bytes changed behind its back are found."""
    from conformance.fsx import FsxFailure

    ex = Fsx(str(tmp_path / "f"), SEED)
    try:
        ex.run(200)
        if not ex.model:
            ex.op_write()
        os.pwrite(ex.fd, bytes([ex.model[0] ^ 0xFF]), 0)
        with pytest.raises(FsxFailure, match="differ from the model at byte 0"):
            ex.check_file()
    finally:
        ex.close()
