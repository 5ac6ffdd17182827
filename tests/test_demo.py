"""``make demo``'s script, run as a user runs it: it must exit 0 and leave no
mount behind (it once failed one run in two on a closed pipe, and nothing
else ran it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

pytestmark = pytest.mark.mount


def _mounted(path: Path) -> bool:
    with open("/proc/mounts") as f:
        return any(line.split()[1] == str(path) for line in f)


@pytest.mark.timeout(240)
def test_the_demo_runs_to_the_end_and_leaves_no_mount(tmp_path):
    stepfs_bin = Path(sys.executable).parent / "stepfs"
    assert stepfs_bin.exists(), f"{stepfs_bin} is missing: install the project (pip install -e .) to run this test"
    work = tmp_path / "demo"
    mnt = work / "agent"
    try:
        result = subprocess.run(["bash", str(ROOT / "scripts" / "demo.sh")], capture_output=True, timeout=180,
                                env={**os.environ, "STEPFS_BIN": str(stepfs_bin), "STEPFS_DEMO_DIR": str(work)})
    finally:
        if _mounted(mnt):  # the script's own trap did not run: abort, then unmount
            from stepfs.overlayfs.client import manage

            manage.abort_connection(str(mnt))
            subprocess.run([str(stepfs_bin), "unmount", "--force", str(mnt)], capture_output=True, timeout=60)
    out = result.stdout.decode(errors="replace")
    assert result.returncode == 0, out[-2000:] + result.stderr.decode(errors="replace")
    assert "demo finished: no mount left" in out
    assert not _mounted(mnt)
    # Both steps reached the workspace on disk.
    ws = work / "project"
    assert (ws / "documentation" / "notes.txt").read_text() == "old notes\nmore notes\n"
    assert not (ws / "TODO").exists()
    assert (ws / ".git").is_dir()
