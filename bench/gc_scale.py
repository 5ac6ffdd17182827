"""Issue 20's two gc targets that the session does not cover.

* **churn**: steps that each rewrite a 1 MiB file in place many times,
  create and delete temporary files and keep a few edits, through a stepfs
  mount; after ``stepfs gc`` the store's chunks must hold at most 1.2x the
  bytes the layers reference (``du``'s history bytes).
* **1 GB**: a layer of 1 GiB of incompressible files, removed in the next
  step and pruned away, makes about 1 GiB of garbage; ``stepfs gc`` must
  finish in under a minute and free at least 95% of it (``du``'s garbage
  bytes before and after), giving the space back to the file system.

``python -m bench.gc_scale [--gib N] [--churn-steps N]`` runs both alone.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "bench"

MIB = 1 << 20


def churn(base: Path, steps: int = 5, rewrites: int = 400, temps: int = 200) -> dict:
    """The churn session in ``base``; the store after gc against what the
    layers reference."""
    from stepfs.overlayfs.client import manage
    from stepfs.store import du, gc
    from stepfs.store.workspace import Workspace

    from bench.targets import stepfs_mount

    ws, mnt = base / "ws", base / "mnt"
    (ws / "src").mkdir(parents=True)
    for i in range(10):
        (ws / "src" / f"f{i}.txt").write_bytes(b"line %d\n" % i * 2000)
    rng = random.Random(20)
    with stepfs_mount(ws, mnt, default_excludes=False):
        target = manage.resolve(str(mnt))
        for step in range(steps):
            big = mnt / "data.bin"
            with open(big, "wb") as f:  # a file rewritten in place, closed after each write (fsx-like)
                f.write(os.urandom(MIB))
            for _ in range(rewrites):
                with open(big, "r+b") as f:
                    f.seek(rng.randrange(MIB - 4096))
                    f.write(os.urandom(rng.randrange(1, 4096)))
            tmp = mnt / "tmp"
            tmp.mkdir(exist_ok=True)
            for t in range(temps):
                (tmp / f"t{t}").write_bytes(os.urandom(rng.randrange(4096, 65536)))
            for t in range(temps):
                (tmp / f"t{t}").unlink()
            tmp.rmdir()
            for i in range(3):
                with open(mnt / "src" / f"f{(step * 3 + i) % 10}.txt", "ab") as f:
                    f.write(b"step %d\n" % step)
            manage.step(target, message=f"churn {step}")
    with Workspace.open(str(ws)) as w:
        before = du.usage(w)
        gc.collect(w)
        after = du.usage(w)
    return {"steps": steps, "chunk_bytes_before_gc": before["chunk_bytes"],
            "chunk_bytes_after_gc": after["chunk_bytes"], "history_bytes": after["history_bytes"],
            "disk_bytes_after_gc": after["disk_bytes"],
            "chunks_vs_referenced": after["chunk_bytes"] / max(1, after["history_bytes"])}


def gc_gib(base: Path, gib: float = 1.0, file_mib: int = 4) -> dict:
    """A store holding ``gib`` GiB of garbage, then one ``gc``."""
    from stepfs.overlayfs.client import manage
    from stepfs.store import du, gc, prune
    from stepfs.store.workspace import Workspace

    from bench.targets import stepfs_mount

    ws, mnt = base / "ws", base / "mnt"
    ws.mkdir(parents=True)
    (ws / "keep.txt").write_bytes(b"kept\n")
    n = int(gib * 1024) // file_mib
    with stepfs_mount(ws, mnt, default_excludes=False):
        target = manage.resolve(str(mnt))
        (mnt / "big").mkdir()
        for i in range(n):
            (mnt / "big" / f"b{i}").write_bytes(os.urandom(file_mib * MIB))
        manage.step(target, message="1 GiB")
        for i in range(n):
            (mnt / "big" / f"b{i}").unlink()
        (mnt / "big").rmdir()
        manage.step(target, message="removed")
    with Workspace.open(str(ws)) as w:
        prune.prune(w, keep_last=1)
        before = du.usage(w)
        t0 = time.perf_counter()
        report = gc.collect(w)
        seconds = time.perf_counter() - t0
        after = du.usage(w)
    freed = before["garbage_bytes"] - after["garbage_bytes"]
    return {"garbage_before": before["garbage_bytes"], "garbage_after": after["garbage_bytes"],
            "disk_before": report.file_before, "disk_after": report.file_after, "gc_seconds": seconds,
            "freed_fraction": freed / max(1, before["garbage_bytes"]),
            "disk_given_back_fraction": (report.file_before - report.file_after) / max(1, before["garbage_bytes"])}


def gc_scale(ctx) -> dict:
    """The bench group (``bench/run.py``)."""
    from bench import report
    from bench.context import log

    gib = {"full": 1.0, "quick": 1.0, "smoke": 0.05}.get(ctx.cfg.mode, 1.0)
    c = churn(ctx.new_dir("gc-churn"), steps=2 if ctx.cfg.mode == "smoke" else 5)
    g = gc_gib(ctx.new_dir("gc-gib"), gib)
    log("gc churn: " + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in c.items()))
    log("gc of a store with garbage: " + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                                                   for k, v in g.items()))
    return {"gc_scale": {"description": f"gc: churn then gc; {gib:g} GiB of garbage then gc",
                         "kind": "seconds", "results": {"stepfs": report.summary([g["gc_seconds"]])},
                         "ratios": {}, "gc_scale": {"churn": c, "gib": g}}}


def main(argv: list[str] | None = None) -> int:
    import json
    import tempfile

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--churn-steps", type=int, default=5)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="stepfs-gc-scale-") as tmp:
        out = {"churn": churn(Path(tmp) / "c", args.churn_steps), "gib": gc_gib(Path(tmp) / "g", args.gib)}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
