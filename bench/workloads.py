"""Workloads run side by side on every target (stepfs and its references).

Each repetition of a workload on a target gets a fresh *case*: ``lower/``
is filled natively (untimed, ``prepare``), the target is mounted over it,
``run`` times the work in the mount and returns ``{metric: seconds}`` (or a
list of latencies), and the target is unmounted and the case removed.
Repetitions are interleaved across targets (rep 1 of every target, then
rep 2, ...) so slow drift of a shared machine hits all of them alike.

Pre-existing data is in the *lower* layer (the workspace), untouched, as
when an agent mounts an existing project; new data goes into the mount.
A metric suffixed ``_warm`` is the same command run again in the same
mount (kernel caches of the mount filled); the plain one is the first run
after mounting (the workspace itself is in the page cache either way).
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from . import report, tools
from .context import BENCH_DIR, Context, drop_caches, log, sh, timed
from .targets import Target
from stepfs.overlayfs.client import mounts


@dataclass
class Workload:
    name: str
    metrics: dict[str, str]                      # metric -> description
    run: Callable[[Context, Path], dict]         # timed part, in the mount
    prepare: Callable[[Context, Path], None] = lambda ctx, lower: None
    kind: str = "time"                           # "time" (one sample per rep) or "latency" (many)
    reps: Callable[[Context], int] = field(default=lambda ctx: ctx.cfg.reps)


# -- sequential I/O ------------------------------------------------------------------


def _prepare_big(ctx: Context, lower: Path) -> None:
    os.link(ctx.big_file(), lower / "big.bin")  # same inode: no copy, never written


def _seq_read(ctx: Context, mp: Path) -> dict:
    drop_caches()
    return {"seq_read": timed("dd if=big.bin of=/dev/null bs=1M status=none", mp)}


def _seq_write(ctx: Context, mp: Path) -> dict:
    src = ctx.big_file()
    sh(f"cat {src} > /dev/null", mp)  # the source comes from the page cache, not the disk
    return {"seq_write": timed(f"dd if={src} of=new.bin bs=1M status=none", mp)}


# -- small files -----------------------------------------------------------------------


def _prepare_tree(ctx: Context, lower: Path) -> None:
    sh(f"cp -al {ctx.tree()} tree", lower)


def _prepare_repo(ctx: Context, lower: Path) -> None:
    sh(f"cp -a {ctx.repo()} repo", lower)
    # cp gave every file a new inode and ctime: refresh the index natively
    # so that the timed git status compares stat data, as in a real checkout.
    sh("git update-index -q --refresh; git status --porcelain > /dev/null", lower / "repo")


def _untar(ctx: Context, mp: Path) -> dict:
    return {"untar": timed(f"tar -xf {ctx.tar()}", mp)}


def _twice(name: str, cmd: str, cwd: str) -> Callable[[Context, Path], dict]:
    def run(ctx: Context, mp: Path) -> dict:
        first = timed(cmd, mp / cwd)
        return {name: first, name + "_warm": timed(cmd, mp / cwd)}

    return run


def _rm_rf(ctx: Context, mp: Path) -> dict:
    return {"rm_rf": timed("rm -rf tree", mp)}


def _npm_create(ctx: Context, mp: Path) -> dict:
    # 'packages', not 'node_modules': on stepfs this row is the versioned
    # case (node_modules is unversioned by default: the next workload).
    return {"npm_create": timed(f"{sys.executable} {BENCH_DIR / 'npm_like.py'} packages "
                                f"--files {ctx.cfg.npm_files}", mp)}


#: Times a shell command inside ``stepfs run`` (its own start and commit left out): argv[1] is where
#: the seconds go, argv[2] the command.
_TIMER = ("import subprocess, sys, time; t = time.perf_counter(); subprocess.run(sys.argv[2], shell=True, "
          "check=True, stdout=subprocess.DEVNULL); open(sys.argv[1], 'w').write(repr(time.perf_counter() - t))")


def _in_run(ctx: Context, mp: Path, cmd: str) -> float:
    """Seconds of ``cmd`` run by ``stepfs run`` in the live mount ``mp`` (the
    way an agent's tool call runs; README "Unversioned paths")."""
    out = ctx.tmp / "run-seconds"
    sh(f"{sys.executable} -m stepfs.cli.main run {mp} -- {sys.executable} -c {shlex.quote(_TIMER)} {out} "
       f"{shlex.quote(cmd)}", mp)
    seconds = float(out.read_text())
    out.unlink()
    return seconds


def _npm_unversioned(ctx: Context, mp: Path) -> dict:
    create = f"{sys.executable} {BENCH_DIR / 'npm_like.py'} node_modules --files {ctx.cfg.npm_files}"
    entry = mounts.find(str(mp))
    if entry is None or not entry.workspace:  # not stepfs: any process is served alike
        c, r = timed(create, mp), timed("rm -rf node_modules", mp)
        return {"npm_create_unversioned": c, "rm_rf_unversioned": r,
                "npm_create_unversioned_outside_run": c, "rm_rf_unversioned_outside_run": r}
    # stepfs: the create in one run (node_modules made during it), rm -rf in the next (bound from the start).
    out = {"npm_create_unversioned": _in_run(ctx, mp, create),
           "rm_rf_unversioned": _in_run(ctx, mp, "rm -rf node_modules")}
    out["npm_create_unversioned_outside_run"] = timed(create, mp)
    out["rm_rf_unversioned_outside_run"] = timed("rm -rf node_modules", mp)
    return out


# -- close-write latency (the version-token guard) -----------------------------------


def _prepare_4k(ctx: Context, lower: Path) -> None:
    (lower / "f4k.bin").write_bytes(b"\0" * 4096)


def _close_write(ctx: Context, mp: Path) -> dict:
    """Open an existing 4 KiB file for writing, rewrite it, time ``close``:
    on stepfs that close is the flush where the version token is checked
    and the content staged."""
    path = str(mp / "f4k.bin")
    samples = []
    for i in range(ctx.cfg.guard_samples + 1):
        data = (f"{i:08d}".encode() * 512)[:4096]
        fd = os.open(path, os.O_WRONLY)
        os.pwrite(fd, data, 0)
        t0 = time.perf_counter()
        os.close(fd)
        if i:  # the first close also pays the copy-up: left out
            samples.append(time.perf_counter() - t0)
    return {"close_write_4k": samples}


WORKLOADS: list[Workload] = [
    Workload("seq_read", {"seq_read": "sequential read of an untouched big file, page cache dropped first "
                                      "(dd bs=1M)"}, _seq_read, _prepare_big),
    Workload("seq_write", {"seq_write": "sequential write of a new big file (dd bs=1M from a cached file, "
                                        "close included, no fsync)"}, _seq_write),
    Workload("untar", {"untar": "untar small files (tar -xf) into the mount"}, _untar),
    Workload("find_stat", {"find_stat": "find -type f | xargs stat on the small-file tree, first run after mount",
                           "find_stat_warm": "the same, run again"},
             _twice("find_stat", "find . -type f -print0 | xargs -0 stat > /dev/null", "tree"), _prepare_tree),
    Workload("ls_lR", {"ls_lR": "ls -lR of the small-file tree, first run after mount",
                       "ls_lR_warm": "the same, run again"},
             _twice("ls_lR", "ls -lR > /dev/null", "tree"), _prepare_tree),
    Workload("git_status", {"git_status": "git status in a repository of the small files, first run after mount",
                            "git_status_warm": "the same, run again"},
             _twice("git_status", "git status > /dev/null", "repo"), _prepare_repo),
    Workload("rm_rf", {"rm_rf": "rm -rf of the small-file tree (files in the workspace)"}, _rm_rf, _prepare_tree),
    Workload("npm_create", {"npm_create": "npm-like creation of tiny files in nested directories "
                                          "(one Python process; create-write-close each)"}, _npm_create),
    Workload("npm_unversioned", {
        "npm_create_unversioned": "the same into node_modules (stepfs: unversioned, by a command of 'stepfs run': "
                                  "bound, README \"Unversioned paths\")",
        "rm_rf_unversioned": "rm -rf of that node_modules (stepfs: in the next 'stepfs run')",
        "npm_create_unversioned_outside_run": "the same by a process outside 'stepfs run' (stepfs: the daemon's "
                                              "passthrough)",
        "rm_rf_unversioned_outside_run": "rm -rf of that node_modules outside 'stepfs run'"}, _npm_unversioned),
    Workload("close_write_4k", {"close_write_4k": "close(2) latency after rewriting an existing 4 KiB file "
                                                  "(stepfs: flush = version-token guard + staging)"},
             _close_write, _prepare_4k, kind="latency", reps=lambda ctx: 1),
    # issue 19: the real programs of tests/test_mount_tools.py, one row each and their total
    Workload("tools", tools.METRICS, tools.run, tools.prepare),
]


def run_workload(ctx: Context, w: Workload, targets: list[Target]) -> dict[str, dict]:
    """``{metric: workload record}`` for one workload over all targets."""
    samples: dict[str, dict[str, list[float]]] = {m: {t.name: [] for t in targets} for m in w.metrics}
    for rep in range(w.reps(ctx)):
        for target in targets:
            case = ctx.new_dir("cases", f"{w.name}-{target.name}-{rep}")
            lower = case / "lower"
            lower.mkdir()
            try:
                w.prepare(ctx, lower)
                with target.mounted(case) as mp:
                    out = w.run(ctx, mp)
            finally:
                shutil.rmtree(case)
            for metric, value in out.items():
                samples[metric][target.name].extend(value if isinstance(value, list) else [value])
    records = {}
    for metric, desc in w.metrics.items():
        results = {t: report.summary(s) for t, s in samples[metric].items()}
        rec = {"description": desc, "kind": w.kind, "results": results, "ratios": report.ratios(results)}
        if metric in ("seq_read", "seq_write"):
            rec["size_mib"] = ctx.cfg.big_mib
            rec["throughput_mib_s"] = {t: ctx.cfg.big_mib / r["median"] for t, r in results.items() if r["median"]}
        records[metric] = rec
        log(f"{metric}: " + ", ".join(f"{t} {report.fmt_seconds(r['median'])}" for t, r in results.items()))
    return records
