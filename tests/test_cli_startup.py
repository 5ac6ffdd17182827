"""The CLI's start-up stays lean where it can: committing or unmounting a
mount only talks to its daemon, so it must not import the database layer
(SQLAlchemy is most of a start-up: ~115 ms of ~230 ms measured)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import stepfs


def _modules_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys\nprint('\\n'.join(sys.modules))"],
                         capture_output=True, text=True, check=True, env=dict(os.environ))
    return set(out.stdout.split())


def _step_without_database(target: str, message: str) -> subprocess.CompletedProcess:
    """``stepfs step TARGET -m MESSAGE`` in a fresh interpreter that fails
    if the command imported the database layer."""
    code = (
        "import sys\nfrom stepfs.cli.main import main\n"
        f"rc = main(['step', {target!r}, '-m', {message!r}])\n"
        "assert 'sqlalchemy' not in sys.modules, 'the database layer was imported'\n"
        "sys.exit(rc)\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ))


def test_library_for_mount_commands_does_not_import_the_database_layer():
    mods = _modules_after("from stepfs.cli import main\nfrom stepfs.overlayfs.client import manage, control\n"
                          "from stepfs.overlayfs.daemon import protocol")
    assert "sqlalchemy" not in mods
    assert "stepfs.overlayfs.core.view" not in mods and "mfusepy" not in mods
    assert "stepfs.overlayfs.daemon.fuse_ops" not in mods


@pytest.mark.mount
def test_step_of_a_mountpoint_commits_through_the_daemon_alone(mount, workspace):
    m = mount(workspace)
    (m.mountpoint / "new.txt").write_text("hello\n")
    done = _step_without_database(str(m.mountpoint), "lean")
    assert done.returncode == 0, done.stderr
    assert (m.workspace / "new.txt").read_text() == "hello\n"
    log = stepfs("log", str(m.workspace), "--json")
    assert b'"lean"' in log.stdout


@pytest.mark.mount
def test_step_of_a_workspace_with_live_mounts_commits_each_through_its_daemon(mount, workspace, tmp_path):
    a = mount(workspace, tmp_path / "a")
    b = mount(workspace, tmp_path / "b")
    (a.mountpoint / "from_a.txt").write_text("a\n")
    (b.mountpoint / "from_b.txt").write_text("b\n")
    done = _step_without_database(str(workspace), "both")
    assert done.returncode == 0, done.stderr
    assert (workspace / "from_a.txt").read_text() == "a\n"
    assert (workspace / "from_b.txt").read_text() == "b\n"
    assert len(done.stdout.split()) == 2  # two layers, one per mount
    # Nothing left: the same command reports it with its exit code.
    again = stepfs("step", str(workspace))
    assert again.returncode == 6, again.stderr
