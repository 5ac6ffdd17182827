"""Run only by ``test_daemon_crash_check.py`` (a pytest inside a pytest; the
name keeps it out of normal collection): tests whose assertions pass while
their daemon is killed with SIGSEGV.  Each must be reported as failed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from mountguard import private_tmp  # noqa: F401

pytestmark = pytest.mark.mount


def test_the_mount_fixtures_daemon_segfaults(workspace, mount):
    m = mount(workspace)
    m.path("f").write_text("x")
    os.kill(m.pid, signal.SIGSEGV)  # the real daemon, a real signal
    _pid, status = os.waitpid(m.pid, 0)  # this process started it (manage.mount)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGSEGV


def test_a_self_mounting_commands_daemon_segfaults(workspace, private_tmp):  # noqa: F811
    """``stepfs run`` mounts privately (under TMPDIR); the agent kills the
    daemon serving it."""
    script = ("import os, signal\n"
              "from stepfs.overlayfs.client import mounts\n"
              "from stepfs.overlayfs.daemon.protocol import daemon_alive\n"
              "e = mounts.find(os.getcwd())\n"
              "os.kill(daemon_alive(os.path.join(e.workspace, '.stepfs', 'run'), e.mountpoint), signal.SIGSEGV)\n")
    subprocess.run([sys.executable, "-m", "stepfs.cli.main", "run", str(workspace), "--", sys.executable, "-c", script],
                   capture_output=True, timeout=60)
