"""What a mount's store holds of namespace and metadata changes and of
small files' close-writes, through a real mount (view.py, "Staged rows and
crashes").

The daemon records such changes and writes them at the next
``fsync``/``fsyncdir``, commit, status request or within ``ROW_DELAY``
seconds.  A daemon killed with SIGKILL right after ``fsync`` keeps what was
fsynced, and ``stepfs status`` always lists what the mount shows.
"""

from __future__ import annotations

import os
import signal
import stat as stat_mod
import time

import pytest

from conftest import sh
from stepfs.overlayfs.client import manage
from stepfs.overlayfs.daemon.protocol import daemon_alive

pytestmark = pytest.mark.mount


def _kill(m) -> None:
    """SIGKILL the daemon and wait (bounded) until it is gone: its lock file
    is free once the process has exited, zombie or not."""
    os.kill(m.pid, signal.SIGKILL)
    run_dir = str(m.workspace / ".stepfs" / "run")
    deadline = time.monotonic() + 20
    while daemon_alive(run_dir, str(m.mountpoint)) is not None:
        if time.monotonic() > deadline:
            raise AssertionError(f"daemon {m.pid} survived SIGKILL")
        time.sleep(0.01)


def _staged(target: str) -> dict[str, str]:
    status = manage.status(manage.resolve(target))
    return {s["path"]: s["op"] for m in status["mounts"] for s in m["staged"]}


@pytest.mark.timeout(90)
def test_status_lists_a_metadata_change_made_just_before(workspace, mount):
    (workspace / "base.txt").write_bytes(b"base\n")
    m = mount(workspace)
    sh("mkdir fresh && chmod 600 base.txt && ln -s base.txt link", cwd=m.mountpoint)
    # In-process, right away: the daemon is asked to write what it recorded.
    assert _staged(str(m.mountpoint)) == {"fresh": "A", "base.txt": "M", "link": "A"}


@pytest.mark.timeout(90)
def test_a_killed_daemon_keeps_what_was_fsynced(workspace, mount):
    (workspace / "base.txt").write_bytes(b"base\n")
    (workspace / "old").mkdir()
    m = mount(workspace)
    # chmod + fsync of the file; rename + fsync of the directory (how
    # programs make a name durable); then SIGKILL at once.
    sh("python3 -c \"import os\n"
       "os.chmod('base.txt', 0o600)\n"
       "fd = os.open('base.txt', os.O_RDONLY); os.fsync(fd); os.close(fd)\n"
       "os.rename('old', 'new')\n"
       "fd = os.open('.', os.O_RDONLY | os.O_DIRECTORY); os.fsync(fd); os.close(fd)\"", cwd=m.mountpoint)
    _kill(m)
    again = mount(workspace, m.mountpoint)
    assert stat_mod.S_IMODE(again.path("base.txt").stat().st_mode) == 0o600
    assert again.path("new").is_dir() and not again.path("old").exists()
    assert _staged(str(again.mountpoint)) == {"base.txt": "M", "old": "D", "new": "A"}


@pytest.mark.timeout(90)
def test_a_killed_daemon_keeps_metadata_changes_and_close_writes_followed_by_an_fsync(workspace, mount):
    m = mount(workspace)
    sh("mkdir -p a/b && touch -d @1000000000 a/b && chmod 700 a && printf 'x\\n' > a/b/c.txt "
       "&& printf 'y\\n' > a/d.txt && printf 'yy\\n' > a/d.txt", cwd=m.mountpoint)
    # The close-writes above are recorded, not stored; the fsync of another
    # file writes every recorded row and content (SIGKILL follows at once).
    sh("python3 -c \"import os\n"
       "fd = os.open('a/e.txt', os.O_WRONLY | os.O_CREAT, 0o644); os.write(fd, b'e'); os.fsync(fd); os.close(fd)\"",
       cwd=m.mountpoint)
    _kill(m)
    again = mount(workspace, m.mountpoint)
    assert stat_mod.S_IMODE(again.path("a").stat().st_mode) == 0o700
    assert again.path("a", "b").stat().st_mtime == 1_000_000_000
    assert again.path("a", "b", "c.txt").read_bytes() == b"x\n"
    assert again.path("a", "d.txt").read_bytes() == b"yy\n"
    assert again.path("a", "e.txt").read_bytes() == b"e"
