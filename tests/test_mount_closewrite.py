"""Real-mount tier: only the writer's close publishes (issue 18 item 0).

The kernel sends FLUSH for every close of any copy of a descriptor; the
processes a writer starts close their inherited copies (close-on-exec,
``subprocess`` closing every descriptor above 2, a child's exit).  Each test
has a writer (a real process of the mount's default agent) write part of a
file, do what starts or closes a copy, and a *reader agent* (a separate
long-lived process, ``STEPFS_AGENT=reader``) read the file meanwhile: it
must still see the published version, never the half-written bytes.  The
writer's own last close then publishes everything.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
from pathlib import Path

import pytest

from conftest import stepfs

pytestmark = pytest.mark.mount

def conflicts(mp: Path) -> list[dict]:
    r = stepfs("status", mp, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["conflicts"]


WRITE_TRUNC = os.O_WRONLY | os.O_TRUNC


@pytest.fixture(params=["workspace", "staged"])
def setup(request, workspace, mount, agents):
    """``(mount, writer, reader)`` with ``t.txt`` holding ``base``, read once
    by the reader agent.  ``staged``: ``base`` was written through the
    mount, so the writer's close is one answered before its publish (a
    small rewrite of a staged file: ``content.Content.flush``), and the
    closers decision runs after the reply; ``workspace``: the first
    staging of a workspace file, decided wholly before the reply."""
    if request.param == "staged":
        (workspace / "t.txt").write_text("before")
        m = mount(workspace)
        m.path("t.txt").write_text("base")
    else:
        (workspace / "t.txt").write_text("base")
        m = mount(workspace)
    writer, reader = agents(m.mountpoint, None), agents(m.mountpoint, "reader")
    assert reader.read("t.txt") == "base"
    return m, writer, reader


def test_the_issues_reproduction_subprocess_does_not_publish(setup):
    m, writer, reader = setup
    writer.ok("open", name="f", path="t.txt", flags=WRITE_TRUNC)
    writer.ok("write", name="f", data="HALF-WRITTEN ")
    assert writer.ok("subprocess")["rc"] == 0
    assert reader.read("t.txt") == "base"
    writer.ok("write", name="f", data="and done")
    writer.ok("close", name="f")
    assert reader.read("t.txt") == "HALF-WRITTEN and done"


@pytest.mark.parametrize("op", ["fork_exit", "fork_close"])
def test_a_forked_child_that_never_wrote_does_not_publish(setup, op):
    m, writer, reader = setup
    writer.ok("open", name="f", path="t.txt", flags=WRITE_TRUNC)
    writer.ok("write", name="f", data="HALF ")
    assert writer.ok(op, name="f")["rc"] == 0
    assert reader.read("t.txt") == "base"
    writer.ok("write", name="f", data="WHOLE")
    writer.ok("close", name="f")
    assert reader.read("t.txt") == "HALF WHOLE"


@pytest.mark.parametrize("inherit", [False, True], ids=["closed-at-exec", "inherited"])
def test_posix_spawn_does_not_publish(setup, inherit):
    m, writer, reader = setup
    writer.ok("open", name="f", path="t.txt", flags=WRITE_TRUNC)
    writer.ok("write", name="f", data="HALF ")
    assert writer.ok("spawn", name="f", inherit=inherit)["rc"] == 0
    assert reader.read("t.txt") == "base"
    writer.ok("close", name="f")
    assert reader.read("t.txt") == "HALF "


def test_closing_a_dup_while_the_original_is_open_does_not_publish(setup):
    m, writer, reader = setup
    writer.ok("open", name="f", path="t.txt", flags=WRITE_TRUNC)
    writer.ok("write", name="f", data="HALF ")
    writer.ok("dup", name="f", new="copy")
    writer.ok("close", name="copy")
    assert reader.read("t.txt") == "base"
    writer.ok("write", name="f", data="WHOLE")
    writer.ok("close", name="f")  # the last copy: this one publishes
    assert reader.read("t.txt") == "HALF WHOLE"


def test_closing_the_original_while_a_dup_is_open_does_not_publish(setup):
    m, writer, reader = setup
    writer.ok("open", name="f", path="t.txt", flags=WRITE_TRUNC)
    writer.ok("write", name="f", data="HALF ")
    writer.ok("dup", name="f", new="copy")
    writer.ok("close", name="f")
    assert reader.read("t.txt") == "base"
    writer.ok("write", name="copy", data="WHOLE")
    writer.ok("close", name="copy")
    assert reader.read("t.txt") == "HALF WHOLE"


@pytest.mark.parametrize("shell", ["sh", "bash"])
def test_a_shell_redirection_whose_commands_run_in_children(setup, tmp_path, shell):
    """The shell holds the redirection, writes through it (builtin echo),
    and runs a subshell and two commands in children that inherit it; the
    reader agent's ``cat`` runs in the middle.  ``bash`` also saves and
    restores descriptors around a redirected builtin (dup, close)."""
    m, _writer, reader = setup
    seen = tmp_path / "seen"
    script = ('exec 3>t.txt; echo a >&3; (true); /bin/true; STEPFS_AGENT=reader cat t.txt > "$1"; '
              'echo b >&3; echo c 1>&3; exec 3>&-')
    env = {k: v for k, v in os.environ.items() if k != "STEPFS_AGENT"}
    r = subprocess.run([shell, "-c", script, shell, str(seen)], cwd=m.mountpoint, env=env, capture_output=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert seen.read_text() == "base"
    assert reader.read("t.txt") == "a\nb\nc\n"


def test_a_group_redirection_with_a_child_command(setup, tmp_path):
    """``{ ...; } > f``: the shell opens ``f``, builtins write from the
    shell, external commands run in children holding a copy."""
    m, _writer, reader = setup
    seen = tmp_path / "seen"
    script = '{ echo a; /bin/true; STEPFS_AGENT=reader cat t.txt > "$1"; echo b; } > t.txt'
    env = {k: v for k, v in os.environ.items() if k != "STEPFS_AGENT"}
    r = subprocess.run(["bash", "-c", script, "bash", str(seen)], cwd=m.mountpoint, env=env, capture_output=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert seen.read_text() == "base"
    assert reader.read("t.txt") == "a\nb\n"


def test_threads_writing_and_another_thread_closing(setup):
    m, writer, reader = setup
    writer.ok("open", name="f", path="t.txt", flags=os.O_RDWR | os.O_TRUNC)
    parts = ["aaaa", "bbbb", "cccc", "dddd"]
    writer.ok("threads", name="f", parts=parts)
    assert reader.read("t.txt") == "base"
    writer.ok("thread_close", name="f")  # a thread that never wrote, of the writing process
    assert reader.read("t.txt") == "".join(parts)


def test_a_child_that_wrote_publishes_at_its_close(setup):
    """A child that writes through its inherited copy is a writer: its
    close publishes what it wrote (``sh -c 'cmd >&3'`` style)."""
    m, _writer, reader = setup
    env = {k: v for k, v in os.environ.items() if k != "STEPFS_AGENT"}
    script = 'exec 3>t.txt; /bin/echo from-child >&3; STEPFS_AGENT=reader cat t.txt; exec 3>&-'
    r = subprocess.run(["sh", "-c", script], cwd=m.mountpoint, env=env, capture_output=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout == b"from-child\n"
    assert reader.read("t.txt") == "from-child\n"


def test_a_rival_that_closes_while_the_writer_runs_a_process_wins(setup, agents):
    """The version-token outcome of a real two-agent race is the same as
    without the child: the rival, who closed first, wins; the writer's own
    close fails with ESTALE and its bytes are kept as a conflict copy."""
    m, writer, reader = setup
    rival = agents(m.mountpoint, "rival")
    assert rival.read("t.txt") == "base"
    writer.ok("open", name="f", path="t.txt", flags=WRITE_TRUNC)
    writer.ok("write", name="f", data="HALF ")
    assert writer.ok("subprocess")["rc"] == 0
    rival.ok("open", name="r", path="t.txt", flags=WRITE_TRUNC)
    rival.ok("write", name="r", data="rival's")
    assert rival("close", name="r") == {"ok": True}
    writer.ok("write", name="f", data="WHOLE")
    lost = writer("close", name="f")
    assert (lost["ok"], lost["errno"]) == (False, errno.ESTALE)
    assert reader.read("t.txt") == "rival's"
    assert reader.read(".stepfs/conflicts/t.txt") == "HALF WHOLE"
    assert [(c["path"], c["agent"], c["reason"]) for c in conflicts(m.mountpoint)] == [
        ("t.txt", "default", "stale-close")]


def test_the_writer_that_closes_first_still_wins(setup, agents):
    m, writer, reader = setup
    rival = agents(m.mountpoint, "rival")
    assert rival.read("t.txt") == "base"
    writer.ok("open", name="f", path="t.txt", flags=WRITE_TRUNC)
    rival.ok("open", name="r", path="t.txt", flags=WRITE_TRUNC)
    writer.ok("write", name="f", data="writer's")
    assert writer.ok("subprocess")["rc"] == 0
    assert writer("close", name="f") == {"ok": True}
    rival.ok("write", name="r", data="rival's")
    assert rival.ok("subprocess")["rc"] == 0
    lost = rival("close", name="r")
    assert (lost["ok"], lost["errno"]) == (False, errno.ESTALE)
    assert reader.read("t.txt") == "writer's"
    assert reader.read(".stepfs/conflicts/t.txt") == "rival's"


def test_the_writers_exit_publishes(setup):
    """The writer never closes: its exit does (after a child's exit did
    not)."""
    m, writer, reader = setup
    writer.ok("open", name="f", path="t.txt", flags=WRITE_TRUNC)
    writer.ok("write", name="f", data="all of it")
    assert writer.ok("fork_exit")["rc"] == 0
    assert reader.read("t.txt") == "base"
    writer.stop()  # exit closes the last copy: FLUSH of the writer, then RELEASE
    assert reader.read("t.txt") == "all of it"


def test_a_step_right_after_the_close_includes_it(setup):
    """What a close returned is in the step committed next (DESIGN.md),
    also when the close was answered before its publish."""
    m, writer, reader = setup
    for i in range(3):
        writer.ok("open", name="f", path="t.txt", flags=WRITE_TRUNC)
        writer.ok("write", name="f", data=f"version {i}")
        assert writer("close", name="f") == {"ok": True}
        r = stepfs("step", m.mountpoint, "-m", f"v{i}")
        assert r.returncode == 0, r.stderr
        assert (m.workspace / "t.txt").read_text() == f"version {i}"


def test_every_close_is_seen_by_the_next_reader(setup):
    m, writer, reader = setup
    for i in range(10):
        writer.ok("open", name="f", path="t.txt", flags=WRITE_TRUNC)
        writer.ok("write", name="f", data=f"round {i}")
        assert writer("close", name="f") == {"ok": True}
        assert reader.read("t.txt") == f"round {i}"
