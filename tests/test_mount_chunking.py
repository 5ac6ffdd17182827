"""Real-mount tier: an edited big file shares its unchanged chunks with the
version before (content-defined chunking), end to end through the mount,
``stepfs step``, ``cat`` and ``verify``."""

from __future__ import annotations

import random
import sqlite3

import pytest

from conftest import sh, stepfs

pytestmark = pytest.mark.mount


def _chunk_bytes(workspace) -> int:
    """Bytes of all stored chunks (read-only, beside the live daemon: WAL)."""
    conn = sqlite3.connect(f"file:{workspace / '.stepfs' / 'store.db'}?mode=ro", uri=True)
    try:
        return conn.execute("SELECT coalesce(sum(size), 0) FROM chunks").fetchone()[0]
    finally:
        conn.close()


def _text(lines: int) -> bytes:
    rng = random.Random(8)
    words = ["def", "return", "self", "value", "import", "for", "in", "if", "name", "data"]
    return "".join(f"{i:7d} " + " ".join(rng.choice(words) for _ in range(15)) + "\n"
                   for i in range(lines)).encode()


def test_a_one_line_edit_of_a_committed_big_file_stores_little(workspace, mount, tmp_path):
    original = _text(140_000)  # ~11 MB: more than one read window of a put
    assert len(original) > 10_000_000
    (tmp_path / "big.txt").write_bytes(original)
    m = mount(workspace)
    sh(f"cp {tmp_path / 'big.txt'} big.txt", m.mountpoint)
    assert stepfs("step", m.mountpoint, "-m", "add").returncode == 0
    before = _chunk_bytes(workspace)
    assert before >= len(original) // 2  # stored (text shares some chunks with itself)

    sh("sed -i '60000s/^/inserted words /' big.txt", m.mountpoint)
    assert stepfs("step", m.mountpoint, "-m", "edit").returncode == 0

    lines = original.split(b"\n")
    lines[59999] = b"inserted words " + lines[59999]
    edited = b"\n".join(lines)
    assert (workspace / "big.txt").read_bytes() == edited
    added = _chunk_bytes(workspace) - before
    assert 0 < added < 1_000_000, added
    assert stepfs("cat", workspace, "1", "big.txt").stdout == original
    assert stepfs("cat", workspace, "2", "big.txt").stdout == edited
    verify = stepfs("verify", workspace)
    assert verify.returncode == 0, verify.stdout + verify.stderr
