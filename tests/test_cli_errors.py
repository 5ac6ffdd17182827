"""End-to-end CLI: bad input gets one sentence, a distinct exit code, and
touches nothing."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys

import pytest

from stepfs.cli import exitcodes
from conftest import manifest, stepfs
from stepfs.store import errors


def _code(cls) -> int:
    return dict(exitcodes.CODES)[cls]


def _one_sentence(result) -> str:
    err = result.stderr.decode()
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("stepfs: ")
    return lines[0]


def test_exit_codes_are_distinct():
    codes = [code for _cls, code in exitcodes.CODES]
    assert len(codes) == len(set(codes))
    assert exitcodes.UNEXPECTED not in codes and exitcodes.USAGE not in codes


def test_mount_missing_workspace(tmp_path):
    (tmp_path / "mnt").mkdir()
    r = stepfs("mount", tmp_path / "nope", tmp_path / "mnt")
    assert r.returncode == _code(errors.WorkspaceError)
    assert "does not exist" in _one_sentence(r)


def test_mount_workspace_not_a_directory(tmp_path):
    (tmp_path / "file").write_text("x")
    (tmp_path / "mnt").mkdir()
    r = stepfs("mount", tmp_path / "file", tmp_path / "mnt")
    assert r.returncode == _code(errors.WorkspaceError)
    assert "not a directory" in _one_sentence(r)


@pytest.mark.parametrize("case", ["missing", "file", "nonempty", "inside"])
def test_mount_bad_mountpoint_touches_nothing(tmp_path, case):
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "a").write_text("a")
    mp = {"missing": tmp_path / "nope", "file": tmp_path / "f", "nonempty": tmp_path / "full",
          "inside": ws / "sub"}[case]
    if case == "file":
        mp.write_text("x")
    if case == "nonempty":
        mp.mkdir()
        (mp / "x").write_text("x")
    if case == "inside":
        mp.mkdir()
    before = manifest(ws)
    r = stepfs("mount", ws, mp)
    assert r.returncode == _code(errors.MountpointError)
    _one_sentence(r)
    assert manifest(ws) == before
    assert not (ws / ".stepfs").exists(), "a refused mount created a store"


def test_newer_store_format_is_refused(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    from stepfs.store.workspace import Workspace

    Workspace.open(str(ws), create=True).close()
    db = sqlite3.connect(ws / ".stepfs" / "store.db")
    db.execute("UPDATE meta SET value='999' WHERE key='format_version'")
    db.commit()
    db.close()
    (tmp_path / "mnt").mkdir()
    for args in (("log", ws), ("status", ws), ("mount", ws, tmp_path / "mnt")):
        r = stepfs(*args)
        assert r.returncode == _code(errors.StoreFormatError), args
        assert "newer stepfs" in _one_sentence(r)


def test_foreign_store_is_refused(tmp_path):
    ws = tmp_path / "ws"
    (ws / ".stepfs").mkdir(parents=True)
    (ws / ".stepfs" / "store.db").write_bytes(b"this is not sqlite at all" * 100)
    r = stepfs("log", ws)
    assert r.returncode == _code(errors.StoreFormatError)
    assert "not a stepfs store" in _one_sentence(r)


@pytest.mark.parametrize("command", ["step", "status", "log"])
def test_commands_on_a_non_workspace(tmp_path, command):
    r = stepfs(command, tmp_path)
    assert r.returncode == _code(errors.WorkspaceError)
    assert "not in a stepfs workspace" in _one_sentence(r)


def test_unmount_of_something_else(tmp_path):
    r = stepfs("unmount", tmp_path)
    assert r.returncode == _code(errors.NotMountedError)
    assert "is not a stepfs mount" in _one_sentence(r)


def test_empty_step_refused_unless_allowed(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    from stepfs.store.workspace import Workspace

    Workspace.open(str(ws), create=True).close()
    r = stepfs("step", ws)
    assert r.returncode == _code(errors.NothingToCommit)
    assert "nothing to commit" in _one_sentence(r)
    r = stepfs("step", ws, "--allow-empty", "-m", "marker", "--json")
    assert r.returncode == 0, r.stderr
    assert b'"number": 1' in r.stdout


def test_json_error_object_on_stderr(tmp_path):
    r = stepfs("log", tmp_path, "--json")
    assert r.returncode == _code(errors.WorkspaceError)
    assert b'"message_type": "error"' in r.stderr


def test_cat_refuses_paths_outside(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    from stepfs.store.workspace import Workspace

    Workspace.open(str(ws), create=True).close()
    for bad in ("../etc/passwd", "/etc/passwd", ".stepfs/store.db"):
        r = stepfs("cat", ws, "0", bad)
        assert r.returncode == _code(errors.ContainmentError), bad
        _one_sentence(r)


def test_a_reader_that_goes_away_ends_the_command_quietly(tmp_path):
    """`stepfs log | head` when head has exited: no "internal error", no
    traceback, the SIGPIPE exit status a shell shows for git or cat."""
    ws = tmp_path / "ws"
    ws.mkdir()
    from stepfs.store.workspace import Workspace

    Workspace.open(str(ws), create=True).close()
    r, w = os.pipe()
    os.close(r)  # the reader is gone before the first write: EPIPE for certain
    try:
        result = subprocess.run([sys.executable, "-m", "stepfs.cli.main", "log", str(ws)], stdout=w,
                                stderr=subprocess.PIPE, timeout=60,
                                env=dict(os.environ))
    finally:
        os.close(w)
    assert result.returncode == exitcodes.OUTPUT_CLOSED, result.stderr
    assert result.stderr == b""
