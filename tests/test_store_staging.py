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


def test_batched_removals_are_key_lookups(db):
    """remove_trees / remove_many (a row write's recorded removals) remove
    exactly their paths and subtrees, each by a search of the primary key:
    a scan of the step's rows per removal made an rm -rf quadratic."""
    with db.write() as conn:
        step = staging.open_step(conn, "/m")
        for name in [b"a", b"a/x", b"a.x", b"b", b"b/y/z", b"b0", b"c", b"c/k", b"d"]:
            staging.put(conn, step, StagedRow(name, "dir"))
        staging.remove_trees(conn, step, [b"a", b"b"])
        staging.remove_many(conn, step, [b"c", b"nothing"])
        assert [r.path for r in staging.load(conn, step)] == [b"a.x", b"b0", b"c/k", b"d"]
        for prepared in (staging._PREPARED_DELETE, staging._PREPARED_DELETE_BELOW):
            sql, names = prepared._compiled(conn.dialect)[:2]
            plan = conn.exec_driver_sql("EXPLAIN QUERY PLAN " + sql, tuple([step] + [b"a"] * (len(names) - 1)))
            details = [row[-1] for row in plan]
            assert any("USING" in d and "path" in d for d in details), details


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
