"""Real-mount tier: small drafts live in memory (``overlayfs/core/content.py``,
``MEMORY_DRAFT_MAX``), and real programs cannot tell: files created,
appended to across the memory bound, mapped, read back after their close,
and committed byte for byte."""

from __future__ import annotations

import pytest

from conftest import manifest, sh, stepfs

pytestmark = pytest.mark.mount

# Crosses overlayfs.content.MEMORY_DRAFT_MAX (256 KiB) while two descriptors,
# one of them O_APPEND, and a shared mapping are open on the file.
GROW = r"""
import mmap, os
with open("grow.bin", "wb") as f:
    f.write(b"a" * 200_000)
    f.flush()
    app = open("grow.bin", "ab")
    rd = open("grow.bin", "rb")
    m = mmap.mmap(rd.fileno(), 0, prot=mmap.PROT_READ)
    assert m[:3] == b"aaa"
    f.write(b"b" * 100_000)
    f.flush()
    app.write(b"END")
    app.close()
    f.seek(0)
    f.write(b"A")
    f.flush()
    rd.seek(0)
    data = rd.read()
    assert data == b"A" + b"a" * 199_999 + b"b" * 100_000 + b"END", len(data)
    m.close()
    rd.close()
print(os.stat("grow.bin").st_size)
"""


@pytest.mark.timeout(120)
def test_small_files_and_a_file_growing_past_the_memory_bound(workspace, mount):
    m = mount(workspace)
    sh("mkdir -p pkg/lib && for i in $(seq 1 200); do echo \"module $i\" > pkg/lib/m$i.js; done", m.mountpoint)
    sh("for i in $(seq 1 200); do echo more >> pkg/lib/m$i.js; done", m.mountpoint)
    out = sh("cat pkg/lib/m7.js pkg/lib/m200.js && python3 -c \"$GROW_SCRIPT\"", m.mountpoint,
             env={"GROW_SCRIPT": GROW})
    assert out.stdout == b"module 7\nmore\nmodule 200\nmore\n300003\n"
    assert sh("sha256sum pkg/lib/*.js | wc -l", m.mountpoint).stdout.strip() == b"200"
    view = manifest(m.mountpoint)
    result = stepfs("step", m.mountpoint, "-m", "memory drafts")
    assert result.returncode == 0, result.stderr
    assert manifest(workspace) == view
    assert (workspace / "grow.bin").stat().st_size == 300_003
