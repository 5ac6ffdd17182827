"""Agent CLI hooks: ``stepfs hook-commit`` fed real hook payloads on stdin,
the Claude Code settings snippet's own command, and the shell wrapper."""

from __future__ import annotations

import json
import stat
import subprocess
import sys

import pytest

from stepfs.cli import exitcodes
from conftest import sh, stepfs
from mountguard import private_tmp  # noqa: F401
from stepfs.overlayfs.client import api, hooks
from stepfs.store import errors

pytestmark = pytest.mark.mount


def claude_payload(cwd, **fields) -> bytes:
    """A PostToolUse payload as Claude Code sends it (fields from its hooks reference)."""
    payload = {
        "session_id": "3f2c9a1e-sess", "transcript_path": "/root/.claude/projects/x/3f2c9a1e-sess.jsonl",
        "cwd": str(cwd), "permission_mode": "default", "hook_event_name": "PostToolUse",
        "tool_name": "Write", "tool_use_id": "toolu_01ABCdef",
        "tool_input": {"file_path": f"{cwd}/src/app.py", "content": "print('hi')\n"},
        "tool_response": {"filePath": f"{cwd}/src/app.py", "success": True},
    }
    payload.update(fields)
    return json.dumps(payload).encode()


def test_hook_commit_commits_the_tool_call_with_its_ids(workspace, mount):
    (workspace / "src").mkdir()
    m = mount(workspace)
    (m.mountpoint / "src" / "app.py").write_text("print('hi')\n")  # what the Write tool did
    r = stepfs("hook-commit", input=claude_payload(m.mountpoint), cwd="/")
    assert r.returncode == 0, r.stderr
    assert r.stdout == b"1\n"
    card = api.open_workspace(workspace).card(1)
    assert card["meta"] == {"tool_name": "Write", "tool_use_id": "toolu_01ABCdef", "session_id": "3f2c9a1e-sess",
                            "hook_event": "PostToolUse"}
    assert card["message"] == "Write: src/app.py"
    assert card["mount"] == str(m.mountpoint)
    assert [(f["op"], f["path"]) for f in card["files"]] == [("added", "src/app.py")]

    # A Bash call in a subdirectory, extra --meta, JSON output.
    sh("sed -i 's/hi/hello/' app.py", cwd=m.mountpoint / "src")
    r = stepfs("hook-commit", "--json", "--meta", "turn=2", cwd="/", input=claude_payload(
        m.mountpoint / "src", tool_name="Bash", tool_use_id="toolu_02",
        tool_input={"command": "sed -i 's/hi/hello/' app.py", "description": "greet"}))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["message_type"] == "hook-commit" and out["number"] == 2
    card = api.open_workspace(workspace).card(2)
    assert card["message"] == "Bash: sed -i 's/hi/hello/' app.py"
    assert card["meta"]["tool_use_id"] == "toolu_02" and card["meta"]["turn"] == "2"

    # A tool call that changed nothing (a Read): no layer, exit 0.
    r = stepfs("hook-commit", "--json", cwd="/", input=claude_payload(m.mountpoint, tool_name="Read"))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["numbers"] == []
    assert api.open_workspace(workspace).head() == 2


def test_hook_refuses_a_cwd_outside_any_mount_and_bad_payloads(workspace, tmp_path):
    api.open_workspace(workspace, create=True)
    r = stepfs("hook-commit", input=claude_payload(workspace))
    assert r.returncode == dict(exitcodes.CODES)[errors.NotMountedError]
    assert b"is not in a stepfs mount" in r.stderr
    for bad in (b"not json", b"[1, 2]"):
        r = stepfs("hook-commit", "--json", input=bad)
        assert r.returncode == dict(exitcodes.CODES)[errors.InputError] == 13
        err = r.stderr.decode().splitlines()
        assert err[0].startswith("stepfs: the hook payload on stdin is not")
        assert json.loads(err[-1])["error"] == "InputError"


def test_claude_code_snippet_command_commits(workspace, mount, tmp_path):
    """Run the snippet's command line the way Claude Code does (a shell, the
    payload on stdin), with a stepfs that is this checkout."""
    m = mount(workspace)
    shim = tmp_path / "bin" / "stepfs"
    shim.parent.mkdir()
    shim.write_text(f"#!/bin/sh\nexec {sys.executable} -m stepfs.cli.main \"$@\"\n")
    shim.chmod(shim.stat().st_mode | stat.S_IXUSR)
    r = stepfs("hooks", "claude-code", "--command", shim)
    assert r.returncode == 0, r.stderr
    settings = json.loads(r.stdout)
    (entry,) = settings["hooks"]["PostToolUse"]
    assert entry["matcher"] == hooks_matcher()
    (hook,) = entry["hooks"]
    assert hook["type"] == "command" and hook["command"] == f"{shim} hook-commit || exit 2"
    assert isinstance(hook["timeout"], int)

    (m.mountpoint / "notes.md").write_text("n\n")
    payload = claude_payload(m.mountpoint, tool_name="Edit", tool_use_id="toolu_snip",
                             tool_input={"file_path": f"{m.mountpoint}/notes.md"})
    r = subprocess.run(["bash", "-c", hook["command"]], input=payload, capture_output=True, cwd=m.mountpoint)
    assert r.returncode == 0, r.stderr
    card = api.open_workspace(workspace).card(1)
    assert card["meta"]["tool_use_id"] == "toolu_snip" and card["message"] == "Edit: notes.md"
    # A failure becomes exit 2: Claude Code shows the sentence to the agent.
    r = subprocess.run(["bash", "-c", hook["command"]], input=b"garbage", capture_output=True, cwd=m.mountpoint)
    assert r.returncode == 2 and r.stderr.decode().startswith("stepfs: the hook payload")


def hooks_matcher() -> str:
    from stepfs.cli.hooks import CLAUDE_CODE_MATCHER

    return CLAUDE_CODE_MATCHER


def test_shell_wrapper_runs_a_tool_call_as_a_tagged_step(workspace, mount, tmp_path, private_tmp):
    m = mount(workspace)
    shim = tmp_path / "stepfs-shim"
    shim.write_text(f"#!/bin/sh\nexec {sys.executable} -m stepfs.cli.main \"$@\"\n")
    shim.chmod(0o755)
    r = stepfs("hooks", "shell", "--command", shim)
    assert r.returncode == 0, r.stderr
    wrapper = tmp_path / "stepfs-tool"
    wrapper.write_bytes(r.stdout)
    wrapper.chmod(0o755)
    env = {"STEPFS_WORKSPACE": str(workspace), "STEPFS_TOOL_CALL_ID": "call_42", "STEPFS_SESSION_ID": "s1"}
    r = sh(f"{wrapper} sh -c 'echo built > out.txt; exit 4'", cwd=workspace, check=False, env=env)
    assert r.returncode == 4, r.stderr
    assert r.stdout == b"", "the wrapper runs stepfs quietly"
    card = api.open_workspace(workspace).card(1)
    assert card["meta"] == {"tool_use_id": "call_42", "tool_name": "sh", "session_id": "s1", "exit_code": "4"}
    assert card["mount"] == str(m.mountpoint), "the wrapper should reuse the harness's live mount"
    assert (workspace / "out.txt").read_text() == "built\n"
    assert sh(str(wrapper), cwd=workspace, check=False).returncode == 2
    # STEPFS_CONFINE=1: the call runs confined; its write outside fails, its write inside is committed.
    decoy = tmp_path / "decoy"
    decoy.write_bytes(b"keep\r\n")
    r = sh(f"{wrapper} sh -c 'echo out > {decoy}; echo in > in.txt'", cwd=workspace, check=False,
           env={**env, "STEPFS_CONFINE": "1", "STEPFS_TOOL_CALL_ID": "call_43"})
    assert r.returncode == 0 and b"Permission denied" in r.stderr, r.stderr
    assert decoy.read_bytes() == b"keep\r\n"
    card = api.open_workspace(workspace).card(2)
    assert card["meta"]["tool_use_id"] == "call_43" and [f["path"] for f in card["files"]] == ["in.txt"]


def test_message_and_meta_from_payloads():
    assert hooks.message_of({"tool_name": "Bash", "tool_input": {"command": "make test\nmake lint"}}) == "Bash: make test"
    assert hooks.message_of({"tool_name": "mcp__fs__write"}) == "mcp__fs__write"
    assert hooks.message_of({}) == "tool call"
    long = hooks.message_of({"tool_name": "Bash", "tool_input": {"command": "x" * 500}})
    assert len(long) == hooks.MESSAGE_LIMIT and long.endswith("\u2026")
    assert hooks.meta_of({"tool_name": "Edit", "tool_use_id": "", "session_id": None, "cwd": "/x"}) == {"tool_name": "Edit"}
