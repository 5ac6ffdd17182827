"""Real-mount tier for version tokens (issue 3): real processes, each its own
agent through ``STEPFS_AGENT`` in its environment, coordinated with pipes.

What real tools see when they lose the compare-and-swap (S8; asserted below):

| tool | how it loses | what it reports | exit |
|---|---|---|---|
| Python ``open(p, "w")`` ... ``close()`` | another agent closed first | ``OSError(116, 'Stale file handle')`` from ``close()`` | - |
| ``cp SRC DST`` | another agent closed DST first | ``cp: failed to close 'DST': Stale file handle`` | 1 |
| ``sh -c 'cat SRC > f'`` | another agent closed f first | ``cat: write error: Stale file handle`` (coreutils check ``close(stdout)``) | 1 |
| ``sh -c 'echo x > f'`` | f changed since this agent read it | ``sh: 1: cannot create f: Stale file handle`` (refused at open) | 2 |
| ``sh``/``bash -c '{ read l; echo "$l"; ...; } > f'`` | another agent closed f first | nothing: the shell closes the redirection and drops the error; ``MOUNT/.stepfs/status`` records it | 0 |
| ``sed -i ... f`` | never: it reads the current version and replaces f by rename, which is not a close-write | nothing; a writer in another agent that had f open loses at its own close (ESTALE, its bytes kept as a conflict) | 0 |

Every loss leaves the loser's bytes at ``MOUNT/.stepfs/conflicts/<path>`` and
a line in ``stepfs status --json``.

SQLite (S5): two processes of one agent -- the mount's default agent or a
named one (``STEPFS_AGENT``) -- share a WAL-mode database: the agent that has
a file open alone keeps the page cache and shared ``mmap`` of its ``-shm``
file.  A handle opened while another agent has the file open is
``direct_io``, on which the kernel refuses ``mmap(MAP_SHARED)`` (ENODEV):
two agents cannot both map one WAL database (rollback-journal mode works).
"""

from __future__ import annotations

import errno
import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agentprocs import Agent
from conftest import needs_multigrain, stepfs

pytestmark = pytest.mark.mount

def status_json(target: Path) -> dict:
    r = stepfs("status", target, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def status_text(mp: Path) -> str:
    return (mp / ".stepfs" / "status").read_text()


def step(mp: Path) -> None:
    r = stepfs("step", mp, "-m", "test")
    assert r.returncode == 0, r.stderr


# -- S1 ---------------------------------------------------------------------------------------


def test_s1_two_agents_one_close_wins_the_other_gets_estale(workspace, mount, agents):
    (workspace / "x").write_text("original\n")
    m = mount(workspace)
    alpha, beta = agents(m.mountpoint, "alpha"), agents(m.mountpoint, "beta")
    assert alpha.open_w("f", "x")["ok"] and beta.open_w("f", "x")["ok"]
    alpha.ok("write", name="f", data="alpha wins\n")
    beta.ok("write", name="f", data="beta loses, with more bytes\n")
    assert alpha("close", name="f") == {"ok": True}
    lost = beta("close", name="f")
    assert (lost["ok"], lost["errno"]) == (False, errno.ESTALE)
    assert beta.read("x") == "alpha wins\n"
    assert m.path("x").read_text() == "alpha wins\n"
    assert beta.read(".stepfs/conflicts/x") == "beta loses, with more bytes\n"
    conflicts = status_json(m.mountpoint)["conflicts"]
    assert [(c["path"], c["agent"], c["reason"]) for c in conflicts] == [("x", "beta", "stale-close")]
    assert conflicts[0]["token_mine"] and conflicts[0]["token_theirs"]
    assert conflicts[0]["token_mine"] != conflicts[0]["token_theirs"]
    assert conflicts[0]["bytes"] == f"read {m.mountpoint}/.stepfs/conflicts/x while that mount is up"
    assert "last error (beta): /x: ESTALE at close" in status_text(m.mountpoint)
    step(m.mountpoint)
    assert (workspace / "x").read_text() == "alpha wins\n"


# -- S2 ---------------------------------------------------------------------------------------


def test_s2_read_then_write_is_stale_until_read_again(workspace, mount, agents):
    (workspace / "x").write_text("version one\n")
    m = mount(workspace)
    alpha, beta = agents(m.mountpoint, "alpha"), agents(m.mountpoint, "beta")
    assert alpha.read("x") == "version one\n"
    assert beta.write_file("x", "beta's version\n") == {"ok": True}
    refused = alpha.open_w("w", "x")
    assert (refused["ok"], refused["errno"]) == (False, errno.ESTALE)
    assert alpha.read("x") == "beta's version\n"
    assert alpha.write_file("x", "alpha, after reading beta\n") == {"ok": True}
    assert beta.read("x") == "alpha, after reading beta\n"


# -- S3 ---------------------------------------------------------------------------------------


def _edit_same_size(path: Path) -> None:
    with open(path, "r+b") as f:  # same length, same inode, right after the read
        f.write(b"VERSION TWO\n")


def _edit_utime_restored(path: Path) -> None:
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.write(b"VERSION TWO\n")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _edit_save_by_rename(path: Path) -> None:
    tmp = path.with_name(path.name + ".swp")
    tmp.write_bytes(b"VERSION TWO\n")
    os.rename(tmp, path)


@pytest.mark.parametrize("edit", [_edit_same_size, _edit_utime_restored, _edit_save_by_rename])
def test_s3_editor_in_the_workspace_after_the_agent_read(workspace, mount, agents, edit):
    (workspace / "x").write_bytes(b"version one\n")
    m = mount(workspace)
    agent = agents(m.mountpoint, None)  # the mount's own agent: page cache and all
    assert agent.read("x") == "version one\n"
    edit(workspace / "x")
    refused = agent.open_w("w", "x")
    assert (refused["ok"], refused["errno"]) == (False, errno.ESTALE)
    assert (workspace / "x").read_bytes() == b"VERSION TWO\n"  # the editor's bytes are kept
    assert agent.read("x") == "VERSION TWO\n"
    assert agent.write_file("x", "agent after the editor\n") == {"ok": True}
    step(m.mountpoint)
    assert (workspace / "x").read_text() == "agent after the editor\n"


def test_s3_editor_in_the_workspace_while_the_agent_writes(workspace, mount, agents):
    (workspace / "x").write_bytes(b"version one\n")
    m = mount(workspace)
    agent = agents(m.mountpoint, None)
    assert agent.open_w("w", "x")["ok"]
    agent.ok("write", name="w", data="agent's edit\n")
    _edit_same_size(workspace / "x")
    lost = agent("close", name="w")
    assert (lost["ok"], lost["errno"]) == (False, errno.ESTALE)
    assert (workspace / "x").read_bytes() == b"VERSION TWO\n"
    assert agent.read("x") == "VERSION TWO\n"
    assert agent.read(".stepfs/conflicts/x") == "agent's edit\n"


# -- S4 ---------------------------------------------------------------------------------------


def _eventually_reads(agent: Agent, path: str, want: str, deadline_s: float = 20.0) -> str:
    """The kernel may keep a file's attributes (its size) cached after the
    workspace changed under another mount, and clip a read to the old size,
    until this mount's watcher sees the change and invalidates them; poll the
    content until it is the committed one, with a bounded deadline (an
    event, not a fixed sleep) far below the attribute timeout
    (``timeouts.ATTR_TIMEOUT``, 60 s) and long enough for a loaded machine."""
    end = time.monotonic() + deadline_s
    got = agent.read(path)
    while got != want and time.monotonic() < end:
        time.sleep(0.05)
        got = agent.read(path)
    return got


def test_s4_two_mounts_of_one_workspace(workspace, mount, agents):
    (workspace / "x").write_text("base\n")
    one, two = mount(workspace), mount(workspace)
    a1, a2 = agents(one.mountpoint, None), agents(two.mountpoint, None)
    assert a1.read("x") == "base\n" and a2.read("x") == "base\n"
    assert a1.write_file("x", "committed by mount one\n") == {"ok": True}
    assert a2.read("x") == "base\n"  # mount one's change is staged, not committed
    step(one.mountpoint)
    assert (workspace / "x").read_text() == "committed by mount one\n"
    refused = a2.open_w("w", "x")
    assert (refused["ok"], refused["errno"]) == (False, errno.ESTALE)
    assert _eventually_reads(a2, "x", "committed by mount one\n") == "committed by mount one\n"
    assert a2.write_file("x", "then mount two\n") == {"ok": True}
    step(two.mountpoint)
    assert (workspace / "x").read_text() == "then mount two\n"


# -- S5 ---------------------------------------------------------------------------------------

SQLITE_WRITER = r"""
import sqlite3, sys
who, n, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
db = sqlite3.connect("app.db", timeout=60, isolation_level=None)
assert db.execute("PRAGMA journal_mode").fetchone()[0] == mode
seen = 0
for i in range(n):
    db.execute("BEGIN IMMEDIATE")
    db.execute("INSERT INTO t (who, i) VALUES (?, ?)", (who, i))
    db.execute("COMMIT")
    count = db.execute("SELECT count(*) FROM t").fetchone()[0]  # sees the other process's rows too
    assert count >= seen + 1, (count, seen)
    seen = count
    mine = db.execute("SELECT count(*) FROM t WHERE who = ?", (who,)).fetchone()[0]
    assert mine == i + 1, (mine, i)
db.close()
"""


@pytest.mark.parametrize("agent, mode", [(None, "wal"), ("sql", "delete"), ("sql", "wal")])
def test_s5_sqlite_with_two_processes_of_one_agent(workspace, mount, agent, mode):
    """S5: two processes of one agent insert and read concurrently."""
    m = mount(workspace)
    env = {k: v for k, v in os.environ.items() if k != "STEPFS_AGENT"}
    if agent is not None:
        env["STEPFS_AGENT"] = agent
    setup = ("import sqlite3; db = sqlite3.connect('app.db'); "
             f"assert db.execute('PRAGMA journal_mode={mode}').fetchone()[0] == '{mode}'; "
             "db.execute('CREATE TABLE t (id INTEGER PRIMARY KEY, who TEXT, i INTEGER)'); db.commit()")
    r = subprocess.run([sys.executable, "-c", setup], cwd=m.mountpoint, env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    n = 40
    procs = [subprocess.Popen([sys.executable, "-c", SQLITE_WRITER, who, str(n), mode], cwd=m.mountpoint,
                              env=env, stderr=subprocess.PIPE, text=True) for who in ("p", "q")]
    for p in procs:
        _out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
    check = ("import sqlite3; db = sqlite3.connect('app.db'); "
             "print(db.execute('PRAGMA integrity_check').fetchone()[0], "
             "db.execute('SELECT who, count(*) FROM t GROUP BY who ORDER BY who').fetchall())")
    r = subprocess.run([sys.executable, "-c", check], cwd=m.mountpoint, env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.stdout.strip() == f"ok [('p', {n}), ('q', {n})]", r.stderr
    step(m.mountpoint)
    db = sqlite3.connect(workspace / "app.db")
    assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    assert db.execute("SELECT count(*) FROM t").fetchone()[0] == 2 * n
    db.close()


# -- S6 ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("reader_name", ["reader", None])
def test_s6_no_torn_reads_across_agents(workspace, mount, agents, reader_name):
    old = "old content, " * 1000 + "end\n"
    new = "NEW CONTENT! " * 1500 + "end\n"
    (workspace / "x").write_text(old)
    m = mount(workspace)
    writer, reader = agents(m.mountpoint, "writer"), agents(m.mountpoint, reader_name)
    assert writer.open_w("w", "x")["ok"]
    writer.ok("write", name="w", data=new[: len(new) // 2])
    assert reader.read("x") == old  # halfway: the complete old content
    writer.ok("write", name="w", data=new[len(new) // 2:])
    assert reader.read("x") == old
    assert writer("close", name="w") == {"ok": True}
    assert reader.read("x") == new  # after the close: the complete new content


@pytest.mark.parametrize("first_name, second_name", [("first", None), (None, "second"), ("first", "second")])
def test_s6_one_agent_at_a_time_has_the_page_cache(workspace, mount, agents, first_name, second_name):
    """The agent that opens a file first keeps the page cache and shared
    mmap; another agent opening it meanwhile bypasses the cache (no shared
    mmap: ENODEV) and never reads the first one's unpublished bytes."""
    old, new = "old line\n" * 1000, "NEW LINE\n" * 1000
    (workspace / "x").write_text(old)
    m = mount(workspace)
    first, second = agents(m.mountpoint, first_name), agents(m.mountpoint, second_name)
    first.ok("open", name="f", path="x", flags=os.O_RDWR)
    first.ok("mmap", name="f")
    first.ok("write", name="f", data=new)
    second.ok("open", name="r", path="x", flags=os.O_RDONLY)
    assert second("mmap", name="r")["errno"] == errno.ENODEV
    assert second.ok("pread", name="r", size=len(old), offset=0)["data"] == old
    assert first.ok("pread", name="f", size=len(new), offset=0)["data"] == new
    first.ok("close", name="f")
    assert second.ok("pread", name="r", size=len(old), offset=0)["data"] == old  # keeps what it opened
    second.ok("close", name="r")
    assert second.read("x") == new
    # The first agent is done: the second now opens with the cache.
    second.ok("open", name="r", path="x", flags=os.O_RDONLY)
    second.ok("mmap", name="r")
    second.ok("close", name="r")


# -- S7 ---------------------------------------------------------------------------------------


def test_s7_dup_fork_and_several_closes_make_one_decision(workspace, mount, agents):
    (workspace / "x").write_text("original\n")
    m = mount(workspace)
    loser, winner = agents(m.mountpoint, "loser"), agents(m.mountpoint, "winner")
    assert loser.open_w("fd", "x")["ok"]
    loser.ok("write", name="fd", data="loser's bytes\n")
    loser.ok("dup", name="fd", new="dup")
    assert winner.write_file("x", "winner's bytes\n") == {"ok": True}
    # A child that never wrote closes its inherited copy, then the writer
    # its dup while the original is still open: neither ends the writer's
    # use of the file, so neither decides (issue 18 item 0).
    assert loser.ok("fork_close", name="fd")["rc"] == 0
    assert loser("close", name="dup") == {"ok": True}
    out = loser("close", name="fd")  # the writer's last copy: the decision
    assert (out["ok"], out["errno"]) == (False, errno.ESTALE)
    assert loser.read("x") == "winner's bytes\n"
    conflicts = status_json(m.mountpoint)["conflicts"]
    assert [(c["path"], c["agent"]) for c in conflicts] == [("x", "loser")]  # one decision
    assert loser.read(".stepfs/conflicts/x") == "loser's bytes\n"


def test_s7_winning_descriptors_all_succeed(workspace, mount, agents):
    (workspace / "x").write_text("original\n")
    m = mount(workspace)
    a = agents(m.mountpoint, "solo")
    assert a.open_w("fd", "x")["ok"]
    a.ok("write", name="fd", data="solo\n")
    a.ok("dup", name="fd", new="dup")
    assert a.ok("fork_close", name="fd")["rc"] == 0
    assert a("close", name="dup") == {"ok": True}
    assert a("close", name="fd") == {"ok": True}
    assert m.path("x").read_text() == "solo\n"
    assert status_json(m.mountpoint)["conflicts"] == []


# -- S8 ---------------------------------------------------------------------------------------


def _env(agent: str) -> dict:
    return {**os.environ, "STEPFS_AGENT": agent}


def _wait_open(pid: int, target: Path, deadline_s: float = 10.0) -> None:
    """Wait until process ``pid`` has ``target`` open (polling /proc with a
    deadline: the event we wait for is the tool's own open(2))."""
    end = time.monotonic() + deadline_s
    want = str(target)
    while time.monotonic() < end:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    if os.readlink(f"/proc/{pid}/fd/{fd}") == want:
                        return
                except OSError:
                    pass
        except FileNotFoundError:
            break
        time.sleep(0.01)
    raise AssertionError(f"process {pid} never opened {target}")


def test_s8_python_close_raises_estale(workspace, mount, agents):
    (workspace / "x").write_text("original\n")
    m = mount(workspace)
    py, other = agents(m.mountpoint, "python"), agents(m.mountpoint, "other")
    py.send("pyclose", path="x", data="python's bytes\n")
    assert py.reply() == {"ok": True, "opened": True}
    assert other.write_file("x", "other's bytes\n") == {"ok": True}
    py.send("go")
    out = py.reply()
    assert (out["ok"], out["errno"]) == (False, errno.ESTALE)
    assert "Stale file handle" in out["error"]
    assert py.read(".stepfs/conflicts/x") == "python's bytes\n"


def test_s8_cp_reports_the_failed_close(workspace, mount, agents, tmp_path):
    (workspace / "x").write_text("original\n")
    m = mount(workspace)
    cp, err = _hold_open_and_lose(m, agents, tmp_path, ["cp", "SRC", "x"], "cp", "x")
    assert (cp.returncode, err) == (1, "cp: failed to close 'x': Stale file handle\n")
    assert status_json(m.mountpoint)["conflicts"][0]["agent"] == "cp"


def _hold_open_and_lose(m, agents, tmp_path, argv: list[str], agent: str, path: str):
    """Run a tool whose input is a pipe we feed: it opens ``path``, another
    agent wins the close meanwhile, then we end the input and the tool
    closes.  Returns the finished process and its stderr."""
    fifo = tmp_path / f"source-{agent}"
    os.mkfifo(fifo)
    proc = subprocess.Popen([a.replace("SRC", str(fifo)) for a in argv], cwd=m.mountpoint, env=_env(agent),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with open(fifo, "w") as src:
        src.write(f"{agent}'s bytes\n")
        src.flush()
        _wait_open(proc.pid, m.path(path))
        assert agents(m.mountpoint, f"other-{agent}").write_file(path, "other's bytes\n") == {"ok": True}
    _out, err = proc.communicate(timeout=30)
    assert m.path(path).read_text() == "other's bytes\n"
    assert m.path(".stepfs", "conflicts", path).read_text() == f"{agent}'s bytes\n"
    return proc, err


def test_s8_shell_echo_into_a_file_changed_since_read_fails_at_open(workspace, mount, agents):
    (workspace / "f").write_text("original\n")
    m = mount(workspace)
    assert agents(m.mountpoint, "shell").read("f") == "original\n"
    assert agents(m.mountpoint, "other").write_file("f", "other's f\n") == {"ok": True}
    r = subprocess.run(["sh", "-c", "echo x > f"], cwd=m.mountpoint, env=_env("shell"), capture_output=True,
                       text=True, timeout=30)
    assert (r.returncode, r.stderr) == (2, "sh: 1: cannot create f: Stale file handle\n")
    assert m.path("f").read_text() == "other's f\n"
    assert "last error (shell): /f: ESTALE at open for writing" in status_text(m.mountpoint)


def test_s8_cat_into_a_redirection_reports_the_failed_close(workspace, mount, agents, tmp_path):
    """coreutils check close(stdout) at exit."""
    (workspace / "f").write_text("original\n")
    m = mount(workspace)
    cat, err = _hold_open_and_lose(m, agents, tmp_path, ["sh", "-c", "cat SRC > f"], "cat", "f")
    assert (cat.returncode, err) == (1, "cat: write error: Stale file handle\n")


def test_s8_a_redirection_the_shell_closes_fails_silently_and_the_status_says_so(
        workspace, mount, agents, tmp_path):
    """Builtins writing into a redirection: the shell closes it and drops
    the error; MOUNT/.stepfs/status is where the agent finds out."""
    # One file per shell: the second rival writing the bytes the first one
    # published would change nothing (an identical rewrite keeps the token).
    for shell, path in (("sh", "f"), ("bash", "g")):
        (workspace / path).write_text("original\n")
    m = mount(workspace)
    for shell, path in (("sh", "f"), ("bash", "g")):
        script = '{ read line; echo "$line"; read line || :; } < SRC > ' + path
        proc, err = _hold_open_and_lose(m, agents, tmp_path, [shell, "-c", script], shell, path)
        assert (proc.returncode, err) == (0, "")  # nobody told the shell
        assert f"last error ({shell}): /{path}: ESTALE at close" in status_text(m.mountpoint)
        assert {c["agent"] for c in status_json(m.mountpoint)["conflicts"]} >= {shell}


def test_s8_sed_in_place_replaces_by_rename(workspace, mount, agents):
    (workspace / "x").write_text("hello world\n")
    m = mount(workspace)
    other = agents(m.mountpoint, "other")
    assert other.open_w("w", "x")["ok"]
    other.ok("write", name="w", data="other's unsaved bytes\n")
    r = subprocess.run(["sed", "-i", "s/world/there/", "x"], cwd=m.mountpoint, env=_env("sed"),
                       capture_output=True, text=True, timeout=30)
    assert (r.returncode, r.stderr) == (0, "")
    assert m.path("x").read_text() == "hello there\n"
    lost = other("close", name="w")
    assert (lost["ok"], lost["errno"]) == (False, errno.ESTALE)
    assert m.path("x").read_text() == "hello there\n"
    assert m.path(".stepfs", "conflicts", "x").read_text() == "other's unsaved bytes\n"


def _rchar(pid: int) -> int:
    """Bytes process ``pid`` has read through read-like calls (``pread`` included)."""
    with open(f"/proc/{pid}/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


@needs_multigrain
def test_a_file_changed_just_now_is_not_read_whole_at_its_open(workspace, mount):
    """The daemon proves at its start that this file system moves ctime on
    every change after a stat (store/tokens.py), so opening a file written
    a moment ago -- inside the 2 s racy window -- no longer has it hash the
    whole file before the first byte: an open and a one-byte read cost the
    daemon far less than the file's 16 MiB of reads (it read all of them
    before)."""
    from stepfs.store import tokens

    m = mount(workspace)
    for attempt in range(3):
        data = os.urandom(16 << 20)
        (workspace / "fresh.bin").write_bytes(data)
        os.stat(m.path("fresh.bin"))
        before = _rchar(m.pid)
        with open(m.path("fresh.bin"), "rb") as f:
            assert f.read(1) == data[:1]
        read = _rchar(m.pid) - before
        if time.time_ns() - os.stat(workspace / "fresh.bin").st_ctime_ns < tokens.RACY_WINDOW_NS:
            break  # the open was inside the window: what this test is about
    else:
        pytest.fail("three opens in a row came later than 2 s after their file was written")
    assert read < 4 << 20, f"the daemon read {read} bytes to open a 16 MiB file and read one byte"
