"""A committed layer's deltas, made after the commit lock is released
(store/deltawork.py, store/delta.py ``after_commit``): kernel-free."""

from __future__ import annotations

import fcntl
import os
import random
import threading

from sqlalchemy import func, select

from stepfs.store import codec, delta, gc, prune, publish, schema, verify
from stepfs.store.layers import entries as load_entries
from stepfs.store.deltawork import DeltaWork
from store_kit import Stager, open_workspace


def text(seed: int, n: int = 2000) -> bytes:
    """About 100 KB of text zstd does not shrink to nothing (a delta must
    store under a fifth of the compressed chunk)."""
    rnd = random.Random(seed)
    words = [b"alpha", b"beta", b"gamma", b"delta", b"omega", b"kappa", b"sigma", b"theta", b"zeta", b"iota"]
    return b"".join(b"%d %s\n" % (i, b" ".join(rnd.choices(words, k=8))) for i in range(n))


def edited(seed: int, version: int) -> bytes:
    lines = text(seed).split(b"\n")
    lines[(version * 37) % 1900] = b"version %d edited this line" % version
    return b"\n".join(lines)


def small(seed: int, version: int) -> bytes:
    return b"".join(b'{"name": "pkg%d", "version": "1.%d.0", "line": %d}\n' % (seed, version, i) for i in range(8))


FILES = ("a.txt", "b.txt", "c.txt")
TREE = {**{name: ("file", 0o644, text(i)) for i, name in enumerate(FILES)}, "p.json": ("file", 0o644, small(1, 0))}


def commit(ws, version: int, staging: threading.Lock | None = None) -> int:
    with staging or threading.Lock():  # (gc's quiesce: no put without its row while gc runs)
        s = Stager(ws)
        for i, name in enumerate(FILES):
            s.file(name, edited(i, version))
        s.file("p.json", small(1, version))
    return publish.commit_step(ws, s.step, message=f"v{version}", overwrite={r.path for r in s.rows()})


def deltas(ws) -> int:
    with ws.db.read() as conn:
        return (conn.execute(select(func.count()).where(schema.chunks.c.codec == codec.DELTA)).scalar()
                + conn.execute(select(func.count()).where(schema.objects.c.codec == codec.DELTA)).scalar())


def delta_through(ws) -> int:
    M = schema.meta
    with ws.db.read() as conn:
        return int(conn.execute(select(M.c.value).where(M.c.key == "delta_through")).scalar() or 0)


def check_layers(ws, numbers) -> None:
    """Every file of each layer reads back as that version's bytes."""
    with ws.db.read() as conn:
        for n in numbers:
            version = n
            for e in load_entries(conn, n):
                name = e.path.decode()
                want = small(1, version) if name == "p.json" else edited(FILES.index(name), version)
                assert ws.objects.read_all(conn, e.after.oid) == want, (n, name)
    report = verify.verify(ws)
    assert report.ok, report.problems


def test_a_commit_makes_its_deltas_after_releasing_the_commit_lock(tmp_path, monkeypatch):
    ws = open_workspace(tmp_path / "ws", TREE)
    held = []

    def probing(real):
        def probe(conn, *args, **kwargs):
            # Another open file description's flock conflicts with the commit's own.
            fd = os.open(os.path.join(ws.store_dir, "commit.lock"), os.O_RDWR)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held.append(False)
            except BlockingIOError:
                held.append(True)
            finally:
                os.close(fd)
            return real(conn, *args, **kwargs)
        return probe

    for name in ("plan_pair", "plan_inline", "apply"):  # the pass's reads and its writes
        monkeypatch.setattr(delta, name, probing(getattr(delta, name)))
    for v in (1, 2):
        commit(ws, v)
    assert held and not any(held), held  # every file's delta ran with the lock free
    assert deltas(ws) >= 2 * (len(FILES) + 1) and delta_through(ws) == 2
    check_layers(ws, [1, 2])
    ws.close()


def test_the_background_thread_makes_every_layers_deltas_and_gc_finds_none_left(tmp_path):
    ws = open_workspace(tmp_path / "ws", TREE)
    ws.deltas.start()
    for v in range(1, 6):
        commit(ws, v)
    assert ws.deltas.wait_idle(60)
    assert delta_through(ws) == 5
    assert deltas(ws) >= 5 * (len(FILES) + 1)
    report = gc.collect(ws)
    assert report.deltas == 0  # nothing left for gc's pass
    check_layers(ws, range(1, 6))
    ws.close()


def test_a_pass_stopped_between_files_leaves_whole_objects_and_gc_finishes_it(tmp_path, monkeypatch):
    """What a crash or an unmount mid-pass leaves: some files deltas, the
    rest whole, ``delta_through`` not raised; every byte reads back, and
    gc's pass does the rest."""
    monkeypatch.setattr(DeltaWork, "submit", lambda self, number: None)  # no pass at the commit: run below
    ws = open_workspace(tmp_path / "ws", TREE)
    commit(ws, 1)
    assert deltas(ws) == 0 and delta_through(ws) == 0
    asked = []

    def go() -> bool:
        asked.append(1)
        return len(asked) <= 2  # two files, then "stop"

    done, _saved = delta.after_commit(ws, 1, go=go)
    assert done == 2 and deltas(ws) == 2 and delta_through(ws) == 0
    check_layers(ws, [1])
    report = gc.collect(ws)
    assert report.deltas == len(FILES) + 1 - 2 and delta_through(ws) == 1
    again, _ = delta.after_commit(ws, 1)  # idempotent: every row is a delta already
    assert again == 0 and deltas(ws) == len(FILES) + 1
    check_layers(ws, [1])
    ws.close()


def test_passes_racing_gc_and_prune_never_leave_a_broken_chain(tmp_path):
    """The background pass, gc (its sweep and its own pass) and prune run
    at once: a delta never names a base gc deleted, and no chain grows a
    second link (verify checks both)."""
    ws = open_workspace(tmp_path / "ws", TREE)
    ws.deltas.start()
    done = threading.Event()
    staging = threading.Lock()
    errors: list[BaseException] = []

    def churn() -> None:
        try:
            while not done.is_set():
                prune.prune(ws, keep_last=3)
                with staging:
                    gc.collect(ws, vacuum=False)
        except BaseException as exc:  # reported below
            errors.append(exc)

    t = threading.Thread(target=churn)
    t.start()
    try:
        for v in range(1, 13):
            commit(ws, v, staging)
    finally:
        done.set()
        t.join(120)
    assert not errors, errors
    assert ws.deltas.wait_idle(60)
    gc.collect(ws)
    with ws.db.read() as conn:
        kept = conn.execute(select(schema.layers.c.number).where(schema.layers.c.state == "committed",
                                                                   schema.layers.c.number > 0)).scalars().all()
    assert 12 in kept
    check_layers(ws, [n for n in kept if n >= 10])
    ws.close()


def test_closing_the_workspace_does_the_layers_still_queued(tmp_path):
    """An unmount leaves a compact store: the queue is drained (within
    STOP_WAIT) when the workspace closes, without waiting for quiet."""
    ws = open_workspace(tmp_path / "ws", TREE)
    ws.deltas.start()
    for v in range(1, 4):
        commit(ws, v)
    ws.close()
    ws = open_workspace(tmp_path / "ws")
    assert delta_through(ws) == 3 and deltas(ws) >= 3 * (len(FILES) + 1)
    check_layers(ws, range(1, 4))
    ws.close()
