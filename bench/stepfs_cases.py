"""Measurements only stepfs has: step commit, mount time, CLI start-up,
checkpoint cost against shadow-git, store growth, rollback.

Commit latency is timed *inside the library*: ``overlayfs.manage.step`` on
the mountpoint, which asks the mount's daemon over its control socket to
commit (the same call the CLI makes, minus interpreter start-up).  CLI
start-up is reported on its own (``stepfs --help``) and end to end
(``stepfs step``).  Edits that make a step are done through the mount and
are not timed.

Each function returns ``{workload name: record}`` in the same shape as the
side-by-side workloads (``results`` keyed by target, here ``stepfs`` and,
for the checkpoint, ``shadow-git``).
"""

from __future__ import annotations

import os
import resource
import shutil
import sqlite3
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

from stepfs.overlayfs.client import manage

from . import cli_latency, fixtures, gc_scale, report, session, step_cycle
from .context import ROOT, Context, log, sh, timed
from .targets import stepfs_mount


def _edit(root: Path, indexes: list[int], tag: str, read_first: bool = False) -> None:
    """Append one line to each workspace file ``indexes`` (through ``root``).

    ``read_first`` reads each file before writing it: after a rollback the
    mount's earlier observation of a file is stale and opening it for
    writing fails with ESTALE until it is read again (DESIGN rule 4), which
    is what an agent does."""
    for i in indexes:
        if read_first:
            (root / fixtures.ws_path(i)).read_bytes()
        with open(root / fixtures.ws_path(i), "ab") as f:
            f.write(f"edit {tag}\n".encode())


def _spread(n_files: int, k: int, rep: int) -> list[int]:
    """``k`` distinct file indexes spread over the workspace, shifted per rep
    so consecutive steps edit different files."""
    stride = max(1, n_files // k)
    return [(j * stride + rep) % n_files for j in range(k)]


def _record(desc: str, kind: str, results: dict, **extra) -> dict:
    return {"description": desc, "kind": kind, "results": results, "ratios": report.ratios(results), **extra}


def _step(target: manage.Target, message: str) -> float:
    t0 = time.perf_counter()
    manage.step(target, message=message)
    return time.perf_counter() - t0


stepfs_cli = cli_latency.stepfs_cli


# -- step commit -------------------------------------------------------------------


def commit(ctx: Context) -> dict:
    """Commit latency per (workspace size, changed files).  Every size is
    mounted at once and the repetitions alternate between them, so the
    sizes are compared under the same machine load (the 10% target
    compares them; run one size after the other, a load that drifts
    between the two halves of a run looked like a size effect)."""
    cfg = ctx.cfg
    out: dict[str, dict] = {}
    with ExitStack() as stack:
        live: dict[int, tuple[Path, manage.Target]] = {}
        for n in cfg.commit_ws:
            ws = ctx.workspace(n)
            mnt = ctx.new_dir("commit", f"mnt{n}")
            stack.enter_context(stepfs_mount(ws, mnt))
            target = manage.resolve(str(mnt))
            _edit(mnt, [0], "warm-up")
            _step(target, "warm-up")  # first commit pays lazy imports in the daemon
            live[n] = (mnt, target)
        for k in cfg.commit_changed:
            samples: dict[int, list[float]] = {n: [] for n in live}
            for rep in range(cfg.commit_reps):
                for n, (mnt, target) in live.items():
                    _edit(mnt, _spread(n, k, rep), f"{k}-{rep}")
                    samples[n].append(_step(target, f"bench {k} files"))
            for n in live:
                name = f"commit_{k}_{n}files"
                out[name] = _record(f"step commit of {k} changed file(s) in a {n}-file workspace "
                                    f"(manage.step via the daemon)", "latency", {"stepfs": report.summary(samples[n])})
                log(f"{name}: p50 {report.fmt_seconds(out[name]['results']['stepfs']['median'])}, "
                    f"p95 {report.fmt_seconds(out[name]['results']['stepfs']['p95'])}")
        n = cfg.commit_ws[0]
        mnt = live[n][0]
        k = 10 if 10 in cfg.commit_changed else cfg.commit_changed[0]
        cli = stepfs_cli()
        samples_cli = []
        for rep in range(cfg.cli_reps):
            _edit(mnt, _spread(n, k, rep + 1000), f"cli-{rep}")
            t0 = time.perf_counter()
            subprocess.run(cli + ["step", str(mnt), "-m", "cli"], check=True, capture_output=True)
            samples_cli.append(time.perf_counter() - t0)
        out["commit_cli"] = _record(f"'stepfs step' end to end (CLI start-up included), {k} changed "
                                    f"file(s), {n}-file workspace", "time", {"stepfs": report.summary(samples_cli)})
    return out


# -- mount time ----------------------------------------------------------------------


def mount_time(ctx: Context) -> dict:
    """Mount time per workspace size.  The first mount of each size (which
    may create the store) is reported on its own; the repetitions then
    alternate between the sizes, so they are compared under the same
    machine load."""
    out: dict[str, dict] = {}
    sizes = list(ctx.cfg.mount_ws)
    places = {n: (ctx.workspace(n), ctx.new_dir("mount", f"mnt{n}")) for n in sizes}
    firsts: dict[int, list[float]] = {n: [] for n in sizes}
    mounts_: dict[int, list[float]] = {n: [] for n in sizes}
    unmounts: dict[int, list[float]] = {n: [] for n in sizes}
    for rep in range(ctx.cfg.mount_reps + 1):
        for n in sizes:
            ws, mnt = places[n]
            t0 = time.perf_counter()
            with stepfs_mount(ws, mnt):
                t1 = time.perf_counter()
                os.listdir(mnt)  # the mount answers
            t2 = time.perf_counter()
            (firsts if rep == 0 else mounts_)[n].append(t1 - t0)
            unmounts[n].append(t2 - t1)
    for n in sizes:
        out[f"mount_{n}files"] = _record(f"mount a {n}-file workspace (store exists; until ready)", "time",
                                         {"stepfs": report.summary(mounts_[n])})
        out[f"mount_first_{n}"] = _record(f"first mount of a {n}-file workspace (creates the store unless "
                                          f"an earlier group did)", "time",
                                          {"stepfs": report.summary(firsts[n])})
        out[f"unmount_{n}"] = _record(f"unmount a {n}-file workspace (until the daemon exited)", "time",
                                      {"stepfs": report.summary(unmounts[n])})
        log(f"mount_{n}files: {report.fmt_seconds(out[f'mount_{n}files']['results']['stepfs']['median'])}")
    return out


# -- checkpoint cost against shadow-git ---------------------------------------------


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def _process_cpu(pid: int) -> float:
    """CPU seconds (user + system, every thread) a live process has used."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _settle(pid: int, quiet: float = 0.3, limit: float = 10.0) -> None:
    """Wait until process ``pid`` used no CPU for ``quiet`` seconds (its
    background work after the last step is done), at most ``limit``."""
    end = time.monotonic() + limit
    last = _process_cpu(pid)
    while time.monotonic() < end:
        time.sleep(quiet)
        now = _process_cpu(pid)
        if now == last:
            return
        last = now


def checkpoint(ctx: Context) -> dict:
    """Per-step checkpoint cost: shadow-git (``git --git-dir=X --work-tree=WS
    add -A && commit`` as Cline and Roo Code do) against a stepfs step, each
    with ``checkpoint_changed`` files edited per step.

    The target compares wall time per step: ``manage.step`` (the library
    call, daemon round trip included) against the two git commands.  CPU
    time is reported beside it, because a daemon can move work off the
    step (spare inodes made ahead, replaced inodes freed after it):
    ``cpu_per_step_s`` gives git's own CPU per step, the daemon's CPU
    while the step ran (all threads), and the daemon's CPU per step over
    the whole loop (the edits through the mount, the steps and the
    background work after them, waited for at the end)."""
    cfg = ctx.cfg
    n, k = cfg.checkpoint_files, cfg.checkpoint_changed
    base = ctx.new_dir("checkpoint")
    ws = fixtures.workspace(base / "ws", n)
    git = f"git --git-dir={base / 'shadow.git'} --work-tree={ws}"
    env = fixtures.git_env()
    sh(f"{git} init -q && {git} config core.autocrlf false", base, env)
    first = timed(f"{git} add -A && {git} commit -q -m baseline", base, env)
    shadow, shadow_cpu = [], 0.0
    for rep in range(cfg.checkpoint_reps):
        _edit(ws, _spread(n, k, rep), f"git-{rep}")
        c0 = _children_cpu()
        shadow.append(timed(f"{git} add -A && {git} commit -q -m step", base, env))
        shadow_cpu += _children_cpu() - c0
    mnt = base / "mnt"
    steps, step_cpu = [], 0.0
    os.sync()  # git's object writes must not be flushed inside stepfs's fsyncs
    with stepfs_mount(ws, mnt) as pid:
        target = manage.resolve(str(mnt))
        # Warm up with a step of the measured shape (k files): the first
        # k-file step pays one-time costs (the fsync pool's threads, the
        # daemon's lazy imports and caches) that a 1-file step does not
        # reach; shadow-git's first snapshot is left out likewise.
        _edit(mnt, _spread(n, k, n // (2 * k)), "warm-up")
        _step(target, "warm-up")
        _settle(pid)
        loop0 = _process_cpu(pid)
        for rep in range(cfg.checkpoint_reps):
            _edit(mnt, _spread(n, k, rep + 1), f"stepfs-{rep}")
            c0 = _process_cpu(pid)
            steps.append(_step(target, "checkpoint"))
            step_cpu += _process_cpu(pid) - c0
        _settle(pid)
        loop_cpu = _process_cpu(pid) - loop0
        # What a harness pays: the same step through the `stepfs` command,
        # its start-up included (the figure above is the library call).
        cli, via_cli = stepfs_cli(), []
        for rep in range(cfg.checkpoint_reps):
            _edit(mnt, _spread(n, k, rep + 1 + cfg.checkpoint_reps), f"stepfs-cli-{rep}")
            t0 = time.perf_counter()
            subprocess.run(cli + ["step", str(mnt), "-m", "checkpoint"], check=True, capture_output=True)
            via_cli.append(time.perf_counter() - t0)
    reps = max(1, cfg.checkpoint_reps)
    cpu = {"shadow-git": shadow_cpu / reps, "stepfs_daemon_during_step": step_cpu / reps,
           "stepfs_daemon_per_step_all": loop_cpu / reps}
    results = {"stepfs": report.summary(steps), "shadow-git": report.summary(shadow)}
    rec = _record(f"per-step checkpoint, {k} changed files, {n}-file workspace: stepfs step (in the daemon, "
                  f"via the library; 'stepfs CLI': the same through the command) vs shadow-git add -A && commit",
                  "time", results, shadow_git_first_snapshot_s=first, cpu_per_step_s=cpu)
    # Beside the library figure, not a target of its own (the goal compares
    # the in-daemon step): added after the ratios so they stay stepfs/shadow-git.
    results["stepfs CLI"] = report.summary(via_cli)
    if results["stepfs CLI"]["median"] and results["shadow-git"]["median"]:
        rec["ratios"]["stepfs CLI/shadow-git"] = results["stepfs CLI"]["median"] / results["shadow-git"]["median"]
    log(f"checkpoint: stepfs {report.fmt_seconds(results['stepfs']['median'])} "
        f"(through the CLI {report.fmt_seconds(results['stepfs CLI']['median'])}), "
        f"shadow-git {report.fmt_seconds(results['shadow-git']['median'])}; CPU per step: shadow-git "
        f"{report.fmt_seconds(cpu['shadow-git'])}, stepfs daemon during the step "
        f"{report.fmt_seconds(cpu['stepfs_daemon_during_step'])}, all of it (edits, step, background) "
        f"{report.fmt_seconds(cpu['stepfs_daemon_per_step_all'])}")
    return {"checkpoint": rec}


# -- store growth ----------------------------------------------------------------------


def store_size(ws: Path) -> int:
    """Bytes of the store database after folding the WAL into it (call with
    no mount of ``ws`` live)."""
    db = ws / ".stepfs" / "store.db"
    conn = sqlite3.connect(db)
    try:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        conn.close()
    return sum(p.stat().st_size for p in (db, db.with_name("store.db-wal")) if p.exists())


def _line_edit(path: Path, line: int, same_length: bool) -> None:
    """Edit one 100-byte line of a :func:`fixtures.text_file`: in place with
    the same length, or by rewriting the file with a few bytes inserted (an
    editor or agent saving a file)."""
    if same_length:
        with open(path, "r+b") as f:
            f.seek(line * 100 + 9)
            f.write(b"EDITED")
        return
    data = path.read_bytes()
    cut = line * 100 + 9
    path.write_bytes(data[:cut] + b"inserted words " + data[cut:])


def store_growth(ctx: Context) -> dict:
    """Store bytes added by edits, measured with no mount live (WAL folded in).

    * ``store_growth_edit_10mb``: the first edit of a big workspace file the
      store has never seen.  The step must keep the file's "before" bytes
      (the only copy, for rollback) as well as the edited ones, so this
      costs about the file's size whatever the chunking.
    * ``store_growth_edited_10mb``: what the growth target means: the file
      is written through the mount and committed (step 1), then one line
      gets a few bytes inserted and the file is rewritten (step 2); the
      growth of step 2.  Content-defined chunks make it the changed chunks
      plus the rows that list them.
    * ``store_growth_inplace_10mb``: a same-length edit of one line of the
      first file, in place, committed.
    """
    cfg = ctx.cfg
    out: dict[str, dict] = {}
    base = ctx.new_dir("growth")
    ws = base / "ws"
    ws.mkdir()
    size = cfg.growth_big_mib * 1_000_000
    fixtures.text_file(ws / "big.txt", size)
    fixtures.text_file(base / "tracked.txt", size, seed=9)
    mnt = base / "mnt"
    with stepfs_mount(ws, mnt):
        pass  # creates the store: its empty size is the baseline
    sizes = [store_size(ws)]
    for same_length in (False, True):
        with stepfs_mount(ws, mnt):
            _line_edit(mnt / "big.txt", size // 200, same_length)
            manage.step(manage.resolve(str(mnt)), message="one-line edit")
        sizes.append(store_size(ws))
    with stepfs_mount(ws, mnt):
        shutil.copyfile(base / "tracked.txt", mnt / "tracked.txt")
        manage.step(manage.resolve(str(mnt)), message="add a 10 MB file")
    committed = store_size(ws)
    with stepfs_mount(ws, mnt):
        _line_edit(mnt / "tracked.txt", size // 300, same_length=False)
        manage.step(manage.resolve(str(mnt)), message="one-line edit of a committed file")
    out["store_growth_edit_10mb"] = _record(
        f"store growth: first edit of a {cfg.growth_big_mib} MB workspace file the store has never seen (a few "
        f"bytes inserted, file rewritten, committed; its before bytes are stored too)", "bytes",
        {"stepfs": report.summary([sizes[1] - sizes[0]])})
    out["store_growth_edited_10mb"] = _record(
        f"store growth: one-line edit (a few bytes inserted, file rewritten) of a {cfg.growth_big_mib} MB file "
        f"committed earlier through the mount, committed", "bytes",
        {"stepfs": report.summary([store_size(ws) - committed])})
    out["store_growth_inplace_10mb"] = _record(
        "store growth: same-length in-place edit of one line of the first file, committed", "bytes",
        {"stepfs": report.summary([sizes[2] - sizes[1]])})

    src = ws / "src.py"
    fixtures.text_file(src, 100_000, seed=4)
    with stepfs_mount(ws, mnt):
        pass
    before = store_size(ws)
    with stepfs_mount(ws, mnt):
        target = manage.resolve(str(mnt))
        for i in range(cfg.growth_steps):
            _line_edit(mnt / "src.py", (i * 7) % 1000, same_length=False)
            manage.step(target, message=f"edit {i}")
    total = store_size(ws) - before
    out["store_growth_100_steps"] = _record(
        f"store growth: {cfg.growth_steps} steps editing one line each of a 100 KB source file (total)", "bytes",
        {"stepfs": report.summary([total])}, per_step_bytes=total / max(1, cfg.growth_steps))
    shutil.rmtree(base)
    for name in ("store_growth_edit_10mb", "store_growth_edited_10mb", "store_growth_inplace_10mb",
                 "store_growth_100_steps"):
        log(f"{name}: {report.fmt_bytes(out[name]['results']['stepfs']['median'])}")
    return out


# -- rollback ------------------------------------------------------------------------


def rollback_available() -> bool:
    return (ROOT / "store" / "rollback.py").exists() and callable(getattr(manage, "rollback", None))


def rollback(ctx: Context) -> dict:
    """Rollback latency for the commit sizes: after a step that changed K
    files, time ``overlayfs.manage.rollback`` to the layer before it (the
    library call the CLI makes; it also invalidates the live mount).

    Until ``store/rollback.py`` and ``manage.rollback`` exist this returns
    a TODO row, never a made-up number."""
    if not rollback_available():
        return {"rollback": {"description": "rollback latency (1, 10, 100 files; 10k and 100k workspaces)",
                             "kind": "time", "results": {}, "ratios": {},
                             "status": "not implemented yet (TODO: needs store/rollback.py and manage.rollback)"}}
    cfg = ctx.cfg
    out: dict[str, dict] = {}
    for n in cfg.commit_ws:
        ws = ctx.workspace(n)
        mnt = ctx.new_dir("rollback", f"mnt{n}")
        with stepfs_mount(ws, mnt):
            target = manage.resolve(str(mnt))
            for k in cfg.commit_changed:
                samples = []
                for rep in range(cfg.commit_reps):
                    _edit(mnt, _spread(n, k, rep + 2000), f"rb-{k}-{rep}", read_first=True)
                    number = manage.step(target, message=f"before rollback {k}")[0]
                    t0 = time.perf_counter()
                    manage.rollback(target, number - 1)
                    samples.append(time.perf_counter() - t0)
                name = f"rollback_{k}_{n}files"
                out[name] = _record(f"rollback of a step that changed {k} file(s), {n}-file workspace "
                                    f"(manage.rollback to the layer before)", "latency",
                                    {"stepfs": report.summary(samples)})
                log(f"{name}: p50 {report.fmt_seconds(out[name]['results']['stepfs']['median'])}")
    return out


GROUPS = {  # in run order: mount first, so its first mount is the one that creates the store
    "mount": mount_time,
    "commit": commit,
    "cli": cli_latency.cli,
    "checkpoint": checkpoint,
    "growth": store_growth,
    "rollback": rollback,
    "session": session.agent_session,  # issue 20: store size against shadow-git
    "cycle": step_cycle.step_cycle,  # issue 20: edits right after a step (work after the answer)
    "gc": gc_scale.gc_scale,  # issue 20: churn, and a GiB of garbage, then gc
}
