"""Shared-history numbers (issue 22), against a throwaway local PostgreSQL
server (tests/pgserver.py) and the SQLite default, library calls only (no
mount; the mount's request path does not touch the history):

* step commit latency for 1, 10 and 100 files: a plain local commit
  against an attached workspace's step (pull, commit, upload, CAS publish);
* clone of an N-file history against ``cp -a`` of the same tree;
* ``log`` of the shared history (one query) with L layers;
* sync of a workspace 10 layers behind;
* the floor under a shared step here (``--only floor``, with ``step``):
  a new session with one single-row durable commit, the commit alone on a
  held session, and one 8 KiB write with ``fdatasync`` on the local disk,
  psycopg alone (no stepfs): what any client pays per step for a new
  connection and one flushed transaction on this machine at this load.

    .venv/bin/python bench/shared_history.py [--files N] [--layers L] [--reps R] [--only step,floor,sync,log,clone]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from pgserver import PgServer  # noqa: E402
from store_kit import Stager  # noqa: E402

from stepfs.cli import main as cli_main  # noqa: E402
from stepfs.overlayfs.client import manage, shared as client  # noqa: E402
from stepfs.store import publish  # noqa: E402
from stepfs.store.shared import sync  # noqa: E402
from stepfs.store.shared import tables as T  # noqa: E402
from stepfs.store.shared.remote import ENTRY_COLUMNS, LayerRecord, Remote  # noqa: E402
from stepfs.store.shared.url import parse  # noqa: E402
from stepfs.store.workspace import Workspace  # noqa: E402


def _ws(root: Path, files: int = 0) -> Path:
    root.mkdir()
    for i in range(files):
        d = root / f"d{i % 50}"
        d.mkdir(exist_ok=True)
        (d / f"f{i}.txt").write_bytes(f"file {i}\n".encode() * 20)
    Workspace.open(str(root), create=True).close()
    return root


def _stage(ws_path: Path, n: int, tag: str) -> None:
    with Workspace.open(str(ws_path)) as ws:
        st = Stager(ws)
        for i in range(n):
            st.file(f"{tag}-{i}.txt", f"{tag} {i}\n".encode() * 10)


def _p95(xs: list[float]) -> float:
    return sorted(xs)[max(0, int(round(0.95 * len(xs))) - 1)]


def step_latency(tmp: Path, url: str, reps: int) -> dict:
    """Per size, three steps in turn each repetition: the library commit of
    an open plain workspace (``publish.commit_step``, the store's own
    cost), ``manage.step`` of a plain workspace (what ``stepfs step`` does
    without a mount: open the workspace, commit, close) and the step of an
    attached workspace (the same plus the history: connect, lock, pull,
    upload, publish)."""
    out = {}
    for n in (1, 10, 100):
        local, plain, shared = [], [], []
        a = _ws(tmp / f"local{n}")
        p = _ws(tmp / f"plain{n}")
        b = _ws(tmp / f"shared{n}")
        client.attach(str(b), url.replace("name=proj", f"name=step{n}"))
        for r in range(reps):
            _stage(a, n, f"r{r}")
            with Workspace.open(str(a)) as ws:
                step_id = Stager(ws).step
                t = time.perf_counter()
                publish.commit_step(ws, step_id)
                local.append(time.perf_counter() - t)
            _stage(p, n, f"r{r}")
            t = time.perf_counter()
            manage.step(manage.Target(str(p)))
            plain.append(time.perf_counter() - t)
            _stage(b, n, f"r{r}")
            t = time.perf_counter()
            client.step(manage.Target(str(b)))
            shared.append(time.perf_counter() - t)
        out[n] = {"sqlite_median_ms": 1e3 * statistics.median(local),
                  "sqlite_step_median_ms": 1e3 * statistics.median(plain),
                  "shared_median_ms": 1e3 * statistics.median(shared), "shared_p95_ms": 1e3 * _p95(shared),
                  "ratio": statistics.median(shared) / statistics.median(local),
                  "ratio_to_step": statistics.median(shared) / statistics.median(plain)}
    return out


def floor(tmp: Path, url: str, reps: int) -> dict:
    import psycopg

    conninfo = url.split("&name=")[0]
    with psycopg.connect(conninfo, autocommit=True) as c:
        c.execute("CREATE TABLE bench_floor (id bigint, v text)")

    def session_commit():
        with psycopg.connect(conninfo, autocommit=True) as c:
            c.execute("INSERT INTO bench_floor VALUES (1, 'x')")

    def flush():
        fd = os.open(tmp / "floor.bin", os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            os.write(fd, b"x" * 8192)
            os.fdatasync(fd)
        finally:
            os.close(fd)

    def timed(fn) -> dict:
        xs = []
        for _ in range(max(reps, 20)):
            t = time.perf_counter()
            fn()
            xs.append(time.perf_counter() - t)
        return {"median_ms": 1e3 * statistics.median(xs), "p95_ms": 1e3 * _p95(xs)}

    with psycopg.connect(conninfo, autocommit=True) as held:
        out = {"session_and_commit": timed(session_commit),
               "commit_on_held_session": timed(lambda: held.execute("INSERT INTO bench_floor VALUES (1, 'x')")),
               "local_8k_fdatasync": timed(flush)}
        held.execute("DROP TABLE bench_floor")
    return out


def clone_time(tmp: Path, url: str, files: int, reps: int) -> dict:
    """``reps`` pairs, each a clone then ``cp -a`` of the same tree (the
    ratio taken pair by pair: the machine's speed drifts between minutes)."""
    a = _ws(tmp / "big", files)
    u = url.replace("name=proj", "name=big")
    t = time.perf_counter()
    client.attach(str(a), u)
    attach_s = time.perf_counter() - t
    clones, cps = [], []
    for r in range(reps):
        # Each starts on a clean page cache: the clone's one syncfs would
        # otherwise also write back what the cp -a (or a removal) before it left.
        os.sync()
        t = time.perf_counter()
        sync.clone(parse(u), str(tmp / f"big-clone{r}"))
        clones.append(time.perf_counter() - t)
        os.sync()
        t = time.perf_counter()
        subprocess.run(["cp", "-a", str(a), str(tmp / f"big-cp{r}")], check=True)
        cps.append(time.perf_counter() - t)
        shutil.rmtree(tmp / f"big-clone{r}")
        shutil.rmtree(tmp / f"big-cp{r}")
    return {"files": files, "attach_s": attach_s, "clone_median_s": statistics.median(clones),
            "cp_a_median_s": statistics.median(cps),
            "ratio_median": statistics.median(c / p for c, p in zip(clones, cps)), "clone_s": clones, "cp_a_s": cps}


def log_time(url: str, layers: int) -> dict:
    u = parse(url.replace("name=proj", "name=long"))
    with Remote.open(u) as r:
        rec = LayerRecord(0, "baseline", 1, "m", "", "", {}, "w" * 32, "/ws", "host", None)
        r.create(rec, [])
        # Built in one transaction (a publish each would be a durable commit
        # each): every layer adds, changes and removes a symlink, as a step would.
        rows, entries = [], []
        for n in range(1, layers + 1):
            rows.append({**rec.as_dict(), "number": n, "kind": "step", "meta": "{}", "history": u.name})
            for i, (before, after) in enumerate(((None, "symlink"), ("symlink", "symlink"), ("symlink", None))):
                entries.append({c: None for c in ENTRY_COLUMNS} | {
                    "history": u.name, "layer": n, "path": f"d{n % 50}/l{n}-{i}".encode(),
                    "before_kind": before, "before_mode": 0o777 if before else None,
                    "before_target": b"t" if before else None, "after_kind": after,
                    "after_mode": 0o777 if after else None, "after_target": b"t" if after else None})
        with r.tx() as conn:
            conn.execute(T.layers.insert(), rows)
            conn.execute(T.entries.insert(), entries)
            conn.execute(T.histories.update().where(T.histories.c.name == u.name).values(head=layers))
    def cli(*extra: str) -> float:
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "stepfs.cli.main", "log", "--history", u.text, *extra], check=True,
                       capture_output=True)
        return time.perf_counter() - t

    def inside(*extra: str) -> float:
        """The command in this process (interpreter and imports paid already):
        connect, schema check, the log's query, the rendering."""
        args = cli_main.build_parser().parse_args(["log", "--history", u.text, *extra])
        t = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            args.func(args)
        return time.perf_counter() - t

    out = {"layers": layers}
    for name, extra in (("limit_50", ("--limit", "50")), ("all_json", ("--json",))):
        out[f"log_{name}_in_process_median_s"] = statistics.median(inside(*extra) for _ in range(5))
        out[f"log_{name}_cli_median_s"] = statistics.median(cli(*extra) for _ in range(3))
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import sqlalchemy.dialects.postgresql.psycopg, psycopg"], check=True)
    out["python_sqlalchemy_psycopg_import_s"] = time.perf_counter() - t
    # What the CLI's log imports instead (store/shared/logread.py: psycopg alone).
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import psycopg"], check=True)
    out["python_psycopg_import_s"] = time.perf_counter() - t
    return out


def sync_behind(tmp: Path, url: str) -> dict:
    u = url.replace("name=proj", "name=behind")
    a = _ws(tmp / "sa", 10)
    client.attach(str(a), u)
    b = Path(sync.clone(parse(u), str(tmp / "sb"))[0])
    for i in range(10):
        _stage(a, 10, f"l{i}")
        client.step(manage.Target(str(a)))
    t = time.perf_counter()
    res = client.sync_workspace(manage.Target(str(b)))
    return {"layers_behind": len(res["pulled"]), "sync_s": time.perf_counter() - t}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--files", type=int, default=10000)
    p.add_argument("--layers", type=int, default=10000)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--only", default="step,floor,sync,log,clone",
                   help="comma-separated: step, floor, sync, log, clone")
    args = p.parse_args()
    only = set(args.only.split(","))
    server = PgServer(durable=True)  # PostgreSQL's defaults: every commit flushed, as SQLite's are
    tmp = Path(tempfile.mkdtemp(prefix="stepfs-bench-shared-"))
    try:
        server.start()
        url = server.url(server.new_database())
        result = {"load_before": os.getloadavg()}
        if "step" in only:
            result["step"] = step_latency(tmp, url, args.reps)
        if "floor" in only:
            result["floor"] = floor(tmp, url, args.reps)
        if "sync" in only:
            result["sync_10_behind"] = sync_behind(tmp, url)
        if "log" in only:
            result["log"] = log_time(url, args.layers)
        if "clone" in only:
            result["clone"] = clone_time(tmp, url, args.files, max(1, min(args.reps, 5)))
        result["load_after"] = os.getloadavg()
        print(json.dumps(result, indent=1))
    finally:
        server.destroy()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
