"""The stepfs benchmark suite: ``make bench`` or ``python bench/run.py [--quick]``.

One run measures stepfs and its references (native directory, kernel
overlayfs, fuse-overlayfs, a bare mfusepy passthrough) on the same machine,
prints a table of medians with the ratio of stepfs to each reference and
the issue's targets marked met / not met, and writes everything (raw
samples included) to ``bench-results/<timestamp>.json``.

Safety: all data lives under one temp root; every mount is made through
``bench.targets`` and unmounted in ``finally``; on the way out anything
still mounted below the temp root (an unmount that failed) is detached
before the root is removed.  SIGTERM and SIGHUP unwind like Ctrl-C, so
``finally`` blocks run.  The bench needs root (kernel overlayfs,
``drop_caches``, FUSE mounts) and is not part of ``make test``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "bench"

from bench import config as config_mod  # noqa: E402
from bench import native_cost, profiler, report, stepfs_cases, targets, workloads  # noqa: E402
from bench.context import ROOT, Context, log  # noqa: E402

GUARD_ENV = "STEPFS_GUARD"


def guard_toggle_available() -> bool:
    """True once the version-token work ships a ``STEPFS_GUARD=0`` switch
    (looked up in the daemon's sources, so the bench follows main)."""
    for pkg in ("overlayfs", "store"):
        for path in (ROOT / pkg).rglob("*.py"):
            if GUARD_ENV in path.read_text(errors="replace"):
                return True
    return False


class GuardOff(targets.Stepfs):
    name = "stepfs-guard-off"
    description = f"stepfs with {GUARD_ENV}=0 (close-write guard disabled)"

    def mounted(self, case, env=None):
        return super().mounted(case, {**(env or {}), GUARD_ENV: "0"})


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/run.py", description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="64 MiB big file, fewer repetitions")
    mode.add_argument("--smoke", action="store_true", help="tiny sizes, untar + commit, native + stepfs only "
                                                           "(keeps the suite from rotting; numbers mean nothing)")
    p.add_argument("--size-mib", type=int, help="size of the sequential read/write file (default 512, quick 64)")
    p.add_argument("--reps", type=int, help="repetitions of each side-by-side workload")
    p.add_argument("--only", help="comma-separated workloads/groups: " + ",".join(
        [w.name for w in workloads.WORKLOADS] + list(stepfs_cases.GROUPS)))
    p.add_argument("--targets", help="comma-separated targets (default: all available): " + ",".join(targets.ALL))
    p.add_argument("--profile", nargs="?", const=",".join(profiler.PROFILED), default=None, metavar="WORKLOADS",
                   help="py-spy profile of the stepfs daemon during side-by-side workloads (default: "
                        + ",".join(profiler.PROFILED) + ") and a cProfile of commits")
    p.add_argument("--out", default=str(ROOT / "bench-results"), help="directory for the JSON results")
    p.add_argument("--tmp", default=None, help="parent of the temp root (default: the system temp dir)")
    return p.parse_args(argv)


def build_config(args: argparse.Namespace) -> config_mod.Config:
    cfg = config_mod.smoke() if args.smoke else config_mod.quick() if args.quick else config_mod.full()
    if args.size_mib:
        cfg.big_mib = args.size_mib
    if args.reps:
        cfg.reps = args.reps
    if args.only:
        cfg.only = tuple(s.strip() for s in args.only.split(",") if s.strip())
    if args.targets:
        cfg.targets = tuple(s.strip() for s in args.targets.split(",") if s.strip())
    order = list(targets.ALL)
    cfg.targets = tuple(sorted(cfg.targets, key=lambda t: order.index(t) if t in order else len(order)))
    side_by_side = {w.name for w in workloads.WORKLOADS}
    cfg.profile = tuple(s.strip() for s in args.profile.split(",") if s.strip()) if args.profile else ()
    bad = [n for n in cfg.profile if n not in side_by_side]
    if bad:
        raise SystemExit(f"bench: cannot profile {', '.join(bad)}; choose from {', '.join(sorted(side_by_side))}.")
    known = side_by_side | set(stepfs_cases.GROUPS)
    unknown = [n for n in cfg.only if n not in known]
    if unknown:
        raise SystemExit(f"bench: unknown workload(s) {', '.join(unknown)}; choose from {', '.join(sorted(known))}.")
    bad = [t for t in cfg.targets if t not in targets.ALL]
    if bad:
        raise SystemExit(f"bench: unknown target(s) {', '.join(bad)}; choose from {', '.join(targets.ALL)}.")
    return cfg


def machine() -> dict:
    def version(cmd: list[str]) -> str | None:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.strip().splitlines()[0]
        except (OSError, IndexError, subprocess.SubprocessError):
            return None

    def read(path: str) -> str | None:
        try:
            with open(path) as f:
                return f.read().strip()
        except OSError:
            return None

    return {
        "hostname": platform.node(), "kernel": platform.release(), "cpus": os.cpu_count(),
        # How an idle CPU waits: where it halts without polling, every FUSE
        # round trip pays for waking it (bench/README.md).
        "cpuidle": read("/sys/devices/system/cpu/cpuidle/current_driver"),
        "guest_halt_poll_ns": read("/sys/module/haltpoll/parameters/guest_halt_poll_ns"),
        "stepfs_spin_us": os.environ.get("STEPFS_SPIN_US"),
        "python": platform.python_version(), "loadavg_start": os.getloadavg(),
        "fuse_overlayfs": version(["fuse-overlayfs", "--version"]),
        "git": version(["git", "--version"]),
        "git_commit": version(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"]),
    }


def _wanted(cfg: config_mod.Config, name: str) -> bool:
    return not cfg.only or name in cfg.only


def run(cfg: config_mod.Config, tmp: Path) -> dict:
    ctx = Context(cfg, tmp)
    result: dict = {"schema": 1, "mode": cfg.mode, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                    "machine": machine(), "config": cfg.to_json(),
                    "stepfs_fuse_options": targets.stepfs_fuse_options(), "targets": {}, "workloads": {},
                    "errors": []}
    chosen: list[targets.Target] = []
    for name in cfg.targets:
        t = targets.ALL[name]()
        problem = t.problem()
        result["targets"][name] = {"description": t.description, "available": problem is None, "problem": problem}
        if problem:
            log(f"skipping target {name}: {problem}")
        else:
            chosen.append(t)
    guard_toggle = guard_toggle_available()
    result["guard_toggle"] = guard_toggle
    result["native_cost"] = native_cost.measure(tmp)
    log(native_cost.text(result["native_cost"]))
    t_start = time.perf_counter()

    def attempt(name: str, fn) -> None:
        log(f"running {name} ...")
        try:
            result["workloads"].update(fn())
        except Exception as exc:
            traceback.print_exc()
            result["errors"].append(f"{name}: {type(exc).__name__}: {exc}")
            result["workloads"].setdefault(name, {"description": name, "kind": "time", "results": {},
                                                  "ratios": {}, "status": f"error: {exc}"})

    for w in workloads.WORKLOADS:
        if not _wanted(cfg, w.name):
            continue
        ts = list(chosen)
        if w.name == "close_write_4k" and guard_toggle and any(t.name == "stepfs" for t in ts):
            ts.append(GuardOff())
        attempt(w.name, lambda w=w, ts=ts: workloads.run_workload(ctx, w, ts))
        if w.name == "close_write_4k" and "close_write_4k" in result["workloads"]:
            _guard_cost(result["workloads"]["close_write_4k"], guard_toggle)

    if any(t.name == "stepfs" for t in chosen):
        for group, fn in stepfs_cases.GROUPS.items():
            if _wanted(cfg, group):
                attempt(group, lambda fn=fn: fn(ctx))
        if cfg.profile:
            log("profiling the stepfs daemon ...")
            result["profile"] = profiler.profile(ctx, cfg.profile)
            try:
                result["profile"]["commit"] = profiler.profile_commit(ctx)
            except Exception as exc:
                traceback.print_exc()
                result["profile"]["commit"] = {"status": f"failed: {exc}"}
    result["goals"] = [g.to_json() for g in report.evaluate(result["workloads"])]
    result["duration_s"] = time.perf_counter() - t_start
    result["machine"]["loadavg_end"] = os.getloadavg()
    return result


def _guard_cost(rec: dict, toggle: bool) -> None:
    res = rec.get("results", {})
    if not toggle or "stepfs-guard-off" not in res or not res.get("stepfs", {}).get("p95"):
        rec["guard_added_p50"] = rec["guard_added_p95"] = None
        rec["note"] = "guard toggle not available"
        return
    on, off = res["stepfs"], res["stepfs-guard-off"]
    rec["guard_added_p50"] = on["median"] - off["median"]
    rec["guard_added_p95"] = on["p95"] - off["p95"]
    rec["note"] = (f"guard adds p50 {report.fmt_seconds(rec['guard_added_p50'])}, "
                   f"p95 {report.fmt_seconds(rec['guard_added_p95'])}")


def print_report(result: dict, path: Path | None) -> None:
    print()
    print(f"stepfs benchmark ({result['mode']}), {result['started']}, load average "
          f"{result['machine']['loadavg_start'][0]:.2f} -> {result['machine']['loadavg_end'][0]:.2f}")
    print("medians; (p50 / p95) rows are latencies; ratios are stepfs time / reference time (lower is better)")
    if result.get("native_cost"):
        print(native_cost.text(result["native_cost"]))
    m = result["machine"]
    print(f"idle CPUs: cpuidle driver {m.get('cpuidle') or 'unknown'}, guest_halt_poll_ns "
          f"{m.get('guest_halt_poll_ns') or 'unknown'}; STEPFS_SPIN_US {m.get('stepfs_spin_us') or 'default'}")
    print()
    print(report.table(result))
    print()
    print("targets of the issue:")
    print(report.goals_text(result["goals"]) or "  (none measured in this run)")
    if result.get("profile"):
        print()
        print("where the stepfs daemon spends its time (py-spy, busy samples only):")
        print(profiler.text(result["profile"]))
    if result["errors"]:
        print()
        print("errors:")
        for e in result["errors"]:
            print(f"  {e}")
    if path:
        print()
        print(f"results: {path}")


def _unwind(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = build_config(args)
    if os.geteuid() != 0:
        raise SystemExit("bench: run as root (FUSE and overlay mounts, drop_caches).")
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _unwind)
    tmp = Path(tempfile.mkdtemp(prefix="stepfs-bench-", dir=args.tmp))
    try:
        result = run(cfg, tmp)
        out_dir = Path(args.out)
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"{time.strftime('%Y%m%d-%H%M%S')}-{cfg.mode}.json"
        path.write_text(json.dumps(result, indent=1) + "\n")
        print_report(result, path)
    finally:
        leftovers = targets.sweep(tmp)
        if leftovers:
            log(f"detached mounts left after a failure: {leftovers}")
        log(f"removing {tmp}")
        shutil.rmtree(tmp, ignore_errors=True)
    return 1 if result["errors"] else 0

if __name__ == "__main__":
    sys.exit(main())
