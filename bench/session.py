"""The agent-like session of issue 20: store size against shadow-git and the
workspace, commit latency, gc time.

Each step edits a few lines of 5 text files; every 20th step reinstalls a
``node_modules``-like tree (versioned: every reinstall differs, the worst
case); every 10th step creates and deletes 100 temporary files.  The same
operations run through a stepfs mount (``stepfs step`` after each) and in a
plain directory committed with ``git add -A && git commit`` after each
(``git gc`` at the end).  Reported: stepfs's store after ``stepfs gc``,
then after ``stepfs prune --keep-last 20`` and gc, shadow-git's packed
``.git``, the workspace, and the median time of a step.

Sizes come from the run's config (``session_*``): 200 steps and 3,000
node_modules files in a full run; ``python -m bench.session --steps N`` runs
it alone (quick: 40 steps).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "bench"

from bench import npm_like, store_bytes  # noqa: E402

N_SOURCES = 20
SOURCE_BYTES = 20_000


def _source(i: int) -> bytes:
    return b"".join(b"# module %d line %04d: def f%d(x): return x * %d + %d\n" % (i, k, k, k, i)
                    for k in range(SOURCE_BYTES // 50))


def _du(root: Path, skip: str | None = None) -> int:
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        if skip is not None and Path(dirpath) == root and skip in dirnames:
            dirnames.remove(skip)
        for name in filenames:
            total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


def apply_step(root: Path, step: int, nm_files: int) -> None:
    """The operations of one step in directory ``root`` (a mount or the shadow)."""
    for j in range(5):
        path = root / "src" / f"m{(step * 5 + j) % N_SOURCES}.py"
        lines = path.read_bytes().split(b"\n")
        k = (step * 37 + j * 11) % (len(lines) - 1)
        lines[k] = b"# step %d edited this line (file %d)" % (step, j)
        path.write_bytes(b"\n".join(lines))
    if step % 10 == 0:
        tmp = root / "tmp"
        tmp.mkdir(exist_ok=True)
        for t in range(100):
            (tmp / f"t{t}.o").write_bytes(os.urandom(2000) + b"step %d" % step)
        shutil.rmtree(tmp)
    if step % 20 == 0:
        nm = root / "node_modules"
        if nm.exists():
            shutil.rmtree(nm)
        nm.mkdir()
        version = step // 20
        for p in range(nm_files // npm_like.FILES_PER_PACKAGE):
            pkg = nm / f"pkg{p}"
            for rel, data in npm_like.package_files(f"pkg{p}", p * 1000 + version).items():
                dest = pkg / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes(data)


def seed(root: Path) -> None:
    (root / "src").mkdir(parents=True)
    for i in range(N_SOURCES):
        (root / "src" / f"m{i}.py").write_bytes(_source(i))


def run(base: Path, steps: int, nm_files: int, keep_last: int = 20, after_gc_copy: Path | None = None) -> dict:
    """Run the session in ``base``; ``after_gc_copy``: where to keep a copy
    of the store as it is after gc, before the prune."""
    from stepfs.overlayfs.client import manage
    from stepfs.store import gc, prune
    from stepfs.store.workspace import Workspace

    from bench.targets import stepfs_mount

    ws, shadow, mnt = base / "ws", base / "shadow", base / "mnt"
    seed(ws)
    seed(shadow)
    git = ["git", "-c", "user.name=b", "-c", "user.email=b@b", "-c", "gc.auto=0"]
    subprocess.run(git + ["init", "-q"], cwd=shadow, check=True)
    subprocess.run(git + ["add", "-A"], cwd=shadow, check=True)
    subprocess.run(git + ["commit", "-qm", "seed"], cwd=shadow, check=True)
    step_times = []
    # node_modules is versioned on both sides (shadow-git has no .gitignore):
    # the worst case, and the same bytes on both sides.
    with stepfs_mount(ws, mnt, default_excludes=False):
        target = manage.resolve(str(mnt))
        for step in range(1, steps + 1):
            apply_step(mnt, step, nm_files)
            t0 = time.perf_counter()
            manage.step(target, message=f"step {step}")
            step_times.append(time.perf_counter() - t0)
            apply_step(shadow, step, nm_files)
            subprocess.run(git + ["add", "-A"], cwd=shadow, check=True)
            subprocess.run(git + ["commit", "-qm", f"step {step}"], cwd=shadow, check=True)
    subprocess.run(git + ["gc", "-q"], cwd=shadow, check=True)
    out = {"steps": steps, "node_modules_files": nm_files, "workspace_bytes": _du(ws, ".stepfs"),
           "git_bytes": _du(shadow / ".git")}
    with Workspace.open(str(ws)) as w:
        out["store_before_gc"] = gc.store_bytes(w)
        t0 = time.perf_counter()
        report = gc.collect(w)
        out["gc_seconds"] = time.perf_counter() - t0
        out["gc_freed_stored"] = report.chunk_bytes
        out["store_after_gc"] = gc.store_bytes(w)
        # where the bytes are (issue 20's format work reads this first)
        out["store_tables_after_gc"] = {name: s["bytes"] for name, s in
                                        store_bytes.breakdown(w.db.label)["by_name"].items() if s["bytes"] > 8192}
        if after_gc_copy is not None:
            store_bytes.copy(w.db.label, str(after_gc_copy))
        prune.prune(w, keep_last=keep_last)
        gc.collect(w)
        out[f"store_keep_last_{keep_last}"] = gc.store_bytes(w)
    step_times.sort()
    out["step_median_s"] = step_times[len(step_times) // 2]
    out["step_p95_s"] = step_times[int(len(step_times) * 0.95)]
    out["store_vs_git"] = out["store_after_gc"] / out["git_bytes"]
    out[f"keep_last_{keep_last}_vs_workspace"] = out[f"store_keep_last_{keep_last}"] / out["workspace_bytes"]
    return out


def agent_session(ctx) -> dict:
    """The bench group (``bench/run.py``)."""
    from bench import report
    from bench.context import log

    extra = ctx.cfg.extra
    steps = extra.get("session_steps", {"full": 200, "quick": 40, "smoke": 4}.get(ctx.cfg.mode, 40))
    nm = extra.get("session_nm_files", 3000 if ctx.cfg.mode != "smoke" else 100)
    out = run(ctx.new_dir("session"), steps, nm)
    log("agent session: " + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                                      for k, v in out.items() if not isinstance(v, dict)))
    log("agent session store after gc, bytes by table/index: "
        + ", ".join(f"{k}={v}" for k, v in out["store_tables_after_gc"].items()))
    return {"agent_session": {"description": f"agent-like session of {steps} steps: store bytes vs shadow-git",
                              "kind": "bytes", "results": {"stepfs": report.summary([out["store_after_gc"]])},
                              "ratios": {}, "session": out}}


def main(argv: list[str] | None = None) -> int:
    import json
    import tempfile

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--node-modules", type=int, default=3000)
    p.add_argument("--keep-last", type=int, default=20)
    p.add_argument("--keep", metavar="FILE", help="keep a copy of the store after gc (before the prune) in FILE "
                   "(for python -m bench.format8_estimate)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="stepfs-session-") as tmp:
        keep = Path(args.keep).resolve() if args.keep else None
        print(json.dumps(run(Path(tmp), args.steps, args.node_modules, args.keep_last, keep), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
