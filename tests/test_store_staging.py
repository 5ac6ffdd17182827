"""Open steps and staged rows (kernel-free tier, in-memory store)."""

from __future__ import annotations

import pytest

from stepfs.store import staging
from stepfs.store.db import Database
from stepfs.store.staging import StagedRow


@pytest.fixture
def db():
    d = Database.memory()
    yield d
    d.close()


def test_one_open_step_per_mountpoint(db):
    with db.write() as conn:
        a = staging.open_step(conn, "/m/a", agent="x")
        assert staging.open_step(conn, "/m/a") == a
        b = staging.open_step(conn, "/m/b")
        assert b != a
        staging.put(conn, a, StagedRow(b"f", "file", 0o100644, size=3))
    with db.read() as conn:
        counts = {s["mountpoint"]: s["staged"] for s in staging.list_steps(conn)}
    assert counts == {"/m/a": 1, "/m/b": 0}


def test_put_replaces_the_row_of_a_path(db):
    with db.write() as conn:
        step = staging.open_step(conn, "/m")
        staging.put(conn, step, StagedRow(b"p", "file", 0o100644, size=1, base="tok1"))
        staging.put(conn, step, StagedRow(b"p", "whiteout", base="tok1"))
        assert staging.load(conn, step) == [StagedRow(b"p", "whiteout", base="tok1")]


def test_remove_tree_removes_exactly_the_subtree(db):
    names = [b"d", b"d/x", b"d/sub/y", b"d-x", b"d.x", b"d0", b"d2/z", b"e", b"d\xff", b"d/\xff"]
    with db.write() as conn:
        step = staging.open_step(conn, "/m")
        other = staging.open_step(conn, "/other")
        for name in names:
            staging.put(conn, step, StagedRow(name, "dir"))
        staging.put(conn, other, StagedRow(b"d/x", "dir"))
        staging.remove_tree(conn, step, b"d")
        assert [r.path for r in staging.load(conn, step)] == sorted(
            [b"d-x", b"d.x", b"d0", b"d2/z", b"e", b"d\xff"])
        assert [r.path for r in staging.load(conn, other)] == [b"d/x"]  # other steps untouched
        staging.remove(conn, step, b"e")
        assert b"e" not in [r.path for r in staging.load(conn, step)]


def test_put_many_inserts_and_replaces_every_field_in_one_statement(db):
    full = StagedRow(b"q", "file", 0o100600, oid=None, target=None, size=9, mtime_ns=5, opaque=False,
                     base="tok", uid=7, gid=8, xattrs=b"\x00x", link_group=3)
    with db.write() as conn:
        step = staging.open_step(conn, "/m")
        other = staging.open_step(conn, "/other")
        staging.put(conn, other, StagedRow(b"q", "dir"))
        staging.put(conn, step, StagedRow(b"p", "file", 0o100644, size=1, base="tok1"))
        staging.put_many(conn, step, [
            StagedRow(b"p", "symlink", 0o120777, target=b"t", size=1, base="tok2"),  # replaced
            full,  # new
        ])
        assert staging.load(conn, step) == [
            StagedRow(b"p", "symlink", 0o120777, target=b"t", size=1, base="tok2"), full]
        staging.put_many(conn, step, [StagedRow(b"q", "dir", 0o40755, opaque=True)])  # every field replaced
        assert staging.load(conn, step)[1] == StagedRow(b"q", "dir", 0o40755, opaque=True)
        assert staging.load(conn, other) == [StagedRow(b"q", "dir")]  # the same path of another step
        staging.put_many(conn, step, [])
