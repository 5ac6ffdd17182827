"""What the backing filesystem itself charges per operation, printed at the
start of every run: a benchmark ratio against fuse-overlayfs shows
stepfs's own cost only where the disk is fast, and drifts toward 1 where
creating a file is slow (issue 19), so every run says which kind of disk
it had.  Measured in the run's temp root, where every target's data lives.
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from pathlib import Path

#: Files created, rewritten and unlinked per measurement.
COUNT = 1000


def measure(tmp: Path, count: int = COUNT) -> dict[str, float]:
    """Median seconds per create (``open(O_CREAT|O_EXCL)`` + ``close``),
    per 4 KiB close-write (open an existing 4 KiB file, rewrite it,
    ``close``: the whole cycle, and the ``close`` alone) and per unlink,
    over ``count`` files in 10 directories."""
    root = tmp / "native-cost"
    root.mkdir()
    try:
        dirs = [root / f"d{i}" for i in range(10)]
        for d in dirs:
            d.mkdir()
        names = [str(dirs[i % 10] / f"f{i}") for i in range(count)]
        data = b"x" * 4096
        create, rewrite, close, unlink = [], [], [], []
        for name in names:
            t0 = time.perf_counter()
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            os.close(fd)
            create.append(time.perf_counter() - t0)
        for name in names:
            t0 = time.perf_counter()
            fd = os.open(name, os.O_WRONLY)
            os.pwrite(fd, data, 0)
            t1 = time.perf_counter()
            os.close(fd)
            t2 = time.perf_counter()
            rewrite.append(t2 - t0)
            close.append(t2 - t1)
        for name in names:
            t0 = time.perf_counter()
            os.unlink(name)
            unlink.append(time.perf_counter() - t0)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"create": statistics.median(create), "close_write_4k": statistics.median(rewrite),
            "close_4k": statistics.median(close), "unlink": statistics.median(unlink)}


def text(cost: dict[str, float]) -> str:
    us = {k: f"{v * 1e6:.1f} us" for k, v in cost.items()}
    return (f"native cost per operation on the backing filesystem: create {us['create']}, "
            f"unlink {us['unlink']}, 4 KiB rewrite + close {us['close_write_4k']} (the close alone "
            f"{us['close_4k']})")
