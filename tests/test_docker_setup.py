"""The Docker image's install, tested without a Docker engine: the
Dockerfile's own steps (``docker/setup.sh``) run into a temporary prefix,
and the image's entry point command drives a real mount from that install."""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

from conftest import ROOT
from mountguard import private_tmp  # noqa: F401
from stepfs.overlayfs.client import api, mounts

DOCKER = ROOT / "docker"


def _clean_env() -> dict:
    """No PYTHONPATH: the installed command must not import the checkout."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    base = tmp_path_factory.mktemp("docker-setup")
    r = subprocess.run(["bash", str(DOCKER / "setup.sh"), "--prefix", str(base / "venv"), "--bin-dir",
                        str(base / "bin")], capture_output=True, text=True, timeout=300, cwd=base, env=_clean_env())
    assert r.returncode == 0, r.stderr
    assert "stepfs installed in" in r.stdout
    return base


def test_setup_installs_a_self_contained_stepfs(installed):
    stepfs = installed / "bin" / "stepfs"
    r = subprocess.run([str(stepfs), "--help"], capture_output=True, text=True, cwd=installed, env=_clean_env())
    assert r.returncode == 0, r.stderr
    assert "run" in r.stdout and "exit codes:" in r.stdout
    r = subprocess.run([str(installed / "venv" / "bin" / "python"), "-c", "import stepfs.cli, stepfs.store; print(stepfs.cli.__file__)"],
                       capture_output=True, text=True, cwd=installed, env=_clean_env())
    assert r.stdout.startswith(str(installed / "venv")), "the install imports the checkout, not its own copy"
    assert not (ROOT / "build").exists(), "setup.sh built inside the checkout"


@pytest.mark.mount
def test_the_images_entry_point_runs_an_agent(installed, workspace, private_tmp):
    """``stepfs run /workspace --mountpoint /mnt/agent -- CMD``, with the
    workspace and mountpoint in temporary directories."""
    (workspace / "app.py").write_text("print('v1')\n")
    entry = _entrypoint()
    assert entry[:2] == ["stepfs", "run"] and entry[-1] == "--"
    args = [str(installed / "bin" / "stepfs") if a == "stepfs" else a for a in entry]
    args = [str(workspace) if a == "/workspace" else str(private_tmp / "agent") if a == "/mnt/agent" else a
            for a in args]
    r = subprocess.run(args + ["sh", "-c", "sed -i s/v1/v2/ app.py && test \"$PWD\" = \"$STEPFS_MOUNT\""],
                       capture_output=True, text=True, cwd=workspace, env=_clean_env(), timeout=120)
    assert r.returncode == 0, r.stderr
    assert "layer 1 (step)" in r.stdout and "modified  app.py" in r.stdout
    assert (workspace / "app.py").read_text() == "print('v2')\n"
    assert api.open_workspace(workspace).head() == 1
    assert mounts.stepfs_mounts(str(workspace)) == []


def _entrypoint() -> list[str]:
    text = (DOCKER / "Dockerfile").read_text()
    (line,) = re.findall(r"^ENTRYPOINT (\[.*\])$", text, re.M)
    return json.loads(line)


def test_dockerfile_uses_the_tested_scripts_and_documents_the_run():
    text = (DOCKER / "Dockerfile").read_text()
    runs = " ".join(re.findall(r"^RUN (.*)$", text, re.M))
    assert "docker/install-system-deps.sh" in runs and "docker/setup.sh" in runs
    assert re.search(r"^FROM python:3\.1[1-9]-slim-\w+$", text, re.M), "a Debian-based Python image"
    for src in re.findall(r"^COPY (.+) \S+$", text, re.M):
        for path in src.split():
            assert (ROOT / path).exists(), f"the Dockerfile copies {path}, which does not exist"
    assert _entrypoint()[:3] == ["stepfs", "run", "/workspace"]
    compose = (DOCKER / "compose.yaml").read_text()
    for needle in ("/dev/fuse", "SYS_ADMIN", "dockerfile: docker/Dockerfile", ":/workspace", "init: true"):
        assert needle in compose
    # Compose interpolates every service for every command, profiles or not:
    # one required variable would stop the "shared" profile's commands too.
    assert not re.findall(r"\$\{\w+:?\?", compose), "a required variable in compose.yaml"
    usage = (DOCKER / "README.md").read_text()
    assert "--device /dev/fuse --cap-add SYS_ADMIN" in usage and "-v \"$PWD\":/workspace" in usage
