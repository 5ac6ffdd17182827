"""Big files through a real mount: ``dd`` writes are staged by reference to
their scratch file at close (``store/refs.py``).  A SIGKILLed daemon loses
none of them, the remount serves them, ``stepfs verify`` accepts them, a
step puts their bytes into the workspace and a rollback takes them out."""

from __future__ import annotations

import json
import os
import signal
import sqlite3

import pytest

from conftest import sh, stepfs
from stepfs.store import refs

pytestmark = pytest.mark.mount

SIZE = 3 * refs.MIN_SIZE + 4321


@pytest.mark.timeout(90)
def test_dd_big_files_survive_a_killed_daemon_then_step_and_roll_back(workspace, mount, tmp_path):
    old = os.urandom(SIZE)
    (workspace / "old.bin").write_bytes(old)
    new, other = os.urandom(SIZE), os.urandom(SIZE + 1)
    (tmp_path / "new.src").write_bytes(new)
    (tmp_path / "other.src").write_bytes(other)
    m = mount(workspace)
    before = max(r["number"] for r in json.loads(stepfs("log", workspace, "--json").stdout)["layers"])
    sh(f"dd if={tmp_path / 'new.src'} of=new.bin bs=1M status=none"
       f" && dd if={tmp_path / 'other.src'} of=old.bin bs=1M status=none", cwd=m.mountpoint)
    os.kill(m.pid, signal.SIGKILL)
    with pytest.raises(OSError):
        os.stat(m.path("new.bin"))
    assert (workspace / "old.bin").read_bytes() == old and not (workspace / "new.bin").exists()

    db = sqlite3.connect(workspace / ".stepfs" / "store.db")
    staged = dict(db.execute("SELECT path, scratch FROM staged WHERE kind = 'file'").fetchall())
    db.close()
    assert staged.keys() == {b"new.bin", b"old.bin"} and None not in staged.values()  # by reference

    again = mount(workspace, m.mountpoint)
    assert again.path("new.bin").read_bytes() == new
    assert again.path("old.bin").read_bytes() == other
    verified = stepfs("verify", workspace)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    result = stepfs("step", again.mountpoint, "-m", "big files")
    assert result.returncode == 0, result.stderr
    assert (workspace / "new.bin").read_bytes() == new
    assert (workspace / "old.bin").read_bytes() == other
    # The daemon answers a step once the layer is published and removes the
    # imported scratch files just after (committing.py); its control server
    # serves the next request only once that is done.
    assert stepfs("status", again.mountpoint).returncode == 0
    scratch = workspace / ".stepfs" / "scratch"
    assert [p for p in scratch.rglob("*") if p.is_file()] == []  # imported, then removed by the daemon

    head = max(r["number"] for r in json.loads(stepfs("log", workspace, "--json").stdout)["layers"])
    assert head == before + 1
    back = stepfs("rollback", workspace, str(before))
    assert back.returncode == 0, back.stderr
    assert (workspace / "old.bin").read_bytes() == old and not (workspace / "new.bin").exists()
    assert again.path("old.bin").read_bytes() == old and not again.path("new.bin").exists()
