"""The bench's store breakdown (``bench/store_bytes.py``) and the agent
session's like-for-like comparison with shadow-git (``bench/session.py``).

The breakdown is what issue 20's format work is measured by: it must name
every table and index with bytes that add up to the file, count rows, and
leave the store it reads untouched.  The session must version
``node_modules`` in stepfs, since shadow-git (no ``.gitignore``) commits it:
with the default unversioned paths stepfs would skip the bytes git is
charged for, and the ratio would flatter stepfs.
"""

from __future__ import annotations

import hashlib
import os
import sqlite3
import sys

import pytest

from stepfs.store import entryrows, publish

from conftest import ROOT, fuse_problem
from store_kit import Stager, drop_format_8, open_workspace

if str(ROOT) not in sys.path:  # the bench is a directory of the repository, not an installed package
    sys.path.insert(0, str(ROOT))
from bench import session, store_bytes  # noqa: E402
from mountguard import private_tmp  # noqa: F401


def _commit(ws, files: dict[str, bytes]) -> int:
    s = Stager(ws)
    for path, data in files.items():
        s.file(path, data)
    return publish.commit_step(ws, s.step, message="m", agent="a", mount="/m",
                               overwrite={r.path for r in s.rows()})


def test_breakdown_names_every_table_adds_up_and_leaves_the_store_alone(tmp_path):
    ws = open_workspace(tmp_path / "ws")
    for k in range(3):
        _commit(ws, {f"f{i}.txt": b"version %d of file %d\n" % (k, i) * 50 for i in range(40)})
    db = str(tmp_path / "ws" / ".stepfs" / "store.db")
    ws.close()
    with open(db, "rb") as f:
        before = hashlib.sha256(f.read()).hexdigest()
    b = store_bytes.breakdown(db)
    with open(db, "rb") as f:
        assert hashlib.sha256(f.read()).hexdigest() == before
    assert b["rows"]["path_layers"] == 120 and b["rows"]["layers"] == 4
    assert b["rows"]["layer_entries"] == 3 and b["rows"]["paths"] == 40  # a list a layer (format 8)
    assert {"paths", "layer_entries", "path_layers", "objects", "layers", "meta"} <= set(b["by_name"])
    # every page is a B-tree's but auto_vacuum's pointer maps (a page per ~1000)
    assert sum(s["bytes"] for s in b["by_name"].values()) + b["other_bytes"] == b["file_bytes"]
    assert 0 <= b["other_bytes"] <= b["page_size"] * (1 + b["file_bytes"] // (b["page_size"] * 800))
    assert b["file_bytes"] % b["page_size"] == 0
    assert b["by_name"]["path_layers"]["cells"] >= 120
    text = store_bytes.render(b)
    assert "layer_entries" in text and "rows: " in text


def test_breakdown_of_a_missing_store_fails_loudly(tmp_path):
    with pytest.raises(sqlite3.OperationalError):
        store_bytes.breakdown(str(tmp_path / "none.db"))


@pytest.mark.mount
@pytest.mark.timeout(110)
def test_session_versions_node_modules_like_shadow_git(private_tmp):  # noqa: F811
    problem = fuse_problem()
    if problem:
        pytest.fail(f"REAL-MOUNT TEST CANNOT RUN: {problem}", pytrace=False)
    base = private_tmp / "session"
    base.mkdir()
    out = session.run(base, steps=20, nm_files=40, keep_last=5)
    con = sqlite3.connect(str(base / "ws" / ".stepfs" / "store.db"))
    try:
        nm = sum(e.after.kind == "file" and e.path.startswith(b"node_modules/") for e in
                 entryrows.layer_entries(lambda q, p=(): con.execute(q, p).fetchall(), 20))
    finally:
        con.close()
    # step 20 reinstalled 40 files; prune kept layer 20 as it was
    assert nm == 40
    assert os.path.isdir(base / "ws" / "node_modules")
    assert out["git_bytes"] > 0 and out["store_after_gc"] > 0
    assert out["store_tables_after_gc"]["layer_entries"] > 0


def test_format8_estimate_layouts_keep_every_entry_and_shrink(tmp_path):
    from bench import format8_estimate as f8

    ws = open_workspace(tmp_path / "ws")
    for k in range(4):
        _commit(ws, {f"f{i}.txt": b"version %d of file %d\n" % (k, i) * (1 + i % 5) for i in range(60)})
    db = str(tmp_path / "ws" / ".stepfs" / "store.db")
    ws.close()
    src = sqlite3.connect(db)
    drop_format_8(src)  # the estimate measures layouts against a format-7 store
    src.execute("UPDATE meta SET value = '7' WHERE key = 'format_version'")
    src.commit()
    want = {}
    for row in src.execute(f"SELECT layer, path, {', '.join(f8.COLS)} FROM entries"):
        want[(row[0], bytes(row[1]))] = tuple(f8.KINDS[v] if f8.COLS[i].endswith("_kind") else
                                              (bytes(v) if isinstance(v, bytes) else v)
                                              for i, v in enumerate(row[2:]))
    src.close()
    for layout in ("B", "D"):
        dst = str(tmp_path / f"{layout}.db")
        f8.build(db, dst, layout, block=25)
        c = sqlite3.connect(dst)
        names = {i: bytes(n) for i, _, n in c.execute("SELECT id, parent, name FROM paths")}  # top-level names
        key = {i: bytes(k) for i, k in c.execute("SELECT id, oid FROM objects")} if layout == "D" else None
        got = {}
        for layer, blob in c.execute("SELECT layer, data FROM layer_entries"):
            for row in f8.read_list(blob):
                values = tuple(key[v] if key and f8.COLS[i].endswith("_oid") and v is not None else v
                               for i, v in enumerate(row[1:]))
                got[(layer, names[row[0]])] = values
        pairs = c.execute("SELECT count(*) FROM path_layers").fetchone()[0]
        c.close()
        assert got == want, layout
        assert pairs == len(want)
    sizes = f8.estimate(db)
    assert set(sizes) == {"format 7", *f8.LAYOUTS} and all(v > 0 for v in sizes.values())
