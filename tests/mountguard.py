"""A guard for tests of commands that mount by themselves.

``stepfs run``, the Python API's private mounts and the Docker image's
entry point make their own mounts (that is the feature under test), so they
cannot go through the ``mount`` fixture.  They make them under ``TMPDIR``;
the ``private_tmp`` fixture gives each test its own ``TMPDIR`` and, after
the test, aborts and lazily unmounts any stepfs mount still under it, then
fails the test: a command that mounts must also unmount.

Import the fixture into a test module with
``from mountguard import private_tmp  # noqa: F401``.
"""

from __future__ import annotations

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
