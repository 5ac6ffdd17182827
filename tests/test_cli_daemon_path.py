"""The CLI's two ways to answer a read: through a live mount's daemon
(client/reads.py, no database import in the CLI) and straight from the
store (``STEPFS_DIRECT=1``, or no live mount).  The same command must print
the same thing, the same JSON and exit with the same code either way,
errors included: both run one store function, only the process differs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import stepfs

pytestmark = pytest.mark.mount


def _run(*args, direct: bool, input: bytes | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("STEPFS_DIRECT", None)
    if direct:
        env["STEPFS_DIRECT"] = "1"
    return subprocess.run([sys.executable, "-m", "stepfs.cli.main", *map(str, args)], capture_output=True,
                          timeout=60, env=env, input=input)


def _same(*args) -> subprocess.CompletedProcess:
    via_daemon, direct = _run(*args, direct=False), _run(*args, direct=True)
    assert (via_daemon.returncode, via_daemon.stdout, via_daemon.stderr) == \
        (direct.returncode, direct.stdout, direct.stderr), args
    return via_daemon


def test_reads_answer_alike_through_the_daemon_and_from_the_store(mount, workspace):
    (workspace / "kept.txt").write_text("one\ntwo\n")
    m = mount(workspace)
    mp, ws = m.mountpoint, m.workspace
    (mp / "kept.txt").write_text("one\n2\nthree\n")
    (mp / "new.bin").write_bytes(b"\0\1\2")
    assert stepfs("step", mp, "-m", "first", "--meta", "tool_call=1").returncode == 0
    os.symlink("kept.txt", mp / "link")
    (mp / "staged.txt").write_text("staged\n")
    (mp / "dropped.txt").write_text("dropped\n")
    (ws / "dropped.txt").write_text("made outside\n")  # so the staged version lost: a conflict to list
    assert stepfs("discard", mp, "dropped.txt").returncode == 0

    for target in (mp, ws):
        for extra in ((), ("--json",)):
            out = _same("status", target, *extra)
            assert out.returncode == 0 and b"staged.txt" in out.stdout
            assert _same("log", target, *extra).returncode == 0
            assert _same("log", target, "--limit", "1", *extra).returncode == 0
            assert _same("show", target, "1", *extra).returncode == 0  # no patch: store.cardrows when direct
            shown = _same("show", target, "1", "--patch", *extra)
            assert shown.returncode == 0 and b"+three" in shown.stdout
    status = json.loads(_same("status", mp, "--json").stdout)
    assert [s["path"] for s in status["mounts"][0]["staged"]] == ["link", "staged.txt"]
    assert [c["path"] for c in status["conflicts"]] == ["dropped.txt"]

    # Errors: the daemon's domain error crosses the channel as the same
    # sentence and the same exit code.
    assert _same("show", mp, "9").returncode == 11
    assert _same("show", mp, "-1", "--json").returncode == 11
    assert _same("discard", mp, "../outside").returncode == 10
    assert _same("discard", mp, ".stepfs/store.db").returncode == 10
    assert _same("discard", mp, "not-staged.txt").stdout == b"nothing staged at those paths\n"
    assert _same("status", str(ws.parent / "no-such-workspace")).returncode == 3
    assert _same("log", mp, "--limit", "x").returncode == 2


def test_discard_through_the_daemon_drops_what_the_direct_path_drops(mount, workspace):
    m = mount(workspace)
    for name in ("a.txt", "b.txt"):
        (m.mountpoint / name).write_text("x\n")
    via_daemon = _run("discard", m.mountpoint, "a.txt", "--json", direct=False)
    direct = _run("discard", m.mountpoint, str(m.mountpoint / "b.txt"), "--json", direct=True)
    assert via_daemon.returncode == direct.returncode == 0, (via_daemon.stderr, direct.stderr)
    assert json.loads(via_daemon.stdout)["discarded"] == ["a.txt"]
    assert json.loads(direct.stdout)["discarded"] == ["b.txt"]
    assert not (m.mountpoint / "a.txt").exists() and not (m.mountpoint / "b.txt").exists()
