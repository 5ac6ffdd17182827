"""How an unversioned ``node_modules`` can be served: the measurements behind
the choice (issue 19 part 1; README "Unversioned paths").

``python -m bench.unversioned [--files N] [--reps R]`` creates N npm-like
files (``bench/npm_like.py``) in ``node_modules`` and removes them again
with ``rm -rf``, on:

* ``native``       a plain directory (the reference);
* ``versioned``    a stepfs mount with ``--no-default-excludes`` (staged);
* ``passthrough``  a stepfs mount, ``node_modules`` unversioned: the
                   daemon passes every operation straight to the workspace
                   (what stepfs does);
* ``bind``         a stepfs mount with the workspace's ``node_modules``
                   bind-mounted over the mount's (the kernel serves it);
                   its ``rm -rf`` ends in EBUSY, reported in the row;
* ``symlink``      the workspace's ``node_modules`` a symlink to a
                   directory outside it (the kernel follows it, asking the
                   daemon for the link at each walk).

Each row prints seconds, the ratio to native, and for ``rm -rf`` the exit
status; the run starts with the native cost per create and unlink and the
load average.  Needs root (bind mounts) and /dev/fuse.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import npm_like  # noqa: E402
from stepfs.overlayfs.client import manage  # noqa: E402

NPM = Path(__file__).with_name("npm_like.py")


def _timed(cmd: list[str], cwd: Path) -> tuple[float, int, str]:
    """Seconds, exit status and the last line of stderr of ``cmd``."""
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    elapsed = time.perf_counter() - t0
    lines = p.stderr.strip().splitlines()
    return elapsed, p.returncode, lines[-1] if lines else ""


def _per_op(tmp: Path, n: int = 2000) -> tuple[float, float]:
    d = tmp / "perop"
    d.mkdir()
    t0 = time.perf_counter()
    for i in range(n):
        fd = os.open(d / f"f{i}", os.O_CREAT | os.O_WRONLY, 0o644)
        os.close(fd)
    t1 = time.perf_counter()
    for i in range(n):
        os.unlink(d / f"f{i}")
    t2 = time.perf_counter()
    d.rmdir()
    return (t1 - t0) / n, (t2 - t1) / n


def _case(kind: str, tmp: Path, files: int) -> dict:
    ws, mnt = tmp / f"ws-{kind}", tmp / f"mnt-{kind}"
    ws.mkdir()
    mnt.mkdir()
    (ws / "README").write_text("x\n")
    create = [sys.executable, str(NPM), "node_modules", "--files", str(files)]
    out: dict = {}
    if kind == "native":
        out["create"], _, _ = _timed(create, ws)
        out["rm"], out["rm_rc"], out["rm_err"] = _timed(["rm", "-rf", "node_modules"], ws)
        return out
    outside = tmp / f"outside-{kind}"
    if kind == "bind":
        (ws / "node_modules").mkdir()
    if kind == "symlink":
        outside.mkdir()
        os.symlink(outside, ws / "node_modules")
    manage.mount(str(ws), str(mnt), default_excludes=(kind != "versioned"))
    try:
        if kind == "bind":
            subprocess.run(["mount", "--bind", str(ws / "node_modules"), str(mnt / "node_modules")], check=True)
        out["create"], rc, err = _timed(create, mnt)
        if rc:
            raise RuntimeError(f"{kind}: create failed: {err}")
        out["rm"], out["rm_rc"], out["rm_err"] = _timed(["rm", "-rf", "node_modules"], mnt)
    finally:
        if kind == "bind":  # first: fusermount3 -u refuses a mount with a mount inside
            subprocess.run(["umount", str(mnt / "node_modules")], check=False)
        manage.unmount(str(mnt))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.unversioned")
    ap.add_argument("--files", type=int, default=20_000)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--only", default="native,versioned,passthrough,bind,symlink")
    args = ap.parse_args(argv)
    kinds = args.only.split(",")
    base = Path(tempfile.mkdtemp(prefix="stepfs-bench-unv-"))
    try:
        create_us, unlink_us = _per_op(base)
        print(f"native per op: create {create_us * 1e6:.0f} us, unlink {unlink_us * 1e6:.0f} us; "
              f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; files {args.files}")
        results: dict[str, list[dict]] = {k: [] for k in kinds}
        for rep in range(args.reps):  # interleaved: drift hits every kind alike
            for kind in kinds:
                tmp = base / f"{kind}-{rep}"
                tmp.mkdir()
                try:
                    results[kind].append(_case(kind, tmp, args.files))
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
        native = results.get("native")
        ref_c = min(r["create"] for r in native) if native else None
        ref_r = min(r["rm"] for r in native) if native else None
        print(f"{'kind':12} {'create s':>9} {'x native':>9} {'rm -rf s':>9} {'x native':>9}  rm exit")
        for kind in kinds:
            c = min(r["create"] for r in results[kind])
            r = min(r["rm"] for r in results[kind])
            last = results[kind][-1]
            rc = f"{last['rm_rc']}" + (f" ({last['rm_err']})" if last["rm_rc"] else "")
            print(f"{kind:12} {c:9.3f} {c / ref_c if ref_c else 0:9.2f} {r:9.3f} {r / ref_r if ref_r else 0:9.2f}  {rc}")
        print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
