"""Install as users install (issue 17): a built wheel in a fresh virtualenv
outside the checkout, and ``make demo`` from a fresh checkout.

These run pip against the package index the machine is configured for
(PyPI on CI), so they take a minute or two; they mount (through the
installed ``stepfs``), and ``private_tmp`` makes sure nothing stays mounted.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT
from mountguard import private_tmp  # noqa: F401

pytestmark = [pytest.mark.mount, pytest.mark.timeout(900)]


def _run(cmd, cwd, timeout=600, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    """The project's files (tracked and new, as git sees them) copied to a
    fresh directory: no .venv, no build output, nothing of this machine,
    and no tests/ (neither the wheel nor `make demo` needs them, and a copy
    of the crash check's sources, left behind by a run killed before the
    cleanup, reads like daemon logs to a search for "Fatal Python error").
    Removed after the module: its virtualenv is hundreds of MB."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout.split(b"\0")
    dest = tmp_path_factory.mktemp("checkout") / "stepfs"
    for rel in filter(None, files):
        if rel.startswith(b"tests/"):
            continue
        src = ROOT / os.fsdecode(rel)
        if src.is_file():
            target = dest / os.fsdecode(rel)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(src.read_bytes())
            target.chmod(src.stat().st_mode & 0o777)
    try:
        yield dest
    finally:
        shutil.rmtree(dest.parent, ignore_errors=True)


def test_the_built_wheel_installs_and_runs_outside_the_checkout(checkout, tmp_path, private_tmp):
    wheels = tmp_path / "wheels"
    built = _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", wheels, "."], cwd=checkout)
    assert built.returncode == 0, built.stderr
    (wheel,) = wheels.glob("stepfs-*.whl")
    venv = tmp_path / "users-venv"  # a fresh interpreter environment: no system site-packages
    assert _run([sys.executable, "-m", "venv", venv], cwd=tmp_path).returncode == 0
    installed = _run([venv / "bin" / "python", "-m", "pip", "install", "-q", wheel], cwd=tmp_path)
    assert installed.returncode == 0, installed.stderr
    home = tmp_path / "user"
    home.mkdir()
    stepfs = venv / "bin" / "stepfs"  # the entry point the wheel declares

    # The installed package, not the checkout, and its package data.
    where = _run([venv / "bin" / "python", "-c",
                  "import stepfs, importlib.resources as r; print(stepfs.__file__); "
                  "print(r.files('stepfs.store').joinpath('FORMAT.md').read_text()[:200])"], cwd=home)
    assert where.returncode == 0, where.stderr
    assert where.stdout.startswith(str(venv)), where.stdout
    assert "stepfs store" in where.stdout.lower(), where.stdout

    version = _run([stepfs, "--version"], cwd=home)
    assert version.returncode == 0 and re.fullmatch(r"stepfs \d+\.\d+\.\d+\n", version.stdout), version

    ws, mnt = home / "project", private_tmp / "agent"
    ws.mkdir()
    mnt.mkdir()
    (ws / "README").write_text("hello\n")
    r = _run([stepfs, "mount", ws, mnt], cwd=home, timeout=60)
    assert r.returncode == 0, r.stderr
    try:
        (mnt / "added.txt").write_text("from the agent\n")
        step = _run([stepfs, "step", mnt, "-m", "installed"], cwd=home, timeout=60)
        assert step.returncode == 0 and step.stdout.strip() == "1", step.stderr
    finally:
        done = _run([stepfs, "unmount", mnt], cwd=home, timeout=60)
    assert done.returncode == 0, done.stderr
    assert (ws / "added.txt").read_text() == "from the agent\n"
    verify = _run([stepfs, "verify", ws], cwd=home, timeout=120)
    assert verify.returncode == 0 and verify.stdout.startswith("checked "), verify.stdout + verify.stderr


def test_make_demo_shows_the_demo_and_nothing_before_it(checkout, private_tmp):
    """A fresh checkout: `make demo` creates the virtualenv and installs into
    it; pip's and setuptools' chatter stays in .venv/install.log."""
    demo_dir = private_tmp / "demo"
    r = _run(["make", "-s", "demo", f"PYTHON={sys.executable}"], cwd=checkout, timeout=900,
             env={"STEPFS_DEMO_DIR": str(demo_dir)})
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    first = out.lstrip("\n").splitlines()[0]
    assert "== mount the workspace for the agent" in first, out[:3000]
    for noise in ("WARNING", "Warning", "setuptools", "pip ", "DEPRECATION"):
        assert noise not in out, f"{noise!r} in the demo's output:\n{out[:3000]}"
    assert out.rstrip().endswith("demo finished: no mount left (0 stepfs mounts of the demo's)"), out[-500:]
    assert (checkout / ".venv" / "install.log").is_file()
