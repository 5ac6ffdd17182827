"""Every example in ``stepfs --help`` and in each command's ``--help`` is run
as printed (issue 17), the way docs/API.md's example is: taken from the
parser, run by bash against a real workspace and mount, exit 0.

The examples name ``~/project`` (HOME is a temp directory holding it),
``/mnt/agent`` and ``/etc/bash_completion.d/`` (both replaced by temp
paths, the only rewriting done) and ``claude`` (a stand-in script: the agent
program is not stepfs's to test).  Commands run in the order a user's
session would (``ORDER``); what an example presumes (staged files, a layer
3) is set up before it through the mount, and said next to it.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from mountguard import private_tmp  # noqa: F401
from stepfs.cli.main import build_parser
from stepfs.overlayfs.client import mounts

pytestmark = [pytest.mark.mount, pytest.mark.timeout(300)]

#: Commands with examples, in the order a session runs them; the top-level
#: examples run just before the final unmount.
ORDER = ["mount", "step", "status", "discard", "conflicts", "hook-commit", "show", "diff", "cat", "log", "verify",
         "du", "gc", "rollback", "hooks", "completion", "run", "confine", "prune", "unmount"]
#: Examples not run here, each with the reason and the test that covers it instead.
NOT_RUN = {"serve": "a server that runs until stopped: tests/test_serve_http.py drives it",
           "sync": "needs a shared history's server: tests/test_shared_cli.py runs sync against one",
           "clone": "needs a shared history's server: tests/test_shared_cli.py runs clone against one",
           "verify-history": "needs a shared history's server: tests/test_shared_cli.py runs it against one",
           "gc-history": "needs a shared history's server: tests/test_shared_gc.py runs it against one"}


def examples() -> tuple[dict[str, str], list[str]]:
    """``{command: its epilog's example}`` and the top-level examples, as printed."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, type(parser._subparsers._group_actions[0])))
    per_command = {}
    for name, sp in sub.choices.items():
        found = re.search(r"(?m)^example: (.+)$", sp.epilog or "")
        if found:
            per_command[name] = found.group(1).strip()
    top = re.findall(r"(?m)^  (stepfs .+?)\s*(?:#.*)?$", parser.epilog)
    return per_command, top


def test_every_command_with_an_example_is_in_the_session_order():
    per_command, top = examples()
    assert set(per_command) == set(ORDER) | set(NOT_RUN), "give each new example its place in ORDER"
    assert len(top) >= 3


def test_every_help_example_runs(tmp_path, private_tmp):
    per_command, top = examples()
    home = tmp_path / "home"
    ws = home / "project"
    (ws / "src").mkdir(parents=True)
    (ws / "tests").mkdir()
    (ws / ".claude").mkdir()  # where the hooks example writes its settings
    (home / ".cache").mkdir()  # what the confine example allows writing
    (ws / "src" / "main.py").write_text("print('main')\n")
    (ws / "src" / "app.py").write_text("app = 1\n")
    (ws / "tests" / "test_ok.py").write_text("def test_ok():\n    assert True\n")
    mnt = private_tmp / "agent"
    mnt.mkdir()
    completions = tmp_path / "bash_completion.d"
    completions.mkdir()
    fakebin = tmp_path / "bin"
    fakebin.mkdir()
    claude = fakebin / "claude"  # stand-in for the agent program the run example starts
    claude.write_text('#!/bin/sh\necho "the agent was asked: $2" >> agent-notes.txt\n')
    claude.chmod(0o755)
    env = {**os.environ, "HOME": str(home),
           "PATH": f"{fakebin}:{os.path.dirname(sys.executable)}:{os.environ['PATH']}"}

    def run(line: str, expect: int = 0) -> subprocess.CompletedProcess:
        line = line.replace("/mnt/agent", str(mnt)).replace("/etc/bash_completion.d/", f"{completions}/")
        r = subprocess.run(["bash", "-o", "pipefail", "-c", line], cwd=ws, env=env, capture_output=True,
                           timeout=120)
        assert r.returncode == expect, f"{line}\nexit {r.returncode}\n{r.stdout[-1500:]!r}\n{r.stderr[-1500:]!r}"
        return r

    def setup(name: str) -> None:
        """What the example of ``name`` presumes, made through the mount."""
        if name == "step":  # layers 1 and 2 exist, and something to commit as 3
            for i, path in enumerate(("src/app.py", "src/main.py"), 1):
                (mnt / path).write_text(f"{path} v{i + 1}\n")
                run(f"stepfs step {mnt} -m 'setup {i}'")
            (mnt / "src" / "parser.py").write_text("def parse(): pass\n")
        elif name == "discard":  # something staged to drop, and something to keep (layer 4)
            (mnt / "src" / "generated.py").write_text("generated\n")
            (mnt / "src" / "keep.py").write_text("keep\n")
        elif name == "conflicts":  # conflicts 3 and 4 to drop: staged versions that lost to outside edits
            for i in (1, 2, 3, 4):
                (mnt / "src" / f"draft{i}.py").write_text(f"draft {i}\n")
                (ws / "src" / f"draft{i}.py").write_text(f"outside {i}\n")
                run(f"stepfs discard {mnt} src/draft{i}.py")
        elif name == "hook-commit":  # the payload the example reads, and a tool call's edit (layer 5)
            run(f"stepfs step {mnt} -m 'keep'")
            (mnt / "src" / "app.py").write_text("app = 5\n")
            (ws / "payload.json").write_text(json.dumps({"cwd": str(mnt), "tool_name": "Edit",
                                                         "tool_use_id": "toolu_01"}))

    done = []
    try:
        for name in ORDER:
            if name == "unmount":
                for line in top:
                    run(line)
                    done.append(line)
            setup(name)
            for line in per_command[name].split("   |   "):  # one example line may hold two commands
                r = run(line)
            done.append(per_command[name])
            if name == "discard":
                assert not (ws / "src" / "generated.py").exists()
            if name == "hook-commit":
                assert (ws / "src" / "app.py").read_text() == "app = 5\n"
            if name == "show":
                assert b"layer 3 " in r.stdout and b"+def parse(): pass" in r.stdout
    finally:
        if any(m.mountpoint == str(mnt) for m in mounts.stepfs_mounts()):
            subprocess.run([sys.executable, "-m", "stepfs.cli.main", "unmount", "--force", str(mnt)],
                           capture_output=True, timeout=60)
    assert len(done) == len(ORDER) + len(top)
    assert json.loads(run("stepfs status --json").stdout)["conflicts"] == []
    # run's example, then confine's (which starts the agent with no prompt)
    assert (ws / "agent-notes.txt").read_text() == "the agent was asked: fix the tests\nthe agent was asked: \n"
    assert (ws / ".claude" / "settings.local.json").read_text().startswith("{")
    assert "-F _stepfs stepfs" in (completions / "stepfs").read_text()
    log = json.loads(run("stepfs log --json").stdout)["layers"]
    assert [r["message"] for r in log[:2]] == ["tests", "agent turn 1"]  # the top-level examples ran last
    assert shlex.split(top[0])[:3] == ["stepfs", "run", "-m"]
