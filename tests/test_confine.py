"""``stepfs run --confine`` and ``stepfs confine`` with real processes in
real mounts: writes inside land in the step, every way out fails with
EACCES and leaves the decoys byte-identical, real tools work confined,
``status`` says who is confined, a hooked agent steps per tool call, and
where Landlock is missing (really: a seccomp filter) ``--confine`` refuses.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from conftest import stepfs
from mountguard import private_tmp  # noqa: F401
from stepfs.overlayfs.client import manage
from stepfs.store import layers
from stepfs.store.workspace import Workspace

pytestmark = pytest.mark.mount
PROGS = Path(__file__).parent / "confine_progs"
CONFINE_EXIT = 18


def _last_json(stdout: bytes) -> dict:
    return json.loads(stdout.decode().strip().splitlines()[-1])


def _layers(ws) -> list[layers.Layer]:
    with Workspace.open(str(ws)) as w, w.db.read() as conn:
        return layers.list_layers(conn)


def _decoys(base: Path) -> dict[Path, bytes]:
    base.mkdir()
    found = {}
    for name in ("abs", "rel", "hl"):
        (base / name).write_bytes(f"decoy {name}\r\nkeep me\n".encode())
        found[base / name] = (base / name).read_bytes()
    return found


def test_confined_run_commits_inside_and_every_escape_fails(workspace, private_tmp):
    decoys_dir = private_tmp / "decoys"  # mount/sub/../.. is private_tmp
    decoys = _decoys(decoys_dir)
    (workspace / "a.txt").write_text("a\n")
    (workspace / "b.txt").write_text("b\n")
    (workspace / "sub").mkdir()
    (workspace / "link_abs").symlink_to(decoys_dir / "abs")
    (workspace / "sub" / "link_rel").symlink_to("../../decoys/rel")
    os.link(decoys_dir / "hl", workspace / "hl")  # a hard link made before the run
    mp = private_tmp / "mnt"
    r = stepfs("run", workspace, "--confine", "--json", "--mountpoint", mp, "--",
               sys.executable, PROGS / "escape.py", decoys_dir, workspace)
    assert r.returncode == 0, r.stderr.decode()
    results = json.loads(r.stdout.decode().splitlines()[0])
    status = results.pop("status")
    assert "confined: yes" in status and f"writes only beneath: {mp}" in status
    assert results == {
        "inside": "ok", "inside_subdir": "ok", "hardlink_in_mount": "ok", "tmpdir": "ok", "dev_null": "ok",
        "absolute": "EACCES", "symlink_absolute": "EACCES", "symlink_relative": "EACCES", "dotdot": "EACCES",
        "hardlink_in_workspace": "EACCES", "workspace_file": "EACCES", "store": "EACCES",
        # rename(2) across filesystems is EXDEV before any permission check;
        # mv then copies, and the copy is refused.
        "rename_out": "EXDEV", "mv_out": "EACCES",
        "rename_decoy": "EACCES", "unlink_decoy": "EACCES", "truncate_decoy": "EACCES",
        "mkdir_outside": "EACCES", "link_decoy_into_tmp": "EXDEV",
        "child_process": "EACCES", "grandchild_process": "EACCES",
    }
    for path, data in decoys.items():
        assert path.read_bytes() == data, f"{path} changed"
    assert sorted(p.name for p in decoys_dir.iterdir()) == ["abs", "hl", "rel"]
    # The run's in-mount changes were committed as one layer, escapes or not.
    out = _last_json(r.stdout)
    assert out["confined"]["confined"] is True and out["confined"]["abi"] >= 1
    assert {(f["op"], f["path"]) for f in out["card"]["files"]} == {
        ("added", "inside.txt"), ("added", "new"), ("added", "new/deeper"), ("added", "new/deeper/f"),
        ("modified", "hl")}
    assert (workspace / "inside.txt").read_bytes() == b"ESCAPED\n"
    assert (workspace / "a.txt").read_text() == "a\n" and (workspace / "b.txt").read_text() == "b\n"
    assert max(lay.number for lay in _layers(workspace)) == out["number"] == 1
    assert not any(p.name.startswith("stepfs-confine-") for p in private_tmp.iterdir()), "TMPDIR left behind"


def _wheel(directory: Path) -> Path:
    """A minimal pure-Python wheel (PEP 427), made here: no network, no build tool."""
    path = directory / "confinedemo-1.0-py3-none-any.whl"
    files = {
        "confinedemo/__init__.py": "VALUE = 42\n",
        "confinedemo-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: confinedemo\nVersion: 1.0\n",
        "confinedemo-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                           "Tag: py3-none-any\n",
    }
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
        z.writestr("confinedemo-1.0.dist-info/RECORD",
                   "".join(f"{n},,\n" for n in files) + "confinedemo-1.0.dist-info/RECORD,,\n")
    return path


def test_git_venv_pip_and_pytest_work_confined(workspace, mount, tmp_path):
    # 'venv --without-pip' and the outer pip: ensurepip's thousands of
    # small files take half a minute through any FUSE daemon, confined or not.
    wheel = _wheel(tmp_path)
    m = mount(workspace)
    script = f"""set -e
git init -q -b main repo && cd repo
git config user.email t@example.com && git config user.name t
echo 'def test_ok(): assert 1 + 1 == 2' > test_one.py
git add test_one.py && git commit -qm one
echo '# two' >> test_one.py && git commit -qam two && git log --oneline | wc -l > ../commits.txt
cd ..
{sys.executable} -m venv --without-pip venv
{sys.executable} -m pip --python venv/bin/python install -q --no-index --no-cache-dir \
    --disable-pip-version-check {wheel}
venv/bin/python -c 'import confinedemo; print(confinedemo.VALUE)' > value.txt
cd repo && {sys.executable} -m pytest -q test_one.py > ../pytest.txt 2>&1
"""
    started = time.monotonic()
    r = stepfs("confine", m.mountpoint, "--", "bash", "-c", script, timeout=110)
    took = time.monotonic() - started
    assert r.returncode == 0, (r.stderr.decode()[-3000:], m.path("pytest.txt").exists()
                               and m.path("pytest.txt").read_text())
    assert m.path("commits.txt").read_text().strip() == "2"
    assert m.path("value.txt").read_text() == "42\n"
    assert "1 passed" in m.path("pytest.txt").read_text()
    assert (m.path("venv") / "bin" / "python").exists()
    print(f"git + venv + pip + pytest confined: {took:.1f} s")


def test_status_says_whether_a_run_is_confined(workspace, mount, tmp_path):
    m = mount(workspace)
    fifo = tmp_path / "go"
    os.mkfifo(fifo)

    def wait_for(path: Path) -> None:
        deadline = time.monotonic() + 30
        while not path.exists():
            assert time.monotonic() < deadline, f"{path} never appeared"
            time.sleep(0.02)

    def mount_status(cli: bool = False) -> dict:
        if cli:  # the command's JSON once; the library call behind it otherwise (no interpreter start)
            r = stepfs("status", "--json", m.mountpoint)
            assert r.returncode == 0, r.stderr
            st = json.loads(r.stdout)
        else:
            st = manage.status(manage.resolve(str(m.mountpoint)))
        (entry,) = st["mounts"]
        return entry

    entry = mount_status()
    assert entry["confined"] is None and entry["runs"] == []
    assert "confined: unknown" in m.path(".stepfs", "status").read_text()
    for confined, name in ((True, "c"), (False, "u")):
        args = ("confine", m.mountpoint) if confined else ("run", m.mountpoint)
        proc = subprocess.Popen(
            [sys.executable, "-m", "stepfs.cli.main", *map(str, args), "--", "sh", "-c",
             f"cat .stepfs/status > {name}.status; read line < {fifo}"],
            cwd=m.mountpoint)
        try:
            wait_for(m.path(f"{name}.status"))
            entry = mount_status(cli=confined)
            assert entry["confined"] is confined
            (run,) = entry["runs"]
            assert run["confined"] is confined and run["command"][:2] == ["sh", "-c"]
            if confined:
                assert run["writable"][0] == str(m.mountpoint) and run["readable"] == "everywhere"
            with open(fifo, "w") as f:
                f.write("go\n")
            assert proc.wait(30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        text = m.path(f"{name}.status").read_text()
        assert ("confined: yes" if confined else "confined: no") in text
    assert mount_status()["runs"] == [], "runs whose process ended are forgotten"


def test_confined_agent_with_hooks_steps_per_tool_call(workspace, private_tmp):
    """The documented way: 'stepfs run --confine -- AGENT' with the hook
    committing after each tool call.  The fake agent is a script that edits
    files and calls 'stepfs hook-commit' as Claude Code's PostToolUse hook
    would (payload on stdin); one of its tool calls tries to write outside."""
    decoys = _decoys(private_tmp / "decoys")
    (workspace / "app.py").write_text("print('v1')\n")
    r = stepfs("run", workspace, "--confine", "--json", "--", sys.executable, PROGS / "fake_agent.py",
               private_tmp / "decoys" / "abs")
    assert r.returncode == 0, r.stderr.decode()
    agent_out = json.loads(r.stdout.decode().splitlines()[0])
    assert agent_out["escape"] == "EACCES"
    assert agent_out["hooks"] == [0, 0, 0], "every hook-commit succeeded from inside the confinement"
    for path, data in decoys.items():
        assert path.read_bytes() == data
    tool_layers = sorted((lay for lay in _layers(workspace) if lay.meta.get("tool_use_id")),
                         key=lambda lay: lay.number)
    assert [lay.meta["tool_use_id"] for lay in tool_layers] == ["toolu_1", "toolu_3"]
    assert [lay.message for lay in tool_layers] == ["Edit: app.py", "Bash: echo notes > notes.txt"]
    assert (workspace / "app.py").read_text() == "print('v2')\n"
    assert (workspace / "notes.txt").read_text() == "notes\n"
    assert _last_json(r.stdout)["number"] is None, "everything was committed by the hooks"


def test_narrowed_reads_and_network(workspace, mount, tmp_path):
    """--allow-read narrows reads to the system, the mount and the named
    paths; --allow-connect denies every TCP connect and bind but its port."""
    (tmp_path / "readable").mkdir()
    (tmp_path / "readable" / "ok.txt").write_text("ok")
    (tmp_path / "secret.txt").write_text("secret")
    m = mount(workspace)
    listeners = [socket.create_server(("127.0.0.1", 0)) for _ in range(2)]
    try:
        ports = [s.getsockname()[1] for s in listeners]
        r = stepfs("confine", m.mountpoint, "--allow-read", tmp_path / "readable", "--allow-connect", ports[0],
                   "--", sys.executable, PROGS / "narrow.py", tmp_path / "readable" / "ok.txt",
                   tmp_path / "secret.txt", *ports)
    finally:
        for s in listeners:
            s.close()
    assert r.returncode == 0, r.stderr.decode()
    assert json.loads(r.stdout) == {
        "read_allowed": "ok", "read_denied": "EACCES", "read_system": "ok", "write_mount": "ok",
        "connect_allowed": "ok", "connect_denied": "EACCES", "bind": "EACCES"}


def test_confine_refuses_without_landlock(workspace, mount, private_tmp):
    """Landlock made really unavailable: a seccomp filter fails its system
    calls with ENOSYS for stepfs and everything it starts."""
    launcher = [sys.executable, str(Path(__file__).parent / "nolandlock.py"), sys.executable, "-m", "stepfs.cli.main"]
    env = dict(os.environ)

    def under_filter(*args) -> subprocess.CompletedProcess:
        return subprocess.run([*launcher, *map(str, args)], capture_output=True, env=env, timeout=60)

    r = under_filter("run", workspace, "--confine", "--", "touch", "marker")
    assert r.returncode == CONFINE_EXIT, r.stderr
    lines = r.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and "Landlock" in lines[0] and "seccomp" in lines[0], lines
    assert not (workspace / "marker").exists() and not (workspace / ".stepfs").exists(), "nothing touched"
    assert not any(private_tmp.iterdir()), "nothing was mounted"

    m = mount(workspace)
    r = under_filter("confine", m.mountpoint, "--", "touch", "marker")
    assert r.returncode == CONFINE_EXIT and not m.path("marker").exists(), r.stderr
    # Without --confine stepfs keeps working where Landlock is missing.
    r = under_filter("run", m.mountpoint, "--", "touch", "marker")
    assert r.returncode == 0 and (workspace / "marker").exists(), r.stderr
