"""The benchmark suite still runs: ``bench/run.py --smoke`` end to end.

A tiny configuration (untar of 40 files, a 1-file commit in a 200-file
workspace; native and stepfs only) through the real entry point, so the
suite cannot rot between benchmark runs.  Its numbers mean nothing; the test
asserts the shape of the JSON a real run writes, and that the run left no
mount and no temp data behind.

The bench mounts through its own code (``bench/targets.py``, which unmounts
in ``finally``), not through the ``mount`` fixture: mounting is what is
under test.  The watchdog duty of the fixture is done here: on a timeout
the FUSE connections below ``tmp_path`` are aborted before the bench is
terminated, and anything still mounted there is detached afterwards.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from stepfs.overlayfs.client import manage, mounts

from conftest import ROOT, fuse_problem

RUN_TIMEOUT = 90  # below pytest-timeout's 120 s


def _mounts_below(path) -> list[mounts.MountEntry]:
    prefix = os.path.realpath(path).rstrip("/") + "/"
    return [m for m in mounts.table() if m.mountpoint.startswith(prefix)]


def _detach_below(path) -> None:
    for m in reversed(_mounts_below(path)):
        manage.abort_connection(m.mountpoint)
        subprocess.run(["fusermount3", "-u", "-z", m.mountpoint], capture_output=True)


@pytest.mark.mount
def test_bench_smoke_writes_results(tmp_path):
    problem = fuse_problem()
    if problem:
        pytest.fail(f"REAL-MOUNT TEST CANNOT RUN: {problem}", pytrace=False)
    out, scratch = tmp_path / "results", tmp_path / "scratch"
    scratch.mkdir()
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "bench" / "run.py"), "--smoke", "--out", str(out), "--tmp", str(scratch)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    try:
        stdout, _ = proc.communicate(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        _detach_below(scratch)  # unblock clients stuck in a hung mount first
        proc.terminate()
        stdout, _ = proc.communicate(timeout=20)
        pytest.fail(f"the smoke bench did not finish in {RUN_TIMEOUT} s:\n{stdout.decode(errors='replace')}")
    finally:
        left = _mounts_below(scratch)
        _detach_below(scratch)
    text = stdout.decode(errors="replace")
    assert proc.returncode == 0, text
    assert not left, f"the bench left mounts behind: {left}"
    assert os.listdir(scratch) == [], "the bench left its temp root behind"

    files = list(out.glob("*-smoke.json"))
    assert len(files) == 1, files
    result = json.loads(files[0].read_text())
    assert result["mode"] == "smoke"
    assert result["errors"] == []
    for key in ("schema", "started", "machine", "config", "targets", "workloads", "goals", "duration_s",
                "stepfs_fuse_options", "guard_toggle"):
        assert key in result, key
    assert {n for n, t in result["targets"].items() if t["available"]} == {"native", "stepfs"}

    untar = result["workloads"]["untar"]
    for target in ("native", "stepfs"):
        res = untar["results"][target]
        assert res["n"] == 1 and res["median"] > 0 and len(res["samples"]) == 1
        assert set(res) >= {"median", "p95", "min", "max"}
    assert untar["ratios"]["stepfs/native"] == pytest.approx(
        untar["results"]["stepfs"]["median"] / untar["results"]["native"]["median"])

    commit = result["workloads"]["commit_1_200files"]
    assert commit["kind"] == "latency"
    assert commit["results"]["stepfs"]["n"] == 2 and commit["results"]["stepfs"]["p95"] > 0
    assert result["workloads"]["commit_cli"]["results"]["stepfs"]["median"] > 0

    goals = {g["goal"]: g for g in result["goals"]}
    untar_goal = goals["untar: time <= 1.5x fuse-overlayfs"]
    assert untar_goal["met"] is None and untar_goal["value"] is None  # no fuse-overlayfs in a smoke run

    assert "stepfs/native" in text and "targets of the issue:" in text
