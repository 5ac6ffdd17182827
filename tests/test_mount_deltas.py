"""A mount's deltas (real FUSE): made by the daemon's background thread
after each step, not inside it (store/deltawork.py), and drained at
unmount; every layer reads back the same bytes."""

from __future__ import annotations

import random
import sqlite3

import pytest

from conftest import stepfs, wait_for
from stepfs.overlayfs.client import manage
from stepfs.store import verify
from stepfs.store.layers import entries as load_entries
from stepfs.store.workspace import Workspace

pytestmark = pytest.mark.mount


def body(seed: int = 7, n: int = 2000) -> bytes:
    rnd = random.Random(seed)
    words = [b"alpha", b"beta", b"gamma", b"delta", b"omega", b"kappa", b"sigma", b"theta"]
    return b"".join(b"%d %s\n" % (i, b" ".join(rnd.choices(words, k=8))) for i in range(n))


def version(v: int) -> bytes:
    lines = body().split(b"\n")
    lines[(v * 37) % 1900] = b"version %d edited this line" % v
    return b"\n".join(lines)


def small(v: int) -> bytes:
    return b"".join(b'{"name": "pkg", "version": "1.%d.0", "line": %d}\n' % (v, i) for i in range(8))


def store_state(workspace) -> tuple[int, int]:
    """(delta rows, meta.delta_through), read as another process would."""
    db = sqlite3.connect(f"file:{workspace / '.stepfs' / 'store.db'}?mode=ro", uri=True, timeout=10)
    try:
        rows = db.execute("SELECT (SELECT count(*) FROM chunks WHERE codec = 2)"
                          " + (SELECT count(*) FROM objects WHERE codec = 2)").fetchone()[0]
        through = db.execute("SELECT value FROM meta WHERE key = 'delta_through'").fetchone()
        return rows, int(through[0]) if through else 0
    finally:
        db.close()


def test_the_daemon_makes_each_steps_deltas_in_the_background_and_drains_them_at_unmount(workspace, mount):
    (workspace / "big.txt").write_bytes(body())
    (workspace / "p.json").write_bytes(small(0))
    m = mount(workspace)
    for v in (1, 2):
        m.path("big.txt").write_bytes(version(v))
        m.path("p.json").write_bytes(small(v))
        r = stepfs("step", m.mountpoint, "-m", f"v{v}")
        assert r.returncode == 0, r.stderr.decode()
    # Made once the daemon is idle (the step answered before them).
    rows, _ = wait_for(lambda: (s := store_state(workspace))[1] == 2 and s, what="layer 2's deltas")
    assert rows >= 4  # each layer: big.txt's edited chunk and p.json
    # A step right before the unmount: its deltas are made before the daemon exits.
    m.path("big.txt").write_bytes(version(3))
    m.path("p.json").write_bytes(small(3))
    r = stepfs("step", m.mountpoint, "-m", "v3")
    assert r.returncode == 0, r.stderr.decode()
    manage.unmount(str(m.mountpoint))
    rows, through = store_state(workspace)
    assert through == 3 and rows >= 6
    with Workspace.open(str(workspace)) as ws:
        with ws.db.read() as conn:
            for v in (1, 2, 3):
                got = {e.path: ws.objects.read_all(conn, e.after.oid) for e in load_entries(conn, v)}
                assert got == {b"big.txt": version(v), b"p.json": small(v)}, v
        result = verify.verify(ws)
        assert result.ok, result.problems
