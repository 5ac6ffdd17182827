"""The shared history through the ``stepfs`` command (exit codes, --json)
and through two real mounts of two workspaces sharing one PostgreSQL
history (tests/pgserver.py starts the server; tests/conftest.py mounts)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import manifest, stepfs
from mountguard import private_tmp  # noqa: F401

from stepfs.store.workspace import Workspace
from store_kit import Stager


def _ok(result) -> dict | str:
    assert result.returncode == 0, result.stderr.decode()
    out = result.stdout.decode()
    return json.loads(out) if out.startswith("{") else out


def _workspace(root: Path, files: dict[str, bytes]) -> Path:
    root.mkdir()
    for rel, data in files.items():
        (root / rel).write_bytes(data)
    Workspace.open(str(root), create=True).close()
    return root


def _stage(ws: Path, files: dict[str, bytes]) -> None:
    with Workspace.open(str(ws)) as w:
        st = Stager(w)
        for rel, data in files.items():
            st.file(rel, data)


def test_cli_sync_clone_step_log_show_and_exit_codes(pg_server, pg_url, tmp_path):
    a = _workspace(tmp_path / "a", {"app.py": b"v0\n"})
    none = stepfs("log", "--history", pg_url)
    assert none.returncode == 20 and "does not exist" in none.stderr.decode()
    res = _ok(stepfs("sync", a, "--history", pg_url, "--json"))
    assert res["head"] == 0 and res["published"] == []
    res = _ok(stepfs("clone", pg_url, tmp_path / "b", "--json"))
    b = Path(res["workspace"])
    assert res["layer"] == 0 and manifest(b) == manifest(a)
    _stage(a, {"app.py": b"from a\n"})
    res = _ok(stepfs("step", a, "-m", "a edits", "--json"))  # attached: publishes without --history
    assert res["published"][0]["shared"] == 1
    _stage(b, {"app.py": b"from b\n"})
    refused = stepfs("step", b, "-m", "b edits", "--json")
    assert refused.returncode == 7, refused.stderr.decode()
    err = refused.stderr.decode()
    assert "app.py" in err and "shared layer 1" in err and "nothing was written" in err
    assert (b / "app.py").read_bytes() == b"v0\n"
    log = _ok(stepfs("log", "--history", pg_url, "--json"))
    assert [r["number"] for r in log["layers"]] == [1, 0]
    assert log["layers"][0]["workspace_path"] == str(a) and log["layers"][0]["host"]
    assert log["layers"][0]["modified"] == 1
    text = _ok(stepfs("log", "--history", pg_url))
    assert "a edits" in text and str(a) in text
    show = _ok(stepfs("show", "1", "--history", pg_url, "--json"))
    assert show["files"] == [{"path": "app.py", "op": "modified", "before_kind": "file", "after_kind": "file"}]
    missing = stepfs("show", "9", "--history", pg_url)
    assert missing.returncode == 11, missing.stderr.decode()
    res = _ok(stepfs("verify-history", "--history", pg_url, "--json"))
    assert res["ok"] is True and res["message_type"] == "verify-history"
    pg_server.stop()
    try:
        down = stepfs("sync", a)
        assert down.returncode == 19, down.stderr.decode()
        assert "cannot be reached" in down.stderr.decode() and down.stderr.decode().count("\n") == 1
        assert "nothing was published" in down.stderr.decode()
        # A command that publishes no step is told to run again, not to sync.
        for args in (("log", "--history", pg_url), ("show", "1", "--history", pg_url),
                     ("prune", "--history", pg_url, "--keep-last", "1"), ("clone", pg_url, tmp_path / "c")):
            down = stepfs(*args)
            err = down.stderr.decode()
            assert down.returncode == 19, (args, err)
            assert err.count("\n") == 1 and "run the same command again" in err and "published" not in err, (args, err)
    finally:
        pg_server.start()
    bad = stepfs("log", "--history", "postgresql://me@/db")
    assert bad.returncode == 20 and "?name=NAME" in bad.stderr.decode()
    exists = stepfs("clone", pg_url, a)
    assert exists.returncode == 3


@pytest.mark.mount
def test_two_mounts_of_two_workspaces_share_one_history(pg_url, mount, tmp_path):
    a = _workspace(tmp_path / "a", {"common.txt": b"base\n"})
    _ok(stepfs("sync", a, "--history", pg_url))
    b = Path(_ok(stepfs("clone", pg_url, tmp_path / "b", "--json"))["workspace"])
    ma, mb = mount(a), mount(b)
    (ma.mountpoint / "from_a.txt").write_bytes(b"A\n")
    (mb.mountpoint / "from_b.txt").write_bytes(b"B\n")
    assert _ok(stepfs("step", ma.mountpoint, "-m", "a", "--json"))["published"][0]["shared"] == 1
    res = _ok(stepfs("step", mb.mountpoint, "-m", "b", "--json"))
    assert [p["shared"] for p in res["pulled"]] == [1] and res["published"][0]["shared"] == 2
    assert (mb.mountpoint / "from_a.txt").read_bytes() == b"A\n"  # the live mount sees the pulled file
    _ok(stepfs("sync", ma.mountpoint))
    assert (ma.mountpoint / "from_b.txt").read_bytes() == b"B\n"
    assert manifest(a) == manifest(b)
    # Both mounts edit one path: the second step is refused and writes nothing.
    (ma.mountpoint / "common.txt").write_bytes(b"a's\n")
    (mb.mountpoint / "common.txt").write_bytes(b"b's\n")
    _ok(stepfs("step", ma.mountpoint, "-m", "a again"))
    refused = stepfs("step", mb.mountpoint, "-m", "b again")
    assert refused.returncode == 7, refused.stderr.decode()
    assert (b / "common.txt").read_bytes() == b"base\n"
    assert (mb.mountpoint / "common.txt").read_bytes() == b"b's\n"  # b's own edit is still staged in its mount
    # b gives its edit up and takes a's.
    _ok(stepfs("discard", mb.mountpoint, "common.txt"))
    _ok(stepfs("sync", mb.mountpoint))
    assert (mb.mountpoint / "common.txt").read_bytes() == b"a's\n"
    assert os.path.exists(b / ".stepfs" / "history.json")


def test_sync_with_a_url_makes_a_plain_directory_a_workspace_and_the_history(pg_url, tmp_path):
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "a.txt").write_bytes(b"a\n")
    res = _ok(stepfs("sync", plain, "--history", pg_url, "--json"))
    assert res["head"] == 0
    clone = Path(_ok(stepfs("clone", pg_url, tmp_path / "c", "--json"))["workspace"])
    assert manifest(clone) == manifest(plain)
    other = tmp_path / "other"
    other.mkdir()
    refused = stepfs("sync", other, "--history", pg_url)  # the history exists: a second tree cannot join it
    assert refused.returncode == 20 and "clone" in refused.stderr.decode()
    assert os.listdir(other) == []  # refused before anything was made there
    assert stepfs("sync", tmp_path / "nothing-here").returncode == 3


def test_the_shared_agent_script_parses():
    import subprocess

    script = Path(__file__).resolve().parent.parent / "docker" / "shared-agent.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0


@pytest.mark.mount
def test_mount_with_history_attaches_and_steps_publish(pg_url, tmp_path, private_tmp):
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "first.txt").write_bytes(b"1\n")
    mp = private_tmp / "mnt"
    mp.mkdir()
    env_url = {"STEPFS_HISTORY": pg_url}
    mounted = stepfs_env(env_url, "mount", ws, mp)
    assert mounted.returncode == 0, mounted.stderr.decode()
    try:
        (mp / "second.txt").write_bytes(b"2\n")
        res = _ok(stepfs("step", mp, "-m", "through the mount", "--json"))  # attached: no URL needed now
        assert res["published"] == [{"local": res["numbers"][0], "shared": 1}]
    finally:
        _ok(stepfs("unmount", mp))
    clone = Path(_ok(stepfs("clone", pg_url, tmp_path / "c", "--json"))["workspace"])
    assert manifest(clone) == manifest(ws)
    assert _ok(stepfs("show", "1", "--history", pg_url, "--json"))["message"] == "through the mount"


def stepfs_env(extra: dict, *args) -> "subprocess.CompletedProcess":
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "stepfs.cli.main", *map(str, args)], capture_output=True,
                          timeout=120, env={**os.environ, **extra})
