"""The scripting contract (README "Scripting"), checked for every command:
man-page help, JSON with a ``message_type``, the exit-code table, --quiet,
progress only on a terminal, shell completion."""

from __future__ import annotations

import io
import json
import re
import signal
import subprocess
import sys
import threading

import pytest

from stepfs.cli import commands, exitcodes, main, progress
from stepfs.cli.completion import bash_script, subcommands
from conftest import ROOT, stepfs
from mountguard import private_tmp  # noqa: F401
from stepfs.store import errors

COMMANDS = subcommands(main.build_parser())


# -- help ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_help_has_summary_arguments_and_example(name):
    sp = COMMANDS[name]
    assert sp.description and "\n" not in sp.description.strip(), "a one-line summary"
    assert sp.epilog and sp.epilog.startswith(f"example: stepfs {name}"), "an example"
    undocumented = [a.dest for a in sp._actions if not a.help]
    assert not undocumented, f"arguments without help: {undocumented}"
    text = sp.format_help()
    assert f"usage: stepfs {name}" in text
    for a in sp._actions:
        for opt in a.option_strings:
            assert opt in text


def test_help_through_the_command():
    r = stepfs("run", "--help")
    assert r.returncode == 0
    assert b"example: stepfs run" in r.stdout and b"-- COMMAND" in r.stdout
    r = stepfs("--help")
    assert r.returncode == 0 and b"exit codes:" in r.stdout


# -- exit codes --------------------------------------------------------------------------


def readme_exit_codes() -> dict[int, str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Scripting", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (\d+) \| (.+?) \|$", section, re.M)
    assert rows, "README's Scripting section has no exit-code table"
    return {int(code): meaning for code, meaning in rows}


def test_exit_code_table_matches_readme_and_help():
    documented = readme_exit_codes()
    actual = {exitcodes.OK, exitcodes.UNEXPECTED, exitcodes.USAGE, exitcodes.OUTPUT_CLOSED} | {
        code for _cls, code in exitcodes.CODES}
    assert set(documented) == actual
    epilog_codes = {int(n) for n in re.findall(r"(\d+) [a-z]", main.EPILOG_EXIT)}
    assert epilog_codes == actual


def test_usage_errors_exit_2(tmp_path):
    from stepfs.store.workspace import Workspace

    Workspace.open(str(tmp_path), create=True).close()
    for args in (("show", tmp_path, "1", "2", "3"), ("step", tmp_path, "--meta", "novalue"), ("nosuchcommand",)):
        r = stepfs(*args)
        assert r.returncode == exitcodes.USAGE, (args, r.stderr)


# -- JSON on every command ----------------------------------------------------------------


def _obj(result, expected: str, last_line: bool = False) -> dict:
    assert result.returncode == 0, result.stderr.decode()
    text = result.stdout.decode()
    obj = json.loads(text.strip().splitlines()[-1] if last_line else text)
    assert isinstance(obj, dict) and obj.get("message_type") == expected, obj
    return obj


def _serve_json(workspace) -> dict:
    """``stepfs serve --json``'s object: its first line, printed once it
    listens; then Ctrl-C stops it (a watchdog kills it if it never prints)."""
    proc = subprocess.Popen([sys.executable, "-m", "stepfs.cli.main", "serve", "--json", "--port", "0",
                             str(workspace)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    watchdog = threading.Timer(60, proc.kill)
    watchdog.start()
    try:
        line = proc.stdout.readline()
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        finally:
            watchdog.cancel()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == 0, proc.stderr.read().decode()
    obj = json.loads(line)
    assert obj.get("message_type") == "serve", obj
    return obj


@pytest.mark.mount
@pytest.mark.timeout(300)  # about twenty CLI processes, one per command: slow on a loaded machine
def test_every_command_prints_json_with_a_message_type(workspace, mount, private_tmp, request):
    (workspace / "a.txt").write_text("a\n")
    mp = private_tmp / "mnt"
    mp.mkdir()
    seen: dict[str, dict] = {}
    seen["mount"] = _obj(stepfs("mount", "--json", workspace, mp), "mount")
    try:
        (mp / "b.txt").write_text("b\n")
        seen["status"] = _obj(stepfs("status", "--json", mp), "status")
        seen["step"] = _obj(stepfs("step", "--json", mp, "-m", "b"), "step")
        seen["log"] = _obj(stepfs("log", "--json", workspace), "log")
        seen["show"] = _obj(stepfs("show", "--json", workspace, "1"), "show")
        seen["cat"] = _obj(stepfs("cat", "--json", workspace, "1", "b.txt"), "cat")
        assert seen["cat"]["content"] == "b\n" and seen["cat"]["encoding"] == "utf-8"
        (mp / "c.txt").write_text("c\n")
        payload = json.dumps({"cwd": str(mp), "tool_name": "Write", "tool_use_id": "t1"}).encode()
        seen["hook-commit"] = _obj(stepfs("hook-commit", "--json", input=payload), "hook-commit")
        seen["run"] = _obj(stepfs("run", "--json", mp, "--", "sh", "-c", "echo d > d.txt"), "run", last_line=True)
        assert seen["run"]["reused"] is True and seen["run"]["confined"] is None
        seen["confine"] = _obj(stepfs("confine", "--json", mp, "--", "sh", "-c", "echo e > e2.txt"), "confine",
                               last_line=True)
        assert seen["confine"]["confined"]["confined"] is True and seen["confine"]["exit_code"] == 0
        seen["hooks"] = _obj(stepfs("hooks", "--json", "claude-code"), "hooks")
        assert _obj(stepfs("hooks", "--json", "shell"), "hooks")["script"].startswith("#!")
        seen["completion"] = _obj(stepfs("completion", "--json", "bash"), "completion")
        # Commands other branches add; the arguments follow DESIGN.md's CLI contract.
        if "diff" in COMMANDS:
            seen["diff"] = _obj(stepfs("diff", "--json", workspace, "2"), "diff")
        if "verify" in COMMANDS:
            seen["verify"] = _obj(stepfs("verify", "--json", workspace), "verify")
        if "rollback" in COMMANDS:
            seen["rollback"] = _obj(stepfs("rollback", "--json", workspace, "1"), "rollback")
        if "discard" in COMMANDS:
            (mp / "e.txt").write_text("e\n")
            seen["discard"] = _obj(stepfs("discard", "--json", mp, "e.txt"), "discard")
        if "gc" in COMMANDS:  # bounded history (issue 20), with the mount live
            seen["du"] = _obj(stepfs("du", "--json", mp), "du")
            seen["gc"] = _obj(stepfs("gc", "--json", mp), "gc")
            seen["prune"] = _obj(stepfs("prune", "--json", workspace, "--keep-last", "2"), "prune")
            seen["conflicts"] = _obj(stepfs("conflicts", "drop", workspace, "--all", "--json"), "conflicts")
        if "serve" in COMMANDS:
            seen["serve"] = _serve_json(workspace)
            assert seen["serve"]["url"].startswith("http://127.0.0.1:") and "?token=" in seen["serve"]["url"]
        if "sync" in COMMANDS:  # a shared history (issue 22) in a PostgreSQL server tests/pgserver.py starts
            url = request.getfixturevalue("pg_url")
            seen["sync"] = _obj(stepfs("sync", "--json", mp, "--history", url), "sync")
            seen["clone"] = _obj(stepfs("clone", "--json", url, private_tmp / "clone"), "clone")
            seen["verify-history"] = _obj(stepfs("verify-history", "--json", "--history", url), "verify-history")
            seen["gc-history"] = _obj(stepfs("gc-history", "--json", "--history", url), "gc-history")
    finally:
        r = stepfs("unmount", "--quiet", mp)
    assert r.returncode == 0 and r.stdout == b"", "--quiet drops the unmount line"
    m2 = mount(workspace)
    seen["unmount"] = _obj(stepfs("unmount", "--json", m2.mountpoint), "unmount")
    missing = set(COMMANDS) - set(seen)
    assert not missing, f"add a --json scenario here for: {sorted(missing)}"


def test_errors_are_one_sentence_and_a_json_object_on_stderr(tmp_path):
    r = stepfs("show", "--json", tmp_path, "1")
    assert r.returncode == dict(exitcodes.CODES)[errors.WorkspaceError]
    assert r.stdout == b""
    lines = r.stderr.decode().splitlines()
    assert len(lines) == 2 and lines[0].startswith("stepfs: ")
    err = json.loads(lines[1])
    assert err["message_type"] == "error" and err["exit_code"] == r.returncode
    assert err["message"] == lines[0][len("stepfs: "):]


# -- --quiet, progress, completion ---------------------------------------------------------------


def test_quiet_drops_confirmations_but_keeps_results(capsys):
    class Args:
        json = False
        quiet = True

    commands._emit(Args, {"message_type": "mount"}, "mounted x at y", essential=False)
    commands._emit(Args, {"message_type": "step"}, "7")
    assert capsys.readouterr().out == "7\n"
    Args.json = True
    commands._emit(Args, {"message_type": "mount"}, "mounted x at y", essential=False)
    assert json.loads(capsys.readouterr().out) == {"message_type": "mount"}


class _Stream(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def test_progress_only_on_a_terminal():
    off = _Stream(tty=False)
    with progress.Progress("verifying", total=3, stream=off) as bar:
        for i in range(1, 4):
            bar(i, 3)
    assert off.getvalue() == ""
    on = _Stream(tty=True)
    with progress.Progress("verifying", total=3, stream=on) as bar:
        bar(3, 3)
        assert on.getvalue().endswith("stepfs: verifying  3/3 (100%)")
    assert on.getvalue().endswith("\r"), "the line is erased when the work ends"

    class Quiet:
        quiet, json = True, False

    assert progress.for_args(Quiet, "x").enabled is False


def _complete(words: list[str]) -> list[str]:
    script = bash_script(main.build_parser())
    line = " ".join(words)
    cmd = (f"{script}\nCOMP_WORDS=({line}); COMP_CWORD={len(words) - 1}; _stepfs; "
           f"printf '%s\\n' \"${{COMPREPLY[@]}}\"")
    r = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return [w for w in r.stdout.splitlines() if w]


def test_bash_completion_knows_commands_options_and_choices():
    assert _complete(["stepfs", "mo"]) == ["mount"]
    assert set(COMMANDS) <= set(_complete(["stepfs", "''"]))
    assert _complete(["stepfs", "step", "--al"]) == ["--allow-empty"]
    assert _complete(["stepfs", "hooks", "cl"]) == ["claude-code"]
    assert _complete(["stepfs", "run", "--pr"]) == ["--private"]
    assert "bash" in _complete(["stepfs", "run", "ws", "--", "bas"])  # after --: commands
    r = stepfs("completion", "bash")
    assert r.returncode == 0 and b"complete -o default -F _stepfs stepfs" in r.stdout
