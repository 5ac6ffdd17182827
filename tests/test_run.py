"""``stepfs run``: mount, run, commit one step, print the card, unmount —
driven end to end through the CLI with real commands."""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import stepfs
from mountguard import mounts_under, private_tmp  # noqa: F401
from stepfs.overlayfs.client import mounts
from stepfs.store import layers
from stepfs.store.workspace import Workspace

pytestmark = pytest.mark.mount


def _last_json(stdout: bytes) -> dict:
    return json.loads(stdout.decode().strip().splitlines()[-1])


def _layers(ws) -> list[layers.Layer]:
    with Workspace.open(str(ws)) as w, w.db.read() as conn:
        return layers.list_layers(conn)


def test_run_commits_one_step_and_unmounts(workspace, private_tmp):
    (workspace / "sub").mkdir()
    (workspace / "sub" / "a.txt").write_text("one\n")
    mp = private_tmp / "agent"  # does not exist: run makes it and removes it again
    r = stepfs("run", workspace, "--json", "--meta", "tool_use_id=toolu_9", "--mountpoint", mp, "--",
               "sh", "-c", 'echo "$PWD" > where.txt; echo two >> a.txt; rm -f ../gone; exit 3',
               cwd=workspace / "sub")
    assert r.returncode == 3, r.stderr
    out = _last_json(r.stdout)
    assert out["message_type"] == "run"
    assert out["exit_code"] == 3 and out["number"] == 1 and out["reused"] is False
    assert out["cwd"] == str(mp / "sub") and out["mountpoint"] == str(mp)
    # The command ran in MOUNT/sub, and its writes reached the workspace only through the commit.
    assert (workspace / "sub" / "where.txt").read_text() == f"{mp}/sub\n"
    assert (workspace / "sub" / "a.txt").read_text() == "one\ntwo\n"
    card = out["card"]
    assert {(f["op"], f["path"]) for f in card["files"]} == {("added", "sub/where.txt"), ("modified", "sub/a.txt")}
    assert card["meta"] == {"exit_code": "3", "tool_use_id": "toolu_9"}
    assert card["message"].startswith("sh -c ")
    assert mounts.stepfs_mounts(str(workspace)) == []
    assert not mp.exists(), "the mountpoint run created was not removed"


def test_run_prints_the_card_and_maps_no_cwd_outside(workspace, private_tmp, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    r = stepfs("run", workspace, "-m", "make notes", "--", "sh", "-c", "pwd > where.txt", cwd=elsewhere)
    assert r.returncode == 0, r.stderr
    text = r.stdout.decode()
    assert "layer 1 (step)" in text and "message: make notes" in text and "added     where.txt" in text
    where = (workspace / "where.txt").read_text().strip()
    assert os.path.basename(where).startswith("stepfs-mnt-") and where.startswith(str(private_tmp))
    assert mounts_under(private_tmp) == [] and os.listdir(private_tmp) == []


def test_run_that_changes_nothing_makes_no_layer(workspace, private_tmp):
    (workspace / "a.txt").write_text("a\n")
    r = stepfs("run", workspace, "--", "cat", "a.txt", cwd=workspace)
    assert r.returncode == 0, r.stderr
    assert r.stdout == b"a\n", "only the command's own output: no card"
    assert b"changed nothing" in r.stderr
    assert [layer.number for layer in _layers(workspace)] == [0]


def test_run_reuses_a_live_mount(workspace, mount, private_tmp):
    m = mount(workspace)
    r = stepfs("run", "--json", "--", "sh", "-c", "echo x > made.txt", cwd=workspace)
    assert r.returncode == 0, r.stderr
    out = _last_json(r.stdout)
    assert out["reused"] is True and out["mountpoint"] == str(m.mountpoint)
    assert out["card"]["mount"] == str(m.mountpoint)
    assert mounts.find(str(m.mountpoint)) is not None, "run unmounted a mount it did not make"
    assert (workspace / "made.txt").read_text() == "x\n"
    # Named by its mountpoint (or started inside it), the same mount is used.
    r = stepfs("run", m.mountpoint, "--json", "--", "sh", "-c", "echo y > made.txt")
    assert _last_json(r.stdout)["reused"] is True
    assert (workspace / "made.txt").read_text() == "y\n"
    # --private mounts afresh even so.
    r = stepfs("run", "--private", "--json", "--", "true", cwd=m.mountpoint)
    out = _last_json(r.stdout)
    assert out["reused"] is False and out["mountpoint"] != str(m.mountpoint)


def test_run_command_not_found_and_usage(workspace, private_tmp):
    r = stepfs("run", workspace, "--", "no-such-command-stepfs")
    assert r.returncode == 127
    assert b"no-such-command-stepfs: command not found" in r.stderr
    assert [layer.number for layer in _layers(workspace)] == [0]
    r = stepfs("run", workspace, "true")
    assert r.returncode == 2 and b"put -- before the command" in r.stderr
    r = stepfs("run", workspace, "--meta", "novalue", "--", "true")
    assert r.returncode == 2 and b"KEY=VALUE" in r.stderr


TRAP = textwrap.dedent("""
    import signal, sys
    got = []
    def handler(signum, frame):
        with open("signals.txt", "a") as f:
            f.write(f"{signum}\\n")
        sys.exit(5)
    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    print("ready", flush=True)
    signal.pause()
""")


def test_run_forwards_sigterm_and_still_commits(workspace, private_tmp):
    (workspace / "trap.py").write_text(TRAP)
    env = dict(os.environ)
    proc = subprocess.Popen([sys.executable, "-m", "stepfs.cli.main", "run", str(workspace), "--json", "--",
                             sys.executable, "trap.py"], cwd=workspace, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout.readline() == b"ready\n"
        proc.send_signal(signal.SIGTERM)  # to stepfs, which passes it on
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 5, err
    result = _last_json(out)
    assert result["signals"] == [signal.SIGTERM] and result["forwarded"] == [signal.SIGTERM]
    assert (workspace / "signals.txt").read_text() == f"{int(signal.SIGTERM)}\n"
    assert result["card"]["meta"]["exit_code"] == "5"
    assert mounts.stepfs_mounts(str(workspace)) == []


def test_run_does_not_double_a_terminal_ctrl_c(workspace, private_tmp):
    """Ctrl-C on a terminal reaches the whole foreground process group: the
    command gets it from the terminal, and stepfs must not send a second one."""
    (workspace / "trap.py").write_text(TRAP)
    env = dict(os.environ)
    pid, fd = pty.fork()
    if pid == 0:  # child: session leader with the pty as controlling terminal
        try:
            # A user at a terminal: Ctrl-C not ignored (pytest run as a
            # script's background job inherits SIGINT ignored, and stepfs
            # rightly keeps an ignored signal ignored).
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.execve(sys.executable, [sys.executable, "-m", "stepfs.cli.main", "run", str(workspace), "--json", "--",
                                       sys.executable, "trap.py"], env)
        finally:
            os._exit(127)
    output = b""
    deadline = time.monotonic() + 60
    sent = False
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 1.0)
            if not ready:
                continue
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # EIO: the other side closed
                break
            if not chunk:
                break
            output += chunk
            if not sent and b"ready" in output:
                os.write(fd, b"\x03")  # the terminal's interrupt character
                sent = True
        _, status = os.waitpid(pid, 0)
    finally:
        os.close(fd)
    assert sent, output
    assert os.waitstatus_to_exitcode(status) == 5, output
    last = output.decode().replace("\r", "").strip().splitlines()[-1]
    result = json.loads(last[last.index("{"):])  # the terminal echoed "^C" before it
    assert result["signals"] == [signal.SIGINT]
    assert result["forwarded"] == []
    assert (workspace / "signals.txt").read_text() == f"{int(signal.SIGINT)}\n"
    assert mounts.stepfs_mounts(str(workspace)) == []
