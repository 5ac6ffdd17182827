"""The first minutes of a new user (issue 17): ``stepfs run`` in a project
directory, and ``stepfs --version``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import stepfs
from mountguard import private_tmp  # noqa: F401
from stepfs.overlayfs.client import mounts

MADE = b"is not a workspace yet; making it one"


@pytest.mark.mount
def test_run_in_a_plain_directory_makes_it_a_workspace_and_says_so_once(tmp_path, private_tmp):
    project = tmp_path / "myproject"
    project.mkdir()
    (project / "app.py").write_text("x = 1\n")
    r = stepfs("run", "-m", "tests", "--", "sh", "-c", "echo ok > result.txt", cwd=project)
    assert r.returncode == 0, r.stderr
    assert r.stderr.count(MADE) == 1, r.stderr
    assert (project / ".stepfs" / "store.db").is_file()
    assert (project / "result.txt").read_text() == "ok\n"
    log = json.loads(stepfs("log", project, "--json").stdout)
    assert [(row["number"], row["message"]) for row in log["layers"]][0] == (1, "tests")
    again = stepfs("run", "-m", "again", "--", "sh", "-c", "echo 2 >> result.txt", cwd=project)
    assert again.returncode == 0, again.stderr
    assert MADE not in again.stderr  # once: it is a workspace now
    assert mounts.stepfs_mounts(str(project.resolve())) == []


@pytest.mark.mount
def test_run_refuses_home_and_root_unless_named(tmp_path, private_tmp, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for where, words in ((home, b"your home directory"), ("/", b"/ is / and not a stepfs workspace")):
        r = stepfs("run", "--", "sh", "-c", "echo no > made.txt", cwd=where)
        assert r.returncode == 3, r.stderr
        assert words in r.stderr and b"insist with 'stepfs run " in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
    assert not (home / ".stepfs").exists() and not (home / "made.txt").exists()
    # Named, it is what the user asked for.
    r = stepfs("run", home, "--", "sh", "-c", "echo yes > made.txt", cwd=home)
    assert r.returncode == 0, r.stderr
    assert (home / "made.txt").read_text() == "yes\n" and (home / ".stepfs").is_dir()


def test_version_prints_the_package_version():
    from stepfs import __version__

    r = stepfs("--version")
    assert r.returncode == 0, r.stderr
    assert r.stdout.decode() == f"stepfs {__version__}\n"
    assert __version__ != "0+unknown"


def test_version_json_names_the_store_format_and_the_libfuse_in_use():
    from stepfs.store import schema

    r = stepfs("--version", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["store_format"] == schema.FORMAT_VERSION
    # The version fusermount3 reports is that of the libfuse3 package installed with it.
    fm = subprocess.run(["fusermount3", "--version"], capture_output=True, text=True)
    assert out["libfuse"] and out["libfuse"].split(".")[:2] == fm.stdout.split()[-1].split(".")[:2], fm.stdout


def test_version_imports_neither_the_database_layer_nor_mfusepy():
    code = ("import sys\nfrom stepfs.cli.main import main\nrc = main(['--version', '--json'])\n"
            "assert 'sqlalchemy' not in sys.modules and 'mfusepy' not in sys.modules, sorted(sys.modules)\n"
            "sys.exit(rc)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
