"""History through a real mount: the ``.stepfs/layers`` tree read by real
programs, and a rollback that a process inside the mount sees at once."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys

import pytest

from conftest import manifest, sh
from stepfs.overlayfs.client import manage

pytestmark = pytest.mark.mount


def test_layers_tree_in_a_mount(workspace, mount):
    (workspace / "README").write_text("before the mount\n")
    m = mount(workspace)
    target = manage.Target(str(workspace), str(m.mountpoint))
    sh("mkdir -p src && printf 'v1\\n' > src/app.py && ln -s src/app.py link && chmod 600 README", m.mountpoint)
    (n1,) = manage.step(target, message="one")
    snap1 = manifest(workspace)
    sh("printf 'v2\\n' >> src/app.py && rm README && mv src lib", m.mountpoint)
    (n2,) = manage.step(target, message="two")

    layers = m.path(".stepfs", "layers")
    assert ".stepfs" not in os.listdir(m.mountpoint)
    assert sorted(os.listdir(layers)) == sorted(["0", str(n1), str(n2), "latest"])
    assert os.readlink(layers / "latest") == str(n2)
    assert manifest(layers / str(n1)) == snap1
    assert manifest(layers / "latest") == manifest(workspace)
    assert sh(f"cat .stepfs/layers/{n1}/src/app.py", m.mountpoint).stdout == b"v1\n"
    assert sh(f"cat .stepfs/layers/{n1}/link", m.mountpoint).stdout == b"v1\n"  # the kernel follows the link
    assert sh("cat .stepfs/layers/0/README", m.mountpoint).stdout == b"before the mount\n"
    listing = sh(f"tar -C .stepfs/layers/{n1} -cf - . | tar -tf - | sort", m.mountpoint).stdout.decode().split()
    assert listing == ["./", "./README", "./link", "./src/", "./src/app.py"]

    f = layers / str(n1) / "src" / "app.py"
    for change in (lambda: open(f, "a"), lambda: os.unlink(f), lambda: os.mkdir(layers / str(n1) / "d"),
                   lambda: os.rename(f, layers / str(n1) / "x"), lambda: os.chmod(f, 0o777),
                   lambda: os.truncate(f, 0), lambda: open(layers / str(n1) / "new", "w")):
        with pytest.raises(OSError) as err:
            change()
        assert err.value.errno == errno.EROFS
    r = sh(f"echo x > .stepfs/layers/{n1}/README", m.mountpoint, check=False)
    assert r.returncode != 0 and b"Read-only file system" in r.stderr


WATCHER = r"""
import json, os, sys
def look(stat_first):
    # Kernel caches that could hide a stale attribute are avoided on
    # purpose: a read invalidates the cached atime (so a stat after a read
    # asks the daemon again), and a listing (READDIRPLUS) refreshes the
    # children's attributes.  So before: read, then stat (attributes cached
    # for 1 s), then list; after: stat first, then read, then list.
    out = {}
    for name in ("app.py", "added.txt", "gone.txt"):
        try:
            if stat_first:
                size = os.stat(name).st_size
            with open(name, "rb") as f:
                data = f.read().decode()
            if not stat_first:
                size = os.stat(name).st_size
            out[name] = [size, data]
        except FileNotFoundError:
            out[name] = None
    out["kind"] = oct(os.stat("kind").st_mode & 0o170000)
    out["names"] = sorted(os.listdir("."))
    return out
print(json.dumps(look(False)), flush=True)
sys.stdin.readline()
print(json.dumps(look(True)), flush=True)
"""


def test_rollback_is_seen_at_once_by_a_process_in_the_mount(workspace, mount):
    m = mount(workspace)
    target = manage.Target(str(workspace), str(m.mountpoint))
    sh("printf 'short\\n' > app.py && printf 'bye\\n' > gone.txt && touch kind", m.mountpoint)
    (n1,) = manage.step(target, message="one")
    sh("printf 'a much longer line than before\\n' >> app.py && rm gone.txt && printf 'new\\n' > added.txt"
       " && rm kind && mkdir kind", m.mountpoint)
    (n2,) = manage.step(target, message="two")
    sh("printf 'staged, not committed\\n' > staged.txt", m.mountpoint)

    proc = subprocess.Popen([sys.executable, "-c", WATCHER], cwd=m.mountpoint, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        before = json.loads(proc.stdout.readline())  # listed, stat'ed and read: the kernel caches all that
        assert before["app.py"][1] == "short\na much longer line than before\n"
        assert before["gone.txt"] is None and before["added.txt"] == [4, "new\n"]

        # In-process (no CLI start-up), so this returns well within the 1 s
        # attribute timeout: without invalidation the stat below is stale.
        res = manage.rollback(manage.Target(str(workspace)), n1)
        # The mount's staged file was committed first (through its daemon), then rolled back too.
        assert res["committed_first"] == [n2 + 1] and res["layer"] == n2 + 2
        assert res["invalidated"] == [str(m.mountpoint)]

        proc.stdin.write("go\n")
        proc.stdin.flush()
        after = json.loads(proc.stdout.readline())
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
    assert after["app.py"] == [6, "short\n"]
    assert after["gone.txt"] == [4, "bye\n"]
    assert after["added.txt"] is None
    assert before["names"] == ["added.txt", "app.py", "kind", "staged.txt"]
    assert after["names"] == ["app.py", "gone.txt", "kind"]
    # A name whose kind changed (directory -> file) is not bound to its old inode.
    assert before["kind"] == oct(0o040000) and after["kind"] == oct(0o100000)
    assert sh(f"cat .stepfs/layers/{n2 + 1}/staged.txt", m.mountpoint).stdout == b"staged, not committed\n"
    # The mount keeps working on the rolled-back state, and the rollback is undoable.
    sh("printf 'again\\n' >> app.py", m.mountpoint)
    (n5,) = manage.step(target, message="after rollback")
    assert (workspace / "app.py").read_bytes() == b"short\nagain\n"
    undo = manage.rollback(manage.Target(str(workspace)), n2 + 1)
    assert undo["layer"] == n5 + 1
    assert sh("cat app.py added.txt staged.txt", m.mountpoint).stdout == (
        b"short\na much longer line than before\nnew\nstaged, not committed\n")
