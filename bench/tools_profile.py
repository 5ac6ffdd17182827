"""Where the stepfs daemon spends its time during each real-client tool of
the ``tools`` row (``bench/tools.py``), one py-spy profile per tool.

``python -m bench.tools_profile [--tools rsync_diff,tar] [--quick]`` (root)
mounts one stepfs case as the bench does, runs every tool in the bench's
order (so each meets the mount in the state the bench leaves it in) and
attaches py-spy to the daemon around the chosen ones only; it prints, per
tool, the wall time, the daemon's CPU time and its busiest frames
(``bench/profiler.py``), with the load average before and after.  The
``--profile tools`` option of ``bench/run.py`` profiles the whole row at once.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "bench"

from bench import config, profiler, targets, tools  # noqa: E402
from bench.context import Context, log, timed  # noqa: E402


def profile(ctx: Context, names: tuple[str, ...]) -> dict:
    spy = profiler.py_spy()
    if spy is None:
        raise SystemExit("bench: py-spy is not installed (bench/install-deps.sh installs it)")
    target = targets.Stepfs()
    case = ctx.new_dir("profile", "tools")
    (case / "lower").mkdir()
    scratch = ctx.new_dir("profile", "scratch")
    env = tools.tool_env()
    out: dict[str, dict] = {}
    try:
        tools.prepare(ctx, case / "lower")
        commands = tools.commands(tools.inputs(ctx), ctx.cfg.tools_sqlite_rows, scratch)
        with target.mounted(case) as mp:
            for name, cmd in commands:
                if name not in names:
                    log(f"{name}: {timed(cmd, mp, env):.2f} s (not profiled)")
                    continue
                out[name] = profiler.record(spy, target.pid, case.parent / f"{name}.raw.txt",
                                            lambda cmd=cmd: timed(cmd, mp, env))
                log(f"{name}: daemon CPU {out[name]['daemon_cpu_s']:.2f} s of {out[name]['wall_s']:.2f} s wall")
    finally:
        shutil.rmtree(case.parent, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tools", default=",".join(n for n, _ in tools.TOOLS),
                   help="comma-separated tools to profile (default: all): " + ",".join(n for n, _ in tools.TOOLS))
    p.add_argument("--quick", action="store_true", help="the quick bench's sizes (the default: the full run's)")
    p.add_argument("--tmp", default=None, help="parent of the temp root (default: the system temp dir)")
    args = p.parse_args(argv)
    names = tuple(s.strip() for s in args.tools.split(",") if s.strip())
    unknown = sorted(set(names) - {n for n, _ in tools.TOOLS})
    if unknown:
        raise SystemExit(f"bench: unknown tool(s) {', '.join(unknown)}")
    if os.geteuid() != 0:
        raise SystemExit("bench: run as root (FUSE mounts).")
    cfg = config.quick() if args.quick else config.full()
    tmp = Path(tempfile.mkdtemp(prefix="stepfs-tools-profile-", dir=args.tmp))
    load0 = os.getloadavg()
    try:
        result = profile(Context(cfg, tmp), names)
    finally:
        targets.sweep(tmp)
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"load average {load0[0]:.2f} -> {os.getloadavg()[0]:.2f}")
    print(profiler.text(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
