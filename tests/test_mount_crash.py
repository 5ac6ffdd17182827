"""Crashes and faults through a real mount (the ``mount`` fixture).

* The daemon is SIGKILLed with writers in flight: every client gets ENOTCONN
  and none hangs; ``stepfs mount`` of the same workspace and mountpoint
  cleans up the dead mount, recovers and mounts; the workspace equals the
  last committed layer and the writes closed before the kill are back in the
  open step.
* A flipped byte in a stored object: ``stepfs verify`` names it and exits
  non-zero, and reading the file through the mount fails with EIO and a line
  in the daemon's log.
* The store's disk fills up: the writer's close gets ENOSPC, further writes
  EROFS, reads keep working, and ``stepfs status`` says why.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import sqlite3
import subprocess
import sys

import pytest

from conftest import manifest, sh, stepfs
from crashkit import tmpfs
from stepfs.overlayfs.client import manage
from stepfs.overlayfs.daemon.protocol import log_path
from stepfs.store.objects import xxh3_hex

pytestmark = pytest.mark.mount

# Rewrites one file until the filesystem fails; prints "ready" after the
# first full write, then the errno of the first failure and of one more call.
WRITER = r"""
import os, sys
path = sys.argv[1]
n = 0
try:
    while True:
        with open(path, "wb") as f:
            f.write(os.urandom(1 << 16))
        n += 1
        if n == 1:
            print("ready", flush=True)
except OSError as exc:
    first = exc.errno
try:
    os.listdir(os.path.dirname(path))
    after = 0
except OSError as exc:
    after = exc.errno
print(first, after, flush=True)
"""


@pytest.mark.timeout(90)
def test_a_killed_daemon_fails_clients_with_enotconn_and_remount_recovers(workspace, mount):
    (workspace / "base.txt").write_bytes(b"base\n")
    m = mount(workspace)
    sh("printf 'one\\n' > a.txt && mkdir src && printf 'x = 1\\n' > src/x.py", cwd=m.mountpoint)
    result = stepfs("step", m.mountpoint, "-m", "first")
    assert result.returncode == 0, result.stderr
    committed = manifest(workspace)
    assert committed[b"a.txt"][2] == b"one\n"
    # Closed writes after the last step: staged only.
    sh("printf 'staged\\n' > staged.txt && printf 'changed\\n' > a.txt && rm src/x.py", cwd=m.mountpoint)
    # Small files' close-writes are recorded like metadata changes and
    # stored within ROW_DELAY; a status request stores them at once, so
    # the kill below cannot fall into that window.
    assert stepfs("status", m.mountpoint).returncode == 0

    writers = [
        subprocess.Popen([sys.executable, "-c", WRITER, str(m.path(f"w{i}.bin"))],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(3)
    ]
    try:
        for w in writers:
            assert w.stdout.readline().strip() == "ready", w.stderr.read()
        os.kill(m.pid, signal.SIGKILL)
        for w in writers:
            out, err = w.communicate(timeout=20)  # none hangs
            first, after = map(int, out.split())
            assert first in (errno.ENOTCONN, errno.ECONNABORTED), (first, err)
            assert after == errno.ENOTCONN
    finally:
        for w in writers:
            if w.poll() is None:
                w.kill()
                w.wait()
    with pytest.raises(OSError) as info:
        os.stat(m.path("a.txt"))
    assert info.value.errno == errno.ENOTCONN
    assert manifest(workspace) == committed  # the killed daemon changed nothing on disk

    # The same command a user would run: it must clean up the dead mount first.
    again = mount(workspace, m.mountpoint)
    assert again.pid != m.pid
    assert manifest(workspace) == committed
    assert again.path("staged.txt").read_bytes() == b"staged\n"
    assert again.path("a.txt").read_bytes() == b"changed\n"
    assert not again.path("src", "x.py").exists()
    status = json.loads(stepfs("status", again.mountpoint, "--json").stdout)
    staged = {s["path"]: s["op"] for mnt in status["mounts"] for s in mnt["staged"]}
    assert {"staged.txt": "A", "a.txt": "M", "src/x.py": "D"}.items() <= staged.items()
    result = stepfs("step", again.mountpoint, "-m", "after the crash")
    assert result.returncode == 0, result.stderr
    assert (workspace / "staged.txt").read_bytes() == b"staged\n"
    assert not (workspace / "src" / "x.py").exists()


def test_a_live_mount_is_not_reclaimed(workspace, mount):
    m = mount(workspace)
    result = stepfs("mount", workspace, m.mountpoint)
    assert result.returncode == 4 and "already a stepfs mount" in result.stderr.decode()
    assert m.path(".").is_dir()  # still served


def _flip_stored_bytes(ws, marker: bytes) -> int:
    """Flip one byte inside every stored copy of ``marker`` in the store's
    database file (after a checkpoint), as bit rot would; returns how many."""
    db = ws / ".stepfs" / "store.db"
    conn = sqlite3.connect(db)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    data = bytearray(db.read_bytes())
    hits, pos = 0, data.find(marker)
    while pos >= 0:
        data[pos + len(marker) + 3] ^= 0x20
        hits += 1
        pos = data.find(marker, pos + 1)
    db.write_bytes(bytes(data))
    return hits


@pytest.mark.timeout(90)
def test_a_corrupt_object_is_named_by_verify_and_never_served(workspace, mount):
    (workspace / "fine.txt").write_bytes(b"fine\n")
    m = mount(workspace)
    marker = b"CORRUPT-ME:"
    content = marker + b"0123456789abcdef" * 40
    m.path("victim.bin").write_bytes(content)  # staged: its only copy is the object
    assert stepfs("verify", workspace).returncode == 0
    manage.unmount(str(m.mountpoint))
    assert _flip_stored_bytes(workspace, marker) >= 1

    result = stepfs("verify", workspace)
    assert result.returncode == 15, result.stderr
    out = result.stdout.decode()
    oid = xxh3_hex(content)
    assert f"object {oid}" in out and "corrupt" in out
    assert "problem" in result.stderr.decode()
    as_json = json.loads(stepfs("verify", workspace, "--json").stdout)
    assert as_json["ok"] is False and any(oid in p for p in as_json["problems"])

    again = mount(workspace, m.mountpoint)
    with pytest.raises(OSError) as info:
        again.path("victim.bin").read_bytes()
    assert info.value.errno == errno.EIO
    assert again.path("fine.txt").read_bytes() == b"fine\n"  # the rest is served
    log = open(log_path(str(workspace), str(again.mountpoint)), encoding="utf-8", errors="replace").read()
    assert "victim.bin" in log and "corrupt" in log


@pytest.fixture
def small_fs(tmp_path):
    """A 2 MB tmpfs for a workspace; set up before (so torn down after) the mount."""
    with tmpfs(tmp_path / "small", size="2m") as path:
        yield path


@pytest.mark.timeout(90)
def test_a_full_store_gives_enospc_then_erofs_and_status_says_why(small_fs, mount):
    ws = small_fs / "ws"
    ws.mkdir()
    (ws / "readme.txt").write_bytes(b"readable\n")
    m = mount(ws)
    m.path("staged.txt").write_bytes(b"staged early\n")
    free = os.statvfs(ws).f_bavail * os.statvfs(ws).f_frsize
    (ws / "ballast.bin").write_bytes(b"\0" * (free - 700_000))
    f = open(m.path("huge.bin"), "wb")
    f.write(os.urandom(450_000))  # fits as a scratch copy, not also as an object in the store
    with pytest.raises(OSError) as info:
        f.close()
    assert info.value.errno == errno.ENOSPC
    with pytest.raises(OSError) as info:
        m.path("more.txt").write_bytes(b"x")
    assert info.value.errno == errno.EROFS
    assert m.path("readme.txt").read_bytes() == b"readable\n"
    assert m.path("staged.txt").read_bytes() == b"staged early\n"
    result = stepfs("status", ws)
    assert result.returncode == 0, result.stderr
    assert "read-only: the store" in result.stdout.decode() and "is full" in result.stdout.decode()
    st = json.loads(stepfs("status", m.mountpoint, "--json").stdout)
    assert "is full" in st["mounts"][0]["readonly"]
    assert "read-only" in m.path(".stepfs", "status").read_text()
