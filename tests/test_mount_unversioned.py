"""Real-mount tier: unversioned trees (README "Unversioned paths") driven by
the tools that make them: an npm-like installer, ``python -m venv`` and
pip, pytest, ``rm -rf``, ``mv``; a step and a rollback around them; a
``.stepfsignore`` edited during the mount; ``--no-default-excludes``;
containment of the patterns."""

from __future__ import annotations

import json
import os
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import manifest, sh, stepfs, wait_for

pytestmark = pytest.mark.mount
NPM = Path(__file__).resolve().parents[1] / "bench" / "npm_like.py"


def status(m) -> dict:
    result = stepfs("status", m.mountpoint, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["mounts"][0]


def staged_paths(m) -> list[str]:
    return sorted(s["path"] for s in status(m)["staged"])


def inotify_watches(pid: int) -> int:
    """How many inotify watches the daemon holds (its fdinfo lists one line each)."""
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") != "anon_inode:inotify":
                continue
            with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                count += sum(1 for line in f if line.startswith("inotify wd:"))
        except OSError:
            continue
    return count


@pytest.mark.timeout(180)
def test_npm_like_install_rm_rf_and_mv(workspace, mount):
    (workspace / "package.json").write_text("{}\n")
    m = mount(workspace)
    watches_before = inotify_watches(m.pid)
    sh(f"{sys.executable} {NPM} node_modules --files 400", m.mountpoint)
    # Every file is in the workspace already, nothing is staged.
    files = [p for p in (workspace / "node_modules").rglob("*") if p.is_file()]
    assert len(files) == 400
    sh("find node_modules -type f | wc -l > /dev/null; ls -lR node_modules > /dev/null", m.mountpoint)
    assert staged_paths(m) == []
    st = status(m)
    assert st["unversioned"]["trees"] == ["/node_modules"]
    # The watcher watches none of the tree's directories (there are 100+).
    assert inotify_watches(m.pid) <= watches_before + 1
    # The mount shows exactly the workspace's tree.
    assert manifest(m.path("node_modules")) == manifest(workspace / "node_modules")
    # mv within the unversioned trees: a rename in the workspace.
    sh("mv node_modules/pkg-1 node_modules/pkg-1-old", m.mountpoint)
    assert (workspace / "node_modules/pkg-1-old/index.js").is_file()
    # mv out to a versioned name: EXDEV inside, mv copies and removes; the
    # copy is staged like any new file.
    sh("mv node_modules/pkg-2 vendored", m.mountpoint)
    assert not (workspace / "node_modules/pkg-2").exists() and not (workspace / "vendored").exists()
    assert "vendored/index.js" in staged_paths(m)
    # mv of the whole tree to another unversioned name: one rename.
    sh("mv node_modules .venv", m.mountpoint)
    assert (workspace / ".venv/pkg-3/index.js").is_file() and not (workspace / "node_modules").exists()
    # rm -rf of the whole tree succeeds and removes it from the workspace.
    sh("rm -rf .venv", m.mountpoint)
    assert not (workspace / ".venv").exists()
    assert not m.path(".venv").exists()
    assert status(m)["unversioned"]["trees"] == []
    # mv of a whole tree to a versioned name: mv copies (staged) and removes.
    sh(f"{sys.executable} {NPM} node_modules --files 40", m.mountpoint)
    moved = sorted("kept/" + str(p.relative_to(workspace / "node_modules"))
                   for p in (workspace / "node_modules").rglob("*") if p.is_file())
    sh("mv node_modules kept", m.mountpoint)
    assert not (workspace / "node_modules").exists() and not m.path("node_modules").exists()
    assert len(moved) == 40 and [p for p in staged_paths(m) if p in moved] == moved


@pytest.mark.timeout(300)
def test_venv_and_pip_install_of_a_local_wheel(workspace, mount, tmp_path):
    wheel = tmp_path / "tinypkg-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("tinypkg/__init__.py", "VALUE = 42\n")
        z.writestr("tinypkg-0.1.dist-info/METADATA", "Metadata-Version: 2.1\nName: tinypkg\nVersion: 0.1\n")
        z.writestr("tinypkg-0.1.dist-info/WHEEL",
                   "Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr("tinypkg-0.1.dist-info/RECORD", "")
    m = mount(workspace)
    sh(f"{sys.executable} -m venv .venv", m.mountpoint, timeout=240)
    sh(f".venv/bin/python -m pip install -q --no-index --no-deps {wheel}", m.mountpoint, timeout=240)
    out = sh(".venv/bin/python -c 'import tinypkg; print(tinypkg.VALUE)'", m.mountpoint)
    assert out.stdout.strip() == b"42"
    assert (workspace / ".venv/pyvenv.cfg").is_file()
    assert list((workspace / ".venv").rglob("tinypkg/__init__.py"))
    assert staged_paths(m) == []
    sh("rm -rf .venv", m.mountpoint)
    assert not (workspace / ".venv").exists()


@pytest.mark.timeout(180)
def test_pytest_caches_a_step_and_a_rollback(workspace, mount):
    (workspace / "calc.py").write_text("def add(a, b):\n    return a + b\n")
    (workspace / "test_calc.py").write_text("from calc import add\n\ndef test_add():\n    assert add(1, 2) == 3\n")
    m = mount(workspace)
    sh(f"env -u PYTHONDONTWRITEBYTECODE {sys.executable} -m pytest -q", m.mountpoint, timeout=120)
    assert list((workspace / "__pycache__").glob("*.pyc"))
    assert (workspace / ".pytest_cache").is_dir()
    assert staged_paths(m) == []
    # A versioned edit next to the caches: the layer holds it alone.
    m.path("calc.py").write_text("def add(a, b):\n    return b + a\n")
    result = stepfs("step", m.mountpoint, "-m", "edit", "--json")
    assert result.returncode == 0, result.stderr
    number = json.loads(result.stdout)["number"]
    card = json.loads(stepfs("show", workspace, str(number), "--json").stdout)
    assert [f["path"] for f in card["files"]] == ["calc.py"]
    sh(f"env -u PYTHONDONTWRITEBYTECODE {sys.executable} -m pytest -q", m.mountpoint, timeout=120)  # rewrites the caches
    caches = manifest(workspace / "__pycache__")
    result = stepfs("rollback", workspace, "0")
    assert result.returncode == 0, result.stderr
    assert m.path("calc.py").read_text() == "def add(a, b):\n    return a + b\n"
    assert manifest(workspace / "__pycache__") == caches  # untouched by the rollback
    assert m.path(".pytest_cache").is_dir()


@pytest.mark.timeout(120)
def test_stepfsignore_edited_during_the_mount(workspace, mount):
    m = mount(workspace)
    m.path("dist").mkdir()
    m.path("dist/a.js").write_text("a")
    assert "dist/a.js" in staged_paths(m)
    m.path(".stepfsignore").write_text("# build output\ngen-*/\n")
    n = [0]

    def a_new_tree_lands_in_the_workspace() -> bool:
        # A new top-level directory each time: one made before the rule
        # applied is staged, and so is everything made in it later.
        n[0] += 1
        m.path(f"gen-{n[0]}").mkdir()
        m.path(f"gen-{n[0]}/o.js").write_text("o")
        return (workspace / f"gen-{n[0]}/o.js").is_file()

    wait_for(a_new_tree_lands_in_the_workspace, what="the edited .stepfsignore to apply")
    assert status(m)["unversioned"]["stepfsignore"] == ["gen-*/"]
    staged = staged_paths(m)
    assert ".stepfsignore" in staged and f"gen-{n[0]}/o.js" not in staged
    # Removing the rule versions new trees again.
    m.path(".stepfsignore").write_text("\n")

    def a_new_tree_is_staged() -> bool:
        n[0] += 1
        m.path(f"gen-{n[0]}").mkdir()
        m.path(f"gen-{n[0]}/o.js").write_text("o")
        return not (workspace / f"gen-{n[0]}").exists()

    wait_for(a_new_tree_is_staged, what="the rule to go")
    assert f"gen-{n[0]}/o.js" in staged_paths(m)
    assert status(m)["unversioned"]["stepfsignore"] == []


@pytest.mark.timeout(120)
def test_no_default_excludes_and_exclude(workspace, mount):
    m = mount(workspace, default_excludes=False, excludes=["out/"])
    m.path("node_modules").mkdir()
    m.path("node_modules/x.js").write_text("x")
    m.path("out").mkdir()
    m.path("out/o.bin").write_text("o")
    assert not (workspace / "node_modules").exists()
    assert (workspace / "out/o.bin").read_text() == "o"
    assert staged_paths(m) == ["node_modules", "node_modules/x.js"]
    st = status(m)["unversioned"]
    assert st["defaults"] == [] and st["excludes"] == ["out/"]
    assert "unversioned (never staged, written to the workspace directly): 1" in m.path(".stepfs/status").read_text()


@pytest.mark.timeout(120)
def test_patterns_cannot_reach_outside_or_into_the_store(workspace, mount, tmp_path):
    decoy = tmp_path / "decoy"
    decoy.mkdir()
    mp = tmp_path / "mp"
    mp.mkdir()
    result = stepfs("mount", workspace, mp, "--exclude", "../decoy")
    assert result.returncode == 10 and b"'..' component" in result.stderr
    assert not os.path.ismount(mp)
    m = mount(workspace, excludes=[".stepfs/", "*", "/.."[1:] + "x"])
    # The store stays hidden and read-only whatever the patterns say.
    assert not any(p.name == "store.db" for p in m.path(".stepfs").iterdir())
    with pytest.raises(OSError):
        m.path(".stepfs/planted").write_text("x")
    assert not (workspace / ".stepfs/planted").exists()
    # '*' makes every new path unversioned: it lands in the workspace and
    # nowhere else.
    m.path("f.txt").write_text("f")
    assert (workspace / "f.txt").read_text() == "f"
    assert list(decoy.iterdir()) == []


@pytest.mark.timeout(120)
def test_a_directory_swapped_for_a_symlink_outside_is_not_followed(workspace, mount, tmp_path):
    """The watcher does not watch unversioned trees, so the kernel keeps
    its entry for a directory replaced behind its back; the daemon's
    contained resolution still refuses to go through the symlink."""
    decoy = tmp_path / "decoy"
    decoy.mkdir()
    m = mount(workspace)
    m.path("node_modules/pkg").mkdir(parents=True)
    m.path("node_modules/pkg/ok.js").write_text("ok")
    assert m.path("node_modules/pkg").is_dir()  # the kernel holds the entry now
    os.unlink(workspace / "node_modules/pkg/ok.js")
    os.rmdir(workspace / "node_modules/pkg")
    os.symlink(decoy, workspace / "node_modules/pkg")
    with pytest.raises(OSError):
        m.path("node_modules/pkg/escape.js").write_text("x")
    with pytest.raises(OSError):
        m.path("node_modules/pkg/sub").mkdir()
    assert list(decoy.iterdir()) == []


@pytest.mark.timeout(180)
def test_run_with_exclude(workspace, tmp_path):
    result = stepfs("run", workspace, "--exclude", "build/", "--json", "--",
                    "sh", "-c", "mkdir build && echo o > build/out.o && echo s > src.c", timeout=120)
    assert result.returncode == 0, result.stderr
    card = json.loads(result.stdout)["card"]
    assert [f["path"] for f in card["files"]] == ["src.c"]
    assert (workspace / "build/out.o").read_text() == "o\n"
    bad = stepfs("run", workspace, "--exclude", "a/../b", "--", "true")
    assert bad.returncode == 10 and b"'..' component" in bad.stderr


@pytest.mark.timeout(120)
def test_run_reusing_a_live_mount_says_its_excludes_do_not_apply(workspace, mount):
    m = mount(workspace)
    result = stepfs("run", workspace, "--exclude", "build/", "--json", "--",
                    "sh", "-c", "mkdir build && echo o > build/o", timeout=90)
    assert result.returncode == 0, result.stderr
    assert b"reused with its own unversioned paths" in result.stderr
    # The live mount's rules: build/ is versioned there, so the run's layer records it.
    card = json.loads(result.stdout)["card"]
    assert "build/o" in [f["path"] for f in card["files"]]
    assert m.path("build/o").read_text() == "o\n"
