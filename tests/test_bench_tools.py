"""The bench's ``tools`` row (issue 19: the real-client workloads of the
suite's tool tests) still runs: every tool of ``bench/tools.py``, on the
native target only (no kernel, no mount, seconds), through the same
``run_workload`` the bench calls, at the smoke configuration's sizes.

It checks that every tool reports a time, that the total is their sum,
that the row and its target reach the printed table and the goals, and
that the run leaves the workspace's inputs it hard-linked unchanged.
"""

from __future__ import annotations

import hashlib
import shutil
import sys

import pytest

from conftest import ROOT

if str(ROOT) not in sys.path:  # the bench is a directory of the repository, not an installed package
    sys.path.insert(0, str(ROOT))
from bench import config, report, targets, tools, workloads  # noqa: E402
from bench.context import Context  # noqa: E402

GOAL = "in total: time <= 1.5x fuse-overlayfs"


def _digest(root) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.timeout(240)
def test_tools_workload_reports_every_tool_on_native(tmp_path):
    missing = [p for p in ("git", "sqlite3", "rsync", "diff", "tar", "make", "gcc") if shutil.which(p) is None]
    if missing:
        pytest.fail(f"{', '.join(missing)} missing: make deps installs them", pytrace=False)
    cfg = config.smoke()
    cfg.targets = ("native",)
    ctx = Context(cfg, tmp_path / "bench")
    ctx.tmp.mkdir()
    tools_row = next(w for w in workloads.WORKLOADS if w.name == "tools")
    inputs = tools.inputs(ctx)
    before = {k: _digest(inputs[k]) for k in ("pylib", "project", "cprog")}

    records = workloads.run_workload(ctx, tools_row, [targets.Native()])

    assert set(records) == {f"tools_{name}" for name, _ in tools.TOOLS} | {"tools_total"}
    times = {}
    for metric, rec in records.items():
        res = rec["results"]["native"]
        assert res["n"] == 1 and res["median"] > 0, metric
        times[metric] = res["median"]
    assert times.pop("tools_total") == pytest.approx(sum(times.values()))
    # the templates the workspace hard-links are untouched: sed -i replaced its files by rename,
    # compileall, pytest and make wrote new files only (on native they are the same inodes)
    assert {k: _digest(inputs[k]) for k in before} == before
    assert before["pylib"] and "calc.py" in before["project"]
    assert ctx.tmp.joinpath("cases").exists() and list(ctx.tmp.joinpath("cases").iterdir()) == []

    goals = {g.goal: g for g in report.evaluate(records)}
    goal = next(g for name, g in goals.items() if name.endswith(GOAL) and "real-client tools" in name)
    assert goal.value is None and goal.met is None  # no fuse-overlayfs in this run
    text = report.table({"targets": {"native": {"available": True}}, "workloads": records})
    for metric in records:
        assert metric in text
