"""An agent's edit-then-step loop through a mount: each cycle edits one
line of 10 text files of 20 KB (through the mount) and then steps.

Timed apart: the edits (their row writes wait for the previous step's
completion: ``overlayfs/core/committing.py``), the step (``manage.step``,
the daemon's answer), the whole cycle, and how long after the answer the
commit lock is free again (what another process's commit waits for).  What a commit's completion
does after its answer (deltas, issue 20) shows in the edits and the
cycle, not in the step.  ``python -m bench.step_cycle --reps N [--think
S]`` runs it alone and prints JSON (``--think``: seconds between a step
and the next edits, as an agent's model call; the bench row uses 0, the
worst case for work done after the answer).
"""

from __future__ import annotations

import argparse
import fcntl
import os
import sqlite3
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "bench"

FILES = 10
FILE_BYTES = 20_000


def _source(i: int) -> bytes:
    return b"".join(b"# module %d line %04d: def f%d(x): return x * %d + %d\n" % (i, k, k, k, i)
                    for k in range(FILE_BYTES // 50))


def _pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(len(s) * q))]


def run(base: Path, reps: int, extra_files: int = 0, think: float = 0.0) -> dict:
    from stepfs.overlayfs.client import manage

    from bench.targets import stepfs_mount

    ws, mnt = base / "ws", base / "mnt"
    (ws / "src").mkdir(parents=True)
    for i in range(FILES):
        (ws / "src" / f"m{i}.py").write_bytes(_source(i))
    for i in range(extra_files):  # a bigger workspace around them
        d = ws / "other" / f"d{i // 1000}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"f{i}").write_bytes(b"x\n")
    mnt.mkdir()
    edits, steps, cycles, locks = [], [], [], []
    with stepfs_mount(ws, mnt):
        target = manage.resolve(str(mnt))
        lock_fd = os.open(ws / ".stepfs" / "commit.lock", os.O_RDWR | os.O_CLOEXEC)
        for rep in range(reps + 1):  # the first cycle pays the daemon's lazy imports: not counted
            if think:
                time.sleep(think)  # the agent's model call between a step and its next edits
            t0 = time.perf_counter()
            for i in range(FILES):
                path = mnt / "src" / f"m{i}.py"
                lines = path.read_bytes().split(b"\n")
                lines[(rep * 37 + i * 11) % (len(lines) - 1)] = b"# cycle %d edited this line" % rep
                path.write_bytes(b"\n".join(lines))
            t1 = time.perf_counter()
            manage.step(target, message=f"cycle {rep}")
            t2 = time.perf_counter()
            # What another process's commit (or the CLI's) would wait for:
            # the commit lock, held by the daemon until its completion ends.
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
            fcntl.flock(lock_fd, fcntl.LOCK_UN)
            t3 = time.perf_counter()
            if rep:
                edits.append(t1 - t0)
                steps.append(t2 - t1)
                cycles.append(t2 - t0)
                locks.append(t3 - t2)
        os.close(lock_fd)
    out = {"reps": reps, "think_s": think, "load": os.getloadavg()}
    # Once unmounted: were the deltas made (not only put off)?
    with sqlite3.connect(ws / ".stepfs" / "store.db") as db:
        out["delta_rows"] = db.execute("SELECT (SELECT count(*) FROM chunks WHERE codec = 2)"
                                       " + (SELECT count(*) FROM objects WHERE codec = 2)").fetchone()[0]
    for name, samples in (("edit", edits), ("step", steps), ("cycle", cycles), ("lock_wait", locks)):
        out[f"{name}_p50_ms"] = round(_pct(samples, 0.5) * 1000, 1)
        out[f"{name}_p95_ms"] = round(_pct(samples, 0.95) * 1000, 1)
    return out


def step_cycle(ctx) -> dict:
    """The bench group (``bench/run.py``)."""
    from bench import report
    from bench.context import log

    reps = {"full": 40, "quick": 20, "smoke": 2}.get(ctx.cfg.mode, 20)
    out = run(ctx.new_dir("cycle"), reps)
    log("step cycle: " + ", ".join(f"{k}={v}" for k, v in out.items()))
    return {"step_cycle": {"description": f"{FILES} one-line edits of {FILE_BYTES // 1000} KB files, then a step, "
                                          f"through a mount ({reps} cycles): edit, step and cycle p50/p95",
                           "kind": "latency", "results": {"stepfs": report.summary([out["cycle_p50_ms"] / 1000])},
                           "ratios": {}, "cycle": out}}


def main(argv: list[str] | None = None) -> int:
    import json
    import tempfile

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--extra-files", type=int, default=0)
    p.add_argument("--think", type=float, default=0.0, help="seconds between a step and the next edits")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="stepfs-cycle-") as tmp:
        print(json.dumps(run(Path(tmp), args.reps, args.extra_files, args.think)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
