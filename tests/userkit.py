"""Run code as an unprivileged user (a real uid, via ``os.setuid`` in a
forked child), for tests of what another user may see or do.

The interpreter of this machine may live where that user cannot read
(``/root/.pyenv``), so the child execs nothing: it runs the code already
imported by the parent.  Callers import what the child needs first.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Callable

import pytest

NOBODY = 65534


def as_user(fn: Callable[[], int], uid: int = NOBODY, gid: int = NOBODY, timeout: float = 60) -> tuple[int, str, str]:
    """``fn()`` in a forked child running as ``uid``/``gid`` (no
    supplementary groups); returns (its return value as an exit status,
    stdout, stderr).  An exception in the child is status 99 with its
    traceback on stderr."""
    import signal
    import time

    out = tempfile.TemporaryFile()
    err = tempfile.TemporaryFile()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 99
        try:
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            # pytest's capture replaced sys.stdout/err with objects of its own
            sys.stdout = open(1, "w", closefd=False)
            sys.stderr = open(2, "w", closefd=False)
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            code = fn()
            code = 0 if code is None else int(code)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 2
        except BaseException:
            traceback.print_exc()
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise TimeoutError(f"the child as uid {uid} did not end within {timeout} s")
        time.sleep(0.01)
    out.seek(0)
    err.seek(0)
    return os.waitstatus_to_exitcode(status), out.read().decode(errors="replace"), err.read().decode(errors="replace")


def cli_as(argv: list, uid: int = NOBODY) -> tuple[int, str, str]:
    """``stepfs ARGV`` (``cli.main.main``) as ``uid``."""
    from stepfs.cli.main import main

    return as_user(lambda: main([str(a) for a in argv]), uid)


@pytest.fixture
def shared_dir():
    """A temp dir another user can reach (pytest's own are 0700 of root)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to act as another user")
    path = tempfile.mkdtemp(prefix="stepfs-shared-")
    os.chmod(path, 0o755)
    try:
        yield Path(path)
    finally:
        shutil.rmtree(path, ignore_errors=True)
