"""A guard for tests of commands that mount by themselves.

``stepfs run``, the Python API's private mounts and the Docker image's
entry point make their own mounts (that is the feature under test), so they
cannot go through the ``mount`` fixture.  They make them under ``TMPDIR``;
the ``private_tmp`` fixture gives each test its own ``TMPDIR`` and, after
the test, aborts and lazily unmounts any stepfs mount still under it, then
fails the test: a command that mounts must also unmount.

Import the fixture into a test module with
``from mountguard import private_tmp  # noqa: F401``.

:func:`daemon_crashes` reads the logs of every daemon a test started (each
daemon enables ``faulthandler`` on its log): ``conftest``'s autouse
``daemon_crash_check`` fails any test whose daemon died by a fatal signal
(SIGSEGV, SIGBUS, SIGABRT, SIGFPE, SIGILL: faulthandler records each) or
logged a fatal error, even when its assertions passed.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

import pytest

from stepfs.overlayfs.client import manage, mounts


def mounts_under(directory: Path) -> list[str]:
    prefix = str(directory).rstrip("/") + "/"
    return [m.mountpoint for m in mounts.stepfs_mounts() if m.mountpoint.startswith(prefix)]


@pytest.fixture
def private_tmp(tmp_path, monkeypatch) -> Path:
    """``TMPDIR`` (for subprocesses and this process's ``tempfile``) where
    self-mounting commands put their private mountpoints."""
    directory = tmp_path / "private"
    directory.mkdir()
    monkeypatch.setenv("TMPDIR", str(directory))
    monkeypatch.setattr(tempfile, "tempdir", str(directory))
    yield directory
    left = mounts_under(directory)
    for mp in left:
        manage.abort_connection(mp)
        subprocess.run(["fusermount3", "-u", "-z", mp], capture_output=True)
    assert not left, f"a self-mounting command left mounts behind: {left}"


#: What a crashed daemon leaves in its log: CPython's and faulthandler's
#: headers (faulthandler names the signal: "Fatal Python error:
#: Segmentation fault"), its per-thread traceback header, libc's abort.
FATAL_MARKERS = ("Fatal Python error", "Segmentation fault", "Current thread 0x", "Bus error",
                 "Illegal instruction", "Floating point exception", "Aborted (core dumped)")


def fatal_lines(log: Path) -> list[str]:
    """The lines of daemon log ``log`` that record a fatal error."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return []
    return [line for line in text.splitlines() if any(m in line for m in FATAL_MARKERS)]


def daemon_logs(root: Path) -> list[Path]:
    """Every daemon log (``WS/.stepfs/run/*.log``) of the workspaces under
    ``root``; mountpoints still mounted and store internals are not walked."""
    out = []
    for dirpath, dirnames, _files in os.walk(root):
        if ".stepfs" in dirnames:
            run = Path(dirpath, ".stepfs", "run")
            if run.is_dir():
                out += sorted(run.glob("*.log"))
            dirnames.remove(".stepfs")
        dirnames[:] = [d for d in dirnames if not os.path.ismount(os.path.join(dirpath, d))]
    return out


def daemon_crashes(root: Path) -> list[str]:
    """``"<log>: <first fatal line>"`` for each daemon log under ``root``
    that records a crash."""
    out = []
    for log in daemon_logs(root):
        lines = fatal_lines(log)
        if lines:
            out.append(f"{log}: {lines[0]}")
    return out
