"""The CLI's start-up stays lean where it can: committing or unmounting a
mount only talks to its daemon, so it must not import the database layer
(SQLAlchemy is most of a start-up: ~115 ms of ~230 ms measured)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import stepfs


def _modules_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys\nprint('\\n'.join(sys.modules))"],
                         capture_output=True, text=True, check=True, env=dict(os.environ))
    return set(out.stdout.split())


def _step_without_database(target: str, message: str) -> subprocess.CompletedProcess:
    """``stepfs step TARGET -m MESSAGE`` in a fresh interpreter that fails
    if the command imported the database layer."""
    code = (
        "import sys\nfrom stepfs.cli.main import main\n"
        f"rc = main(['step', {target!r}, '-m', {message!r}])\n"
        "assert 'sqlalchemy' not in sys.modules, 'the database layer was imported'\n"
        "sys.exit(rc)\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ))


def test_library_for_mount_commands_does_not_import_the_database_layer():
    mods = _modules_after("from stepfs.cli import main\nfrom stepfs.overlayfs.client import manage, control\n"
                          "from stepfs.overlayfs.daemon import protocol")
    assert "sqlalchemy" not in mods
    assert "stepfs.overlayfs.core.view" not in mods and "mfusepy" not in mods
    assert "stepfs.overlayfs.daemon.fuse_ops" not in mods


@pytest.mark.mount
def test_step_of_a_mountpoint_commits_through_the_daemon_alone(mount, workspace):
    m = mount(workspace)
    (m.mountpoint / "new.txt").write_text("hello\n")
    done = _step_without_database(str(m.mountpoint), "lean")
    assert done.returncode == 0, done.stderr
    assert (m.workspace / "new.txt").read_text() == "hello\n"
    log = stepfs("log", str(m.workspace), "--json")
    assert b'"lean"' in log.stdout


@pytest.mark.mount
def test_step_of_a_workspace_with_live_mounts_commits_each_through_its_daemon(mount, workspace, tmp_path):
    a = mount(workspace, tmp_path / "a")
    b = mount(workspace, tmp_path / "b")
    (a.mountpoint / "from_a.txt").write_text("a\n")
    (b.mountpoint / "from_b.txt").write_text("b\n")
    done = _step_without_database(str(workspace), "both")
    assert done.returncode == 0, done.stderr
    assert (workspace / "from_a.txt").read_text() == "a\n"
    assert (workspace / "from_b.txt").read_text() == "b\n"
    assert len(done.stdout.split()) == 2  # two layers, one per mount
    # Nothing left: the same command reports it with its exit code.
    again = stepfs("step", str(workspace))
    assert again.returncode == 6, again.stderr


# -- the import budget of a harness's per-tool-call commands ----------------------------

#: Modules a command answered by a live mount's daemon must not load: the
#: database layer, FUSE, and the store's hashing and chunking (the daemon
#: has them; loading them is most of a start-up).  Checked by name, from
#: ``python -X importtime``, not by time.
HEAVY = ("sqlalchemy", "mfusepy", "xxhash", "pyfastcdc", "stepfs.store.workspace", "stepfs.store.db")


def _imported(*args: str, input: bytes | None = None) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Run ``stepfs ARGS`` under ``-X importtime``; its result and the names
    of every module it imported."""
    env = {k: v for k, v in os.environ.items() if k != "STEPFS_DIRECT"}
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "stepfs.cli.main", *map(str, args)],
                          capture_output=True, timeout=60, env=env, input=input)
    names = {line.rsplit("|", 1)[1].strip() for line in done.stderr.decode().splitlines()
             if line.startswith("import time:") and "|" in line}
    assert "stepfs.cli" in names, done.stderr.decode()[-2000:]  # runpy runs main as __main__
    return done, names


def _heavy(names: set[str]) -> list[str]:
    return sorted(n for n in names if any(n == h or n.startswith(h + ".") for h in HEAVY))


@pytest.mark.parametrize("args", [("--help",), ("--version",), ("step", "--help")])
def test_help_and_version_import_nothing_heavy(args):
    done, names = _imported(*args)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert _heavy(names) == []
    assert "importlib.metadata" not in names or args == ("--version",)


@pytest.mark.mount
def test_commands_through_a_live_mount_import_nothing_heavy(mount, workspace):
    m = mount(workspace)
    (m.mountpoint / "a.txt").write_text("a\n")
    payload = json.dumps({"cwd": str(m.mountpoint), "tool_name": "Edit", "tool_use_id": "t1"}).encode()
    runs = [
        (("step", m.mountpoint, "--allow-empty", "-m", "first"), None),
        (("hook-commit",), payload),
        (("status", m.mountpoint), None),
        (("status", m.workspace, "--json"), None),
        (("log", m.mountpoint), None),
        (("show", m.workspace, "1", "--patch"), None),
        (("discard", m.mountpoint, "nothing-staged-here"), None),
        (("step", m.mountpoint, "--allow-empty"), None),
    ]
    for args, stdin in runs:
        done, names = _imported(*args, input=stdin)
        assert done.returncode == 0, (args, done.stderr.decode()[-2000:])
        assert _heavy(names) == [], args
    log = json.loads(stepfs("log", m.workspace, "--json").stdout)
    # The hook's tool call changed nothing: no layer between the two steps.
    assert [layer["message"] for layer in log["layers"]][:2] == ["", "first"]


def test_without_a_live_mount_status_opens_the_store(workspace):
    """The other side of the budget: no daemon to ask, so the CLI opens the
    store itself (the import check above is not vacuous)."""
    from stepfs.store.workspace import Workspace

    Workspace.open(str(workspace), create=True).close()
    done, names = _imported("status", workspace)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert "sqlalchemy" in names


#: What ``log`` and ``show`` of a workspace with no live mount must not
#: load: they read the store through stdlib sqlite3 (store/cardrows.py).
NO_MOUNT_HEAVY = ("sqlalchemy", "mfusepy", "stepfs.store.workspace", "stepfs.store.db")


def test_log_and_show_without_a_mount_import_no_database_layer(tmp_path):
    from store_kit import Stager, open_workspace
    from stepfs.store import publish

    ws = tmp_path / "ws"
    w = open_workspace(ws, {"a.txt": ("file", 0o644, b"one\n")})
    try:
        st = Stager(w)
        st.file("a.txt", b"one\ntwo\n")
        st.file("b.txt", b"bee\n")
        publish.commit_step(w, st.step)
    finally:
        w.close()
    for args in (("log", ws), ("log", ws, "--json"), ("show", ws, "1"), ("show", ws, "1", "--json")):
        done, names = _imported(*args)
        assert done.returncode == 0, (args, done.stderr.decode()[-2000:])
        assert b"b.txt" in done.stdout or args[0] == "log"
        assert sorted(n for n in names if any(n == h or n.startswith(h + ".") for h in NO_MOUNT_HEAVY)) == [], args
    # A layer that does not exist: the same sentence and exit code as ever, still without the database layer.
    done, names = _imported("show", ws, "7")
    assert done.returncode == 11 and b"layer 7 does not exist" in done.stderr
    assert "sqlalchemy" not in names


def test_one_command_parser_still_knows_every_command():
    """The CLI builds only the parser of the command it runs; a mistyped
    command and the top-level help still get the whole one."""
    wrong = stepfs("stpe", "x")
    assert wrong.returncode == 2
    assert b"invalid choice: 'stpe'" in wrong.stderr and b"'hook-commit'" in wrong.stderr
    top = stepfs("--help")
    assert top.returncode == 0 and b"hook-commit" in top.stdout and b"rollback" in top.stdout
    sub = stepfs("step", "--help")
    assert sub.returncode == 0 and b"--allow-empty" in sub.stdout
    assert stepfs("step", "--bogus").returncode == 2
    version = stepfs("--version")
    assert version.returncode == 0 and version.stdout.startswith(b"stepfs ")


def test_log_of_a_shared_history_imports_no_database_layer(pg_url, tmp_path):
    """``stepfs log --history URL`` reads PostgreSQL through psycopg alone
    (store/shared/logread.py), its errors included."""
    from test_shared_log import _history

    for args in (("log", "--history", pg_url), ("log", "--history", pg_url, "--json", "--limit", "1")):
        done, names = _imported(*args)  # no history in the database yet: no schema either
        assert done.returncode == 20 and b"does not exist" in done.stderr, (args, done.stderr.decode()[-2000:])
        assert "sqlalchemy" not in names and "psycopg" in names, args
    _history(pg_url, 3)
    done, names = _imported("log", "--history", pg_url)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert [line.split()[0] for line in done.stdout.decode().splitlines()] == ["3", "2", "1", "0"]
    assert "files +1 ~1 -1" in done.stdout.decode()
    assert "sqlalchemy" not in names
    done, names = _imported("log", "--history", pg_url, "--json", "--limit", "2")
    assert done.returncode == 0 and [r["number"] for r in json.loads(done.stdout)["layers"]] == [3, 2]
    assert "sqlalchemy" not in names
    # No server at that socket: exit 19; a URL stepfs cannot use: exit 20; neither imports the database layer.
    nowhere = f"postgresql://nobody@/db?host={tmp_path}&name=proj"
    for url, code, said in ((nowhere, 19, b"cannot be reached"), ("mysql://u@h/d?name=p", 20, b"lives in PostgreSQL"),
                            ("postgresql://u@h:port/d?name=p", 20, b"port"), ("postgresql://u@h/d", 20, b"?name=NAME")):
        done, names = _imported("log", "--history", url)
        assert done.returncode == code and said in done.stderr, (url, done.stderr.decode()[-2000:])
        lines = [line for line in done.stderr.decode().splitlines() if not line.startswith("import time:")]
        assert len(lines) == 1, lines  # one sentence, no traceback
        assert "sqlalchemy" not in names, url
