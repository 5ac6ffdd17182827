"""Issue 18 item 3: names and values cannot fake what stepfs prints.  A
control character in a path, a message, a --meta value or a hook's
tool_name is shown escaped (git's C quoting), and a patch names paths the
way git does."""

from __future__ import annotations

import json
import os

import pytest

from stepfs.cli.render import card_text, quote
from conftest import stepfs
from history_helpers import open_ws, write
from stepfs.store.diff import git_quote

EVIL = "evil.sh\x1b[2K\r  M README.md"
NEWLINE = "two\nlines.txt"


def _clean(text: str) -> None:
    """Nothing a terminal would act on reached the output."""
    assert "\x1b" not in text and "\r" not in text, repr(text)


def test_quote_escapes_controls_and_leaves_plain_names_alone():
    assert quote("src/app.py") == "src/app.py"
    assert quote("café/ü.txt") == "café/ü.txt"
    assert quote(EVIL) == '"evil.sh\\033[2K\\r  M README.md"'
    assert quote(NEWLINE) == '"two\\nlines.txt"'
    assert quote("bad\udcffbyte") == '"bad\\377byte"'
    assert quote("rtl\u202egnp.exe") == '"rtl\\342\\200\\256gnp.exe"'
    assert quote('say "hi"\\') == '"say \\"hi\\"\\\\"'


def test_git_quote_matches_git():
    assert git_quote(b"a/plain name.txt") == "a/plain name.txt"
    assert git_quote(b"a/evil\nname") == '"a/evil\\nname"'
    assert git_quote(b"b/tab\there") == '"b/tab\\there"'
    assert git_quote("a/café".encode()) == '"a/caf\\303\\251"'


@pytest.fixture
def evil_history(tmp_path):
    ws_path = tmp_path / "ws"
    ws_path.mkdir()
    (ws_path / "README.md").write_text("readme\n")
    ws, view = open_ws(ws_path)
    try:
        write(view, EVIL, b"#!/bin/sh\necho pwned\n")
        write(view, NEWLINE, b"one\ntwo\n")
        view.commit(message="Edit\x1b[31m red\x1b]0;title\x07", meta={"tool_name": "Bash\x1b[2K\rEdit", "k": "v"})
    finally:
        ws.close()
    return ws_path


def test_log_show_and_diff_quote_names_and_values(evil_history):
    ws = evil_history
    for argv in (("log", ws), ("show", ws, "1"), ("show", ws, "1", "--patch"), ("diff", ws, "1")):
        r = stepfs(*argv)
        assert r.returncode == 0, (argv, r.stderr)
        out = r.stdout.decode()
        _clean(out)
        if argv[0] != "log":
            assert '"evil.sh\\033[2K\\r  M README.md"' in out or '"b/evil.sh\\033[2K\\r  M README.md"' in out
            assert "two\\nlines.txt" in out
        if argv[0] in ("log", "show") and "--patch" not in argv:
            assert "Bash\\033[2K\\rEdit" in out
            assert "\\033[31m red" in out
    patch = stepfs("diff", ws, "1").stdout.decode()
    headers = [ln for ln in patch.splitlines() if ln.startswith(("diff --git", "--- ", "+++ "))]
    assert 'diff --git "a/two\\nlines.txt" "b/two\\nlines.txt"' in headers
    assert '+++ "b/two\\nlines.txt"' in headers
    # Every line of the patch is a header, a hunk line or a git extended header.
    for line in patch.splitlines():
        assert line.startswith(("diff --git", "--- ", "+++ ", "@@", "+", "-", " ", "new file mode",
                                "deleted file mode", "\\ No newline")), repr(line)
    # --json keeps the names exact (JSON escapes them itself).
    out = json.loads(stepfs("show", ws, "1", "--json").stdout)
    assert {f["path"] for f in out["files"]} == {EVIL, NEWLINE}


def test_run_card_quotes_names():
    none = {"kind": None, "mode": None}
    card = {"number": 3, "kind": "step", "time": "t", "message": "m\x1b[2K", "mount": "/m\r", "agent": "a\x1b",
            "meta": {"tool\x1b": "x\ny"}, "added": 1, "modified": 0, "deleted": 0, "renamed": 1, "lines_added": 1,
            "lines_removed": 0,
            "files": [{"op": "added", "path": EVIL, "kind": "file", "lines_added": 1, "lines_removed": 0,
                       "before": none, "after": {"kind": "file", "mode": 0o644}},
                      {"op": "renamed", "from": "old\x1b[2K", "path": "new\rname", "kind": "symlink",
                       "before": {"kind": "symlink", "mode": None, "target": "t"},
                       "after": {"kind": "symlink", "mode": None, "target": "evil\x1b]0;x\x07"}}]}
    text = card_text(card)
    _clean(text)
    assert len(text.splitlines()) == 7  # no line break smuggled in by a name or value
    assert '"evil.sh\\033[2K\\r  M README.md"' in text


@pytest.mark.mount
def test_status_and_hook_tool_name_are_quoted(mnt):
    (mnt.path(EVIL)).write_text("x\n")
    r = stepfs("status", mnt.mountpoint)
    assert r.returncode == 0, r.stderr
    out = r.stdout.decode()
    _clean(out)
    assert '"evil.sh\\033[2K\\r  M README.md"' in out
    payload = json.dumps({"cwd": str(mnt.mountpoint), "tool_name": "Edit\x1b[2K\rRead",
                          "tool_use_id": "t1"}).encode()
    r = stepfs("hook-commit", input=payload, cwd="/")
    assert r.returncode == 0, r.stderr
    log = stepfs("log", mnt.mountpoint).stdout.decode()
    _clean(log)
    assert "Edit\\033[2K\\rRead" in log


def test_error_messages_escape_the_names_they_cite(evil_history):
    r = stepfs("cat", evil_history, "1", "nope\x1b[2K\rfake")
    assert r.returncode != 0
    err = r.stderr.decode()
    _clean(err)
    assert "nope\\033[2K\\rfake" in err
