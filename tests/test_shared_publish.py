"""Every layer a mount of an attached workspace commits reaches the shared
history, whoever triggered the commit: the daemon's auto-steps (published by
a ``stepfs sync`` the daemon starts, overlayfs/daemon/publisher.py),
``stepfs run --history URL``, and the API's steps; a server that is down
leaves the local layer committed and published later (real PostgreSQL:
tests/pgserver.py; real mounts: tests/conftest.py)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from conftest import manifest, stepfs
from test_shared_cli import _ok, _stage, _workspace, stepfs_env

from stepfs.store.shared.remote import Remote
from stepfs.store.shared.url import parse


def _shared_layers(url: str) -> list:
    with Remote.open(parse(url)) as remote:
        return remote.layers()


def _wait(what: str, check, deadline_s: float = 60.0):
    """Poll (bounded) for a condition the daemon's background sync makes true."""
    end = time.monotonic() + deadline_s
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > end:
            raise AssertionError(f"{what}: not within {deadline_s} s")
        time.sleep(0.2)


def _status_with(mp: Path, text: str) -> str | None:
    status = (mp / ".stepfs" / "status").read_text()
    return status if text in status else None


def _local_head(ws: Path) -> int:
    return _ok(stepfs("log", ws, "--json", "--limit", "1"))["layers"][0]["number"]


@pytest.mark.mount
def test_auto_steps_are_published_and_a_down_server_publishes_them_later(pg_server, pg_url, mount, tmp_path):
    a = _workspace(tmp_path / "a", {"base.txt": b"base\n"})
    _ok(stepfs("sync", a, "--history", pg_url))  # attached before the mount: the daemon finds it per commit
    mp = mount(a, auto_step="close").mountpoint
    (mp / "one.txt").write_bytes(b"1\n")
    first = _wait("the auto step in the shared history", lambda: [r for r in _shared_layers(pg_url)
                                                                 if r.number == 1])
    assert first[0].message == "auto step" and first[0].meta.get("auto_step") == "1"
    assert first[0].workspace_path == str(a)
    # The server goes away: the next auto step commits here and waits to be published.
    pg_server.stop()
    try:
        before = _local_head(a)
        (mp / "two.txt").write_bytes(b"2\n")
        _wait("the local auto step", lambda: _local_head(a) > before)
        assert (a / "two.txt").read_bytes() == b"2\n"
        status = _wait("the publish error in the mount's status", lambda: _status_with(mp, "cannot be reached"))
        assert "last error (shared history)" in status
    finally:
        pg_server.start()
    # The daemon's retry publishes it once the server is back; nothing is lost.
    _wait("the retried publish", lambda: len(_shared_layers(pg_url)) == 3, deadline_s=90)
    assert _shared_layers(pg_url)[2].message == "auto step"
    _wait("the cleared error", lambda: "last error" not in (mp / ".stepfs" / "status").read_text())
    clone = Path(_ok(stepfs("clone", pg_url, tmp_path / "c", "--json"))["workspace"])
    assert manifest(clone) == manifest(a)


@pytest.mark.mount
def test_auto_step_that_conflicts_is_reported_not_published(pg_url, mount, tmp_path):
    a = _workspace(tmp_path / "a", {"same.txt": b"base\n"})
    _ok(stepfs("sync", a, "--history", pg_url))
    b = Path(_ok(stepfs("clone", pg_url, tmp_path / "b", "--json"))["workspace"])
    _stage(b, {"same.txt": b"b's\n"})
    _ok(stepfs("step", b, "-m", "b first"))
    mp = mount(a, auto_step="close").mountpoint
    (mp / "same.txt").write_bytes(b"a's\n")
    status = _wait("the conflict in the mount's status", lambda: _status_with(mp, "shared layer 1"))
    assert "same.txt" in status and "nothing was written" in status
    assert [r.number for r in _shared_layers(pg_url)] == [0, 1]  # a's layer stays unpublished
    assert (a / "same.txt").read_bytes() == b"a's\n"  # and committed here


def test_run_with_history_attaches_runs_and_publishes(pg_server, pg_url, tmp_path):
    ws = _workspace(tmp_path / "ws", {"a.txt": b"a\n"})
    cmd = [sys.executable, "-c", "open('made.txt', 'w').write('by run\\n')"]
    res = _ok(stepfs("run", ws, "--history", pg_url, "--json", "-m", "run turn", "--", *cmd, cwd=ws))
    assert res["exit_code"] == 0 and res["number"] is not None
    shared = _shared_layers(pg_url)
    assert [r.message for r in shared] == [f"workspace {ws} attached", "run turn"]
    assert shared[1].origin == res["number"]
    # Attached now: a run without the URL publishes too; with the server down
    # the layer is committed here (exit 19, said so) and the next sync publishes it.
    pg_server.stop()
    try:
        down = stepfs("run", ws, "-m", "offline turn", "--", sys.executable, "-c",
                      "open('later.txt', 'w').write('x\\n')", cwd=ws)
        err = down.stderr.decode()
        assert down.returncode == 19, err
        assert "committed as layer" in err and "not published" in err and "not committed" not in err
        assert (ws / "later.txt").read_bytes() == b"x\n"
    finally:
        pg_server.start()
    res = _ok(stepfs("sync", ws, "--json"))
    assert [p["shared"] for p in res["published"]] == [2]
    assert _shared_layers(pg_url)[2].message == "offline turn"


def test_run_with_history_in_the_environment_makes_a_plain_directory_the_history(pg_url, tmp_path):
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "x.txt").write_bytes(b"x\n")
    done = stepfs_env({"STEPFS_HISTORY": pg_url}, "run", plain, "--json", "--", sys.executable, "-c",
                      "open('y.txt', 'w').write('y\\n')")
    assert done.returncode == 0, done.stderr.decode()
    assert json.loads(done.stdout)["number"] == 1
    clone = Path(_ok(stepfs("clone", pg_url, tmp_path / "c", "--json"))["workspace"])
    assert manifest(clone) == manifest(plain)
    assert os.path.exists(plain / ".stepfs" / "history.json")


def test_api_steps_of_an_attached_workspace_publish(pg_url, tmp_path):
    from stepfs.api import WorkspaceClient  # the harnesses' entry point

    ws = _workspace(tmp_path / "ws", {"a.txt": b"a\n"})
    _ok(stepfs("sync", ws, "--history", pg_url))
    _stage(ws, {"a.txt": b"through the API\n"})
    numbers = WorkspaceClient(str(ws)).step("api step")
    assert numbers and [r.message for r in _shared_layers(pg_url)][-1] == "api step"
