"""`stepfs mount --auto-step close|idle:SECONDS`: steps without a harness."""

from __future__ import annotations

import json
import time

import pytest

from conftest import stepfs

pytestmark = pytest.mark.mount


def _layers(workspace) -> list[dict]:
    return json.loads(stepfs("log", "--json", workspace).stdout)["layers"]


def _wait_for_layers(workspace, count: int, deadline_s: float = 20.0) -> list[dict]:
    """Poll (bounded) for the policy thread's commit: it runs asynchronously."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        layers = _layers(workspace)
        if len(layers) >= count:
            return layers
        time.sleep(0.1)
    raise AssertionError(f"no auto step within {deadline_s} s: {_layers(workspace)}")


@pytest.mark.parametrize("policy", ["close", "idle:0.5"])
def test_auto_step_commits_by_itself(workspace, mount, policy):
    mp = mount(workspace, auto_step=policy).mountpoint
    (mp / "a.txt").write_text("one\n")
    layers = _wait_for_layers(workspace, 2)  # baseline + the auto step
    assert layers[0]["message"] == "auto step" and layers[0]["meta"] == {"auto_step": "1"}
    assert (workspace / "a.txt").read_text() == "one\n"
    (mp / "b.txt").write_text("two\n")
    _wait_for_layers(workspace, 3)
    assert (workspace / "b.txt").read_text() == "two\n"


def test_bad_auto_step_policy_is_a_usage_error(workspace, tmp_path):
    mp = tmp_path / "mnt"
    mp.mkdir()
    r = stepfs("mount", workspace, mp, "--auto-step", "sometimes")
    assert r.returncode == 2 and b"--auto-step takes manual, close or idle:SECONDS" in r.stderr
    assert not (workspace / ".stepfs").exists()
