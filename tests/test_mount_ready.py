"""Real-mount tier for ready files (``store/ready.py``): files an agent writes
through a mount are written into spares by the daemon while it goes on, and
the step renames those very inodes into the workspace."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from conftest import stepfs, wait_for

pytestmark = pytest.mark.mount


def spare_holding(workspace: Path, data: bytes) -> os.stat_result | None:
    """The file of ``.stepfs/spare`` that holds exactly ``data``, if any."""
    spare = workspace / ".stepfs" / "spare"
    for name in os.listdir(spare):
        path = spare / name
        try:
            st = os.lstat(path)
            if st.st_size == len(data) and path.read_bytes() == data:
                return st
        except FileNotFoundError:
            continue
    return None


@pytest.mark.timeout(120)
def test_a_step_renames_the_files_the_daemon_readied_into_place(workspace, mount):
    (workspace / "edit.txt").write_bytes(b"before the agent\n")
    m = mount(workspace)
    spare = workspace / ".stepfs" / "spare"
    wait_for(lambda: spare.is_dir() and len(os.listdir(spare)) >= 8, what="the daemon's spare files")
    files = {"edit.txt": b"edited by the agent\n", "sub/new.py": b"print('made by the agent')\n"}
    m.path("sub").mkdir()
    for name, data in files.items():
        m.path(name).write_bytes(data)
    os.chmod(m.path("sub/new.py"), 0o751)  # after its close: that one is not used, the commit writes it
    wait_for(lambda: all(spare_holding(workspace, d) for d in files.values()), what="both ready files")
    ready = {name: spare_holding(workspace, data) for name, data in files.items()}
    seen = {name: os.stat(m.path(name)) for name in files}
    r = stepfs("step", m.mountpoint, "-m", "agent step")
    assert r.returncode == 0, r.stderr
    for name, data in files.items():
        st = os.lstat(workspace / name)
        assert (workspace / name).read_bytes() == data
        assert (st.st_mode, st.st_mtime_ns) == (seen[name].st_mode, seen[name].st_mtime_ns)
    assert os.lstat(workspace / "edit.txt").st_ino == ready["edit.txt"].st_ino
    assert os.lstat(workspace / "sub/new.py").st_ino != ready["sub/new.py"].st_ino
    assert os.listdir(workspace / ".stepfs" / "tmp") == []
    assert m.path("edit.txt").read_bytes() == files["edit.txt"]
