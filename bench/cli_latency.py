"""The ``cli`` group: what a harness pays per call of the ``stepfs``
command, as ratios to a bare ``python -c pass`` of the same interpreter.

Harnesses run ``stepfs step`` or ``stepfs hook-commit`` (and often
``stepfs status``) once or twice per agent tool call, so the command's
start-up is part of every checkpoint.  Each repetition runs the bare
interpreter and then every command once, so each command's ratio is taken
pair by pair under the same machine load; the median of those ratios is
what the targets compare (``report.evaluate``).  ``step``, ``hook-commit``
and ``status`` go through a live mount (answered by its daemon, which has
the store open); ``log`` and ``show`` read a workspace with no live mount
(the CLI opens the store itself).  Times are whole processes, wall clock.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from stepfs.overlayfs.client import manage

from . import fixtures, report
from .context import Context, log
from .targets import stepfs_mount

#: Command name -> the target its paired median ratio must meet (``<=``).
TARGETS = {"help": 2.0, "step": 2.0, "hook_commit": 2.0, "status": 2.0, "log": 5.0, "show": 5.0}


def stepfs_cli() -> list[str]:
    exe = Path(sys.executable).parent / "stepfs"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "stepfs.cli.main"]


def _wall(cmd: list[str], stdin: bytes | None = None) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, input=stdin, capture_output=True, check=True)
    return time.perf_counter() - t0


def _history(ws: Path, mnt: Path, steps: int) -> None:
    """A workspace with ``steps`` committed layers and no live mount."""
    with stepfs_mount(ws, mnt):
        target = manage.resolve(str(mnt))
        for i in range(steps):
            (mnt / fixtures.ws_path(i)).write_text(f"line {i}\nedited\n")
            manage.step(target, message=f"history {i}")


def cli(ctx: Context) -> dict:
    cfg = ctx.cfg
    cli_cmd = stepfs_cli()
    bare = [sys.executable, "-c", "pass"]
    base = ctx.new_dir("cli")
    quiet_ws = fixtures.workspace(base / "ws-quiet", 100)
    _history(quiet_ws, base / "mnt-quiet", 3)
    live_ws = fixtures.workspace(base / "ws-live", 100)
    mnt = base / "mnt-live"
    samples: dict[str, list[float]] = {name: [] for name in TARGETS}
    pairs: dict[str, list[float]] = {name: [] for name in TARGETS}
    python: list[float] = []
    with stepfs_mount(live_ws, mnt):
        payload = json.dumps({"cwd": str(mnt), "tool_name": "Edit", "tool_use_id": "bench",
                              "hook_event_name": "PostToolUse"}).encode()
        runs = {
            "help": lambda: _wall(cli_cmd + ["--help"]),
            "step": lambda: _wall(cli_cmd + ["step", str(mnt), "--allow-empty", "-m", "bench"]),
            "hook_commit": lambda: _wall(cli_cmd + ["hook-commit"], stdin=payload),
            "status": lambda: _wall(cli_cmd + ["status", str(mnt)]),
            "log": lambda: _wall(cli_cmd + ["log", str(quiet_ws)]),
            "show": lambda: _wall(cli_cmd + ["show", str(quiet_ws), "1"]),
        }
        for fn in list(runs.values()) + [lambda: _wall(bare)]:
            fn()  # warm-up: page cache, the daemon's first requests
        for rep in range(max(1, cfg.cli_reps)):
            (mnt / fixtures.ws_path(rep % 100)).write_text(f"hook edit {rep}\n")  # the hook's tool call wrote
            t_bare = _wall(bare)
            python.append(t_bare)
            for name, fn in runs.items():
                t = fn()
                samples[name].append(t)
                pairs[name].append(t / t_bare)
    out = {}
    for name, limit in TARGETS.items():
        ratio = statistics.median(pairs[name])
        results = {"stepfs": report.summary(samples[name]), "python -c pass": report.summary(python)}
        out[f"cli_{name}"] = {
            "description": f"'stepfs {name.replace('_', '-')}' whole process against 'python -c pass' "
                           f"(paired ratio, median; target <= {limit:g}x)",
            "kind": "time", "results": results, "ratios": {"stepfs/python (paired median)": ratio},
            "paired_ratio": ratio, "target_ratio": limit,
        }
        log(f"cli_{name}: {report.fmt_seconds(results['stepfs']['median'])}, {ratio:.2f}x python -c pass")
    return out
