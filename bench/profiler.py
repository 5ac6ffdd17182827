"""Where the stepfs daemon spends its time during a workload (``--profile``).

For each profiled workload a stepfs case is mounted as in the side-by-side
run, ``py-spy record`` attaches to the mount daemon (sampling, native frames
included, idle stacks excluded, so only busy time counts), the workload
runs, and py-spy is stopped with SIGINT, which makes it write its raw
collapsed stacks.  The summary gives, per function, the share of busy
samples spent in it (self) and under it (inclusive), and the daemon's CPU
time against the workload's wall time (from ``/proc/PID/stat``): a daemon
busy for a small part of the wall time means the cost is in the round trips
(kernel, context switches), not in Python.
"""

from __future__ import annotations

import cProfile
import os
import pstats
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from .context import Context, log
from .targets import Stepfs
from .workloads import WORKLOADS

PROFILED = ("untar", "git_status")
TOP = 15


def py_spy() -> str | None:
    exe = Path(sys.executable).parent / "py-spy"
    return str(exe) if exe.exists() else shutil.which("py-spy")


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


_FRAME = re.compile(r"^(?P<fn>.*?) \((?P<file>[^()]*)\)$")


def _short(frame: str) -> str:
    """``fn (path/to/file.py)`` -> ``fn (file.py)``; native frames as they are."""
    m = _FRAME.match(frame)
    if not m:
        return frame
    return f"{m['fn']} ({m['file'].rsplit('/', 1)[-1]})"


#: Frames every busy stack of the daemon runs under: left out of the inclusive list.
ENTRY_FRAMES = {"<module> (daemon.py)", "main (daemon.py)", "serve (daemon.py)", "run (fuse_ops.py)",
                "<module> (main.py)", "main (main.py)", "serve (main.py)", "main_with_hook.<locals>.main (loop.py)",
                "Thread._bootstrap (threading.py)", "Thread._bootstrap_inner (threading.py)",
                "Thread.run (threading.py)", "FUSE.__init__ (mfusepy.py)", "_run_code (<frozen runpy>)", "_run_module_as_main (<frozen runpy>)"}


#: py-spy's idle detection misses threads blocked in native code (--native):
#: a stack is idle when a loop waits for work, i.e. its innermost Python frame
#: is one of these and its leaf is one of the blocking calls below.
LOOP_FRAMES = {"FUSE.__init__ (mfusepy.py)", "main_with_hook.<locals>.main (loop.py)", "socket.accept (socket.py)",
               "Watcher._run (watch.py)"}
BLOCKING_CALLS = ("read", "accept4", "accept", "poll", "ppoll", "epoll_wait", "select", "recv", "recvmsg",
                  "futex", "__futex_abstimed_wait_common", "__GI___futex_abstimed_wait_cancelable64")
#: A helper thread (row timer, spares, delta work) parked on a condition
#: is idle too; its leaf is often an unresolved libc address.  The same
#: wait under the FUSE loop is a request stalled on a helper: kept busy.
WAIT_FRAMES = {"Condition.wait (threading.py)"}
FUSE_LOOP_FRAMES = {"FUSE.__init__ (mfusepy.py)", "main_with_hook.<locals>.main (loop.py)"}


def _is_idle(frames: list[str], py: list[str]) -> bool:
    leaf = frames[-1].split(" (", 1)[0]
    if py and py[-1] in WAIT_FRAMES and not FUSE_LOOP_FRAMES & set(py):
        return True
    return bool(py) and py[-1] in LOOP_FRAMES and leaf in BLOCKING_CALLS


def _is_python(frame: str) -> bool:
    m = _FRAME.match(frame)
    return bool(m) and (m["file"].endswith(".py") or m["file"].startswith("<frozen"))


def summarize(raw: str) -> dict:
    """Shares of the busy samples from py-spy's raw (collapsed) output, one
    ``frame;frame;...;leaf COUNT`` per line:

    * ``self_leaf``: the innermost frame, native included (a syscall shows
      as its libc wrapper);
    * ``self_python``: the innermost Python frame (where Python code was,
      or which Python code made the native call);
    * ``inclusive``: Python frames anywhere in the stack, entry points left out;
    * ``self_by_file``: ``self_python`` summed per source file.

    Stacks of a loop waiting for work (:func:`_is_idle`) are counted apart.
    """
    leaf_c: Counter = Counter()
    py_c: Counter = Counter()
    incl_c: Counter = Counter()
    by_file: Counter = Counter()
    total = idle = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = [_short(f) for f in stack.split(";") if f]
        # py-spy may put a process/thread label first.
        frames = [f for f in frames if not f.startswith(("process ", "thread "))]
        if not frames:
            continue
        py = [f for f in frames if _is_python(f)]
        if _is_idle(frames, py):
            idle += n
            continue
        total += n
        leaf_c[frames[-1]] += n
        if py:
            py_c[py[-1]] += n
            by_file[_FRAME.match(py[-1])["file"]] += n
        for f in set(py) - ENTRY_FRAMES:
            incl_c[f] += n

    def top(c: Counter) -> list[dict]:
        return [{"frame": f, "share": n / total, "samples": n} for f, n in c.most_common(TOP)] if total else []

    return {"busy_samples": total, "idle_samples": idle, "self_leaf": top(leaf_c), "self_python": top(py_c), "inclusive": top(incl_c),
            "self_by_file": top(by_file)}


def profile(ctx: Context, names: tuple[str, ...] = PROFILED) -> dict:
    spy = py_spy()
    if spy is None:
        return {"status": "py-spy is not installed (make bench installs it)"}
    out: dict[str, dict] = {}
    workloads = {w.name: w for w in WORKLOADS}
    target = Stepfs()
    for name in names:
        w = workloads[name]
        case = ctx.new_dir("profile", name)
        (case / "lower").mkdir()
        raw_path = case.parent / f"{name}.raw.txt"
        try:
            w.prepare(ctx, case / "lower")
            with target.mounted(case) as mp:
                out[name] = record(spy, target.pid, raw_path, lambda: w.run(ctx, mp))
            log(f"profiled {name}: daemon CPU {out[name]['daemon_cpu_s']:.2f} s of {out[name]['wall_s']:.2f} s wall")
        except Exception as exc:  # a profiler problem must not lose the run's numbers
            log(f"profiling {name} failed: {exc}")
            out[name] = {"status": f"failed: {exc}"}
        finally:
            shutil.rmtree(case, ignore_errors=True)
    return out


def record(spy: str, pid: int, raw_path: Path, work) -> dict:
    """Run ``work()`` with py-spy sampling daemon ``pid`` into ``raw_path``:
    wall time, the daemon's CPU time, ``work``'s result (``timings``) and
    the :func:`summarize` of the samples."""
    proc = subprocess.Popen([spy, "record", "--pid", str(pid), "--format", "raw", "--rate", "250",
                             "--native", "--nolineno", "--output", str(raw_path)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_sampling(proc)
        cpu0, t0 = _cpu_seconds(pid), time.perf_counter()
        timings = work()
        wall, cpu = time.perf_counter() - t0, _cpu_seconds(pid) - cpu0
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    raw = raw_path.read_text() if raw_path.exists() else ""
    return {"wall_s": wall, "daemon_cpu_s": cpu, "daemon_busy_share": cpu / wall if wall else None,
            "timings": timings, **summarize(raw)}


def profile_commit(ctx: Context, changed: int = 10, commits: int = 5) -> dict:
    """cProfile (wall clock, so fsync waits count) of ``commits`` step
    commits of ``changed`` files in the smallest commit workspace.

    The edits are made through a mount that is then unmounted: its staged
    rows stay in the store, and ``manage.step`` on the workspace commits
    them in this process with ``publish.commit_step``, the same core the
    daemon runs (the daemon adds only its view lock and socket round trip).
    """
    from stepfs.overlayfs.client import manage

    from .stepfs_cases import _edit, _spread
    from .targets import stepfs_mount

    n = ctx.cfg.commit_ws[0]
    ws = ctx.workspace(n)
    mnt = ctx.new_dir("profile", "commit-mnt")
    prof = cProfile.Profile()
    wall = 0.0
    for rep in range(commits):
        with stepfs_mount(ws, mnt):
            _edit(mnt, _spread(n, changed, rep + 500), f"profile-{rep}")
        t0 = time.perf_counter()
        prof.enable()
        manage.step(manage.Target(str(ws.resolve())), message="profile")
        prof.disable()
        wall += time.perf_counter() - t0
    stats = pstats.Stats(prof)
    rows = []
    for (file, line, fn), (cc, nc, tt, ct, _callers) in stats.stats.items():
        rows.append({"frame": f"{fn} ({file.rsplit('/', 1)[-1]}:{line})", "calls_per_commit": nc / commits,
                     "self_s": tt / commits, "cumulative_s": ct / commits})
    log(f"profiled {commits} commits of {changed} files: {1000 * wall / commits:.1f} ms each")
    return {"what": f"{commits} commits of {changed} changed files, {n}-file workspace, in-process "
                    f"(publish.commit_step); times per commit",
            "wall_per_commit_s": wall / commits,
            "by_self": sorted(rows, key=lambda r: -r["self_s"])[:TOP],
            "by_cumulative": sorted(rows, key=lambda r: -r["cumulative_s"])[:TOP]}


def _wait_sampling(proc: subprocess.Popen, timeout: float = 20) -> None:
    """Until py-spy says it samples (its first output line), or fail."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"py-spy exited with {proc.wait()} before sampling")
        if "Sampling process" in line:
            return
    raise RuntimeError("py-spy did not start sampling")


def text(prof: dict) -> str:
    lines = []
    for name, p in prof.items():
        if name == "commit" and "by_self" in p:
            lines.append(f"  commit: {p['what']}: {1000 * p['wall_per_commit_s']:.1f} ms per commit (cProfile, wall)")
            lines.append("    self time per commit:")
            lines += [f"      {1000 * e['self_s']:7.2f} ms  {e['frame']} ({e['calls_per_commit']:g} calls)"
                      for e in p["by_self"][:12]]
            lines.append("    cumulative time per commit:")
            lines += [f"      {1000 * e['cumulative_s']:7.2f} ms  {e['frame']}" for e in p["by_cumulative"][:12]]
            continue
        if not isinstance(p, dict) or "self_leaf" not in p:
            lines.append(f"  {name}: {p.get('status') if isinstance(p, dict) else p}")
            continue
        lines.append(f"  {name}: wall {p['wall_s']:.2f} s, daemon CPU {p['daemon_cpu_s']:.2f} s "
                     f"({100 * (p['daemon_busy_share'] or 0):.0f}% busy), {p['busy_samples']} busy samples")
        lines.append("    innermost frame (native included):")
        lines += [f"      {100 * e['share']:5.1f}%  {e['frame']}" for e in p["self_leaf"][:10]]
        lines.append("    innermost Python frame:")
        lines += [f"      {100 * e['share']:5.1f}%  {e['frame']}" for e in p["self_python"][:12]]
        lines.append("    inclusive time by function:")
        lines += [f"      {100 * e['share']:5.1f}%  {e['frame']}" for e in p["inclusive"][:12]]
        lines.append("    innermost Python frame by file:")
        lines += [f"      {100 * e['share']:5.1f}%  {e['frame']}" for e in p["self_by_file"][:8]]
    return "\n".join(lines)
