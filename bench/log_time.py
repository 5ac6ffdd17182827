"""Time ``stepfs log`` on a store of many layers, with and without the
remembered line counts (store/linecounts.py).

    .venv/bin/python -m bench.log_time --layers 200 --files 40 --edits 10 DIR
    .venv/bin/python -m bench.log_time --existing WS     # a copy of a real store

Builds (unless ``--existing``) a workspace in DIR whose layers each edit one
line of ``--edits`` of ``--files`` text files (steps staged and committed
through the store, no kernel), then times the CLI's read-only ``log`` path
(``cards.log_of`` on ``cardrows.open_readonly``) in-process, first with the
counts table emptied (every line count computed, as before the table), then
with the rows a reader remembers.  The store at DIR is changed: run
``--existing`` on a copy.  Prints the load average with the numbers.
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import stat as stat_mod
import statistics
import time

from stepfs.overlayfs.client import reads
from stepfs.store import cards, publish, staging, tokens
from stepfs.store.paths import DB_NAME, STORE_DIR
from stepfs.store.workspace import Workspace


def _text(i: int, version: int) -> bytes:
    lines = [b"file %d line %d: some words of text for the diff\n" % (i, n) for n in range(200)]
    lines[(version * 7) % 200] = b"file %d version %d changed this line\n" % (i, version)
    return b"".join(lines)


def build(path: str, layers: int, files: int, edits: int) -> None:
    os.makedirs(path, exist_ok=True)
    for i in range(files):
        with open(os.path.join(path, f"f{i}.txt"), "wb") as f:
            f.write(_text(i, 0))
    with Workspace.open(path, create=True) as ws:
        for n in range(1, layers + 1):
            with ws.db.write() as conn:
                step = staging.open_step(conn, "/bench/mnt", agent="bench")
                for k in range(edits):
                    i = (n * edits + k) % files
                    data = _text(i, n)
                    oid = ws.objects.put_bytes(conn, data)
                    staging.put(conn, step, staging.StagedRow(
                        os.fsencode(f"f{i}.txt"), "file", stat_mod.S_IFREG | 0o644, oid, None, len(data),
                        1_600_000_000_000_000_000 + n, False, tokens.of_workspace(ws, os.fsencode(f"f{i}.txt"))))
            publish.commit_step(ws, step, message=f"step {n}",
                                overwrite={os.fsencode(f"f{(n * edits + k) % files}.txt") for k in range(edits)})


def _time_log(path: str, runs: int) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        out = reads._read_only(path, lambda rows: cards.log_of(rows))
        times.append(time.perf_counter() - t0)
        assert out is not None
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("path", nargs="?")
    ap.add_argument("--existing", help="time the store of this workspace (a copy: it is changed)")
    ap.add_argument("--layers", type=int, default=200)
    ap.add_argument("--files", type=int, default=40)
    ap.add_argument("--edits", type=int, default=10)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    path = args.existing or args.path
    if not args.existing:
        build(path, args.layers, args.files, args.edits)
    db = os.path.join(path, STORE_DIR, DB_NAME)
    with Workspace.open(path):  # makes the table in a store from before it
        pass
    with sqlite3.connect(db, isolation_level=None) as conn:
        conn.execute("DELETE FROM layer_counts")
    without = _time_log(path, args.runs)
    with Workspace.open(path) as ws:
        cards.read_log(ws, fold=False)  # a reader with the workspace open remembers the counts
    with sqlite3.connect(db, isolation_level=None) as conn:
        rows = conn.execute("SELECT count(*) FROM layer_counts").fetchone()[0]
    with_rows = _time_log(path, args.runs)
    print(f"log of {path}: {without * 1000:.0f} ms computing every line count, {with_rows * 1000:.0f} ms "
          f"with {rows} layers' remembered rows (median of {args.runs}); load average {os.getloadavg()[0]:.2f} "
          f"{os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}")


if __name__ == "__main__":
    main()
