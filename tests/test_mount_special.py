"""Real-mount tier: device nodes, sockets and hard-linked symlinks made by
real programs in the mount are committed with their kind, device number and
inode sharing, and a rollback brings them back the same way (run as root:
making a device node needs CAP_MKNOD)."""

from __future__ import annotations

import json
import os
import stat
import sys

import pytest

from conftest import sh, stepfs

pytestmark = pytest.mark.mount

# A server bound to "sock" in the current directory (AF_UNIX paths are
# limited to 108 bytes, so relative to the mount) that a client reaches.
SOCKET_ROUNDTRIP = """
import socket
srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
srv.bind("sock")
srv.listen(1)
cli = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
cli.connect("sock")
conn, _ = srv.accept()
cli.sendall(b"through-the-socket")
print(conn.recv(100).decode())
"""


def check_tree(root, null_rdev: int) -> None:
    """The device, the socket and the two names of one symlink under ``root``."""
    st = os.lstat(root / "null")
    assert stat.S_ISCHR(st.st_mode) and st.st_rdev == null_rdev and stat.S_IMODE(st.st_mode) == 0o620
    assert stat.S_ISSOCK(os.lstat(root / "sock").st_mode)
    a, b = os.lstat(root / "ln"), os.lstat(root / "ln2")
    assert stat.S_ISLNK(b.st_mode) and os.readlink(root / "ln2") == "target.txt"
    assert a.st_ino == b.st_ino and a.st_nlink == b.st_nlink == 2


def test_device_socket_and_linked_symlink_commit_and_roll_back(workspace, mount):
    null_rdev = os.stat("/dev/null").st_rdev
    (workspace / "target.txt").write_text("t\n")
    m = mount(workspace)
    sh(f"mknod -m 620 null c {os.major(null_rdev)} {os.minor(null_rdev)}", m.mountpoint)
    out = sh(f"{sys.executable} -c '{SOCKET_ROUNDTRIP}'", m.mountpoint)
    assert out.stdout.strip() == b"through-the-socket"
    sh("ln -s target.txt ln && ln -P ln ln2", m.mountpoint)
    listing = sh("ls -l", m.mountpoint).stdout.decode()
    assert any(line.startswith("s") and line.endswith(" sock") for line in listing.splitlines()), listing
    assert any(line.startswith("c") and line.endswith(" null") for line in listing.splitlines()), listing
    check_tree(m.mountpoint, null_rdev)
    assert not os.path.lexists(workspace / "null"), "the workspace was touched before the step"

    made = stepfs("step", m.mountpoint, "-m", "special files", "--json")
    assert made.returncode == 0, made.stderr
    check_tree(workspace, null_rdev)
    check_tree(m.mountpoint, null_rdev)

    sh("rm null sock ln ln2", m.mountpoint)
    assert stepfs("step", m.mountpoint, "-m", "remove them").returncode == 0
    assert not any(os.path.lexists(workspace / n) for n in ("null", "sock", "ln", "ln2"))

    back = stepfs("rollback", m.mountpoint, str(json.loads(made.stdout)["number"]))
    assert back.returncode == 0, back.stderr
    check_tree(workspace, null_rdev)
    check_tree(m.mountpoint, null_rdev)  # the live mount sees the rollback

