"""The entry seam (store/entrytable.py, store/entryrows.py) against a model
(kernel-free).

Every query is checked against the answer computed in Python from the
layers' entry lists alone (``layer_entries`` of each committed layer), so
that a new entry layout (docs/format8.md) passes this file by answering the
same questions, whatever it stores.  The history has paths whose byte order
straddles a directory's subtree (``d.txt`` and ``d0`` around ``d/``), a
directory made and removed, deletions, a symlink, a hard-linked pair, a
voided layer and a pruned one.
"""

from __future__ import annotations

import os

import pytest
from sqlalchemy import update

from stepfs.store import entrytable, layers, prune, publish, schema, staging
from stepfs.store.records import Entry
from store_kit import Stager, open_workspace


def _linked(ws, s: Stager, names: list[str], data: bytes) -> None:
    with ws.db.write() as conn:
        oid = ws.objects.put_bytes(conn, data)
        for name in names:
            staging.put(conn, s.step, staging.StagedRow(
                os.fsencode(name), "file", 0o100644, oid, None, len(data), 1_600_000_000_000_000_000,
                False, "absent", link_group=1))


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    path = tmp_path_factory.mktemp("entrytable") / "ws"
    w = open_workspace(path, {"d": ("dir", 0o755), "d/x": ("file", 0o644, b"x0\n"),
                              "d.txt": ("file", 0o644, b"t0\n"), "d0": ("file", 0o644, b"z0\n")})
    for i in range(1, 9):
        s = Stager(w)
        s.file("d/x", b"x%d\n" % i)
        if i == 2:
            s.dir("d/sub")
            s.file("d/sub/y", b"y\n")
            s.file("d.txt", b"t2\n")
        if i == 3:
            s.symlink("d/ln", "x")
            _linked(w, s, ["h1", "h2"], b"one inode\n" * 50)
        if i == 4:
            s.file("d0", b"z4\n")
            s.whiteout("d/sub/y")
            s.whiteout("d/sub")
        if i == 6:
            s.file("d/sub2", b"new\n")
        if i == 7:
            s.whiteout("d.txt")
        assert publish.commit_step(w, s.step, message=f"step {i}", overwrite={r.path for r in s.rows()}) == i
    prune.prune(w, keep_last=7)  # layers 0 and 1 fold into 2
    with w.db.write() as conn:  # a void layer's rows are never history
        conn.execute(schema.layers.insert().values(number=9, state="void", kind="step", created_ns=0))
        entrytable.insert(conn, 9, [Entry(b"d/x", layers.State("file"), layers.State(None), None),
                                    Entry(b"ghost", layers.State(None), layers.State("dir", 0o755), None)])
    yield w
    w.close()


def model(ws) -> dict[int, list[Entry]]:
    """Each committed layer's entries, from the one-layer query alone."""
    with ws.db.read() as conn:
        return {n: entrytable.layer_entries(conn, n) for n in layers.committed_numbers(conn)}


def as_pairs(rows) -> list[tuple[int, Entry]]:
    return [(r.layer, entrytable.entry_from_row(r)) for r in rows]


def expected(ws, want) -> list[tuple[int, Entry]]:
    """The committed (layer, entry) pairs ``want(layer, entry)`` accepts, by path then layer."""
    return sorted(((n, e) for n, es in model(ws).items() for e in es if want(n, e)), key=lambda p: (p[1].path, p[0]))


def below(path: bytes, d: bytes) -> bool:
    return d == b"." or path.startswith(d + b"/")


def test_the_model_sees_the_fold_and_not_the_void_layer(ws):
    m = model(ws)
    assert sorted(m) == list(range(2, 9))
    assert all(e.path != b"ghost" for es in m.values() for e in es)
    assert [e.path for e in m[2]] == sorted(e.path for e in m[2])  # path order


@pytest.mark.parametrize("path", [b"d/x", b"d.txt", b"d/sub", b"ghost", b"never"])
def test_path_rows(ws, path):
    with ws.db.read() as conn:
        assert as_pairs(entrytable.path_rows(conn, path)) == expected(ws, lambda n, e: e.path == path)


@pytest.mark.parametrize("d", [b".", b"d", b"d/sub", b"d0", b"nothing"])
def test_rows_under_is_the_subtree_only(ws, d):
    with ws.db.read() as conn:
        got = as_pairs(entrytable.rows_under(conn, d))
    assert got == expected(ws, lambda n, e: below(e.path, d))
    if d == b"d":
        assert {e.path for _n, e in got} >= {b"d/x", b"d/sub/y", b"d/ln", b"d/sub2"}
        assert not {b"d", b"d.txt", b"d0"} & {e.path for _n, e in got}


def test_all_rows(ws):
    with ws.db.read() as conn:
        assert as_pairs(entrytable.all_rows(conn)) == expected(ws, lambda n, e: True)


@pytest.mark.parametrize("after, through, paths", [
    (2, 8, None), (3, 5, None), (5, 8, [b"d"]), (2, None, [b"d.txt", b"h1"]), (4, None, None), (8, None, None),
    (2, 8, [b"."]), (1, 3, [b"d/sub"]),
])
def test_rows_touched(ws, after, through, paths):
    top = through if through is not None else 10 ** 9

    def wanted(path: bytes) -> bool:
        return paths is None or any(path == p or below(path, p) for p in paths)

    touched = {e.path for n, e in expected(ws, lambda n, e: after < n <= top and wanted(e.path))}
    with ws.db.read() as conn:
        got = as_pairs(entrytable.rows_touched(conn, after, through, paths))
    assert got == expected(ws, lambda n, e: e.path in touched)


@pytest.mark.parametrize("number", range(2, 10))
def test_newest_at_or_before_and_oldest_after(ws, number):
    for path in (b"d/x", b"d0", b"d/sub/y", b"d.txt", b"ghost"):
        mine = expected(ws, lambda n, e: e.path == path)
        with ws.db.read() as conn:
            newest = entrytable.newest_at_or_before(conn, path, number)
            oldest = entrytable.oldest_after(conn, path, number)
        at_or_before = [p for p in mine if p[0] <= number]
        after = [p for p in mine if p[0] > number]
        assert (as_pairs([newest]) if newest is not None else []) == at_or_before[-1:]
        assert (as_pairs([oldest]) if oldest is not None else []) == after[:1]


def test_path_history_and_layers_touching(ws):
    with ws.db.read() as conn:
        rows = entrytable.path_history(conn, b"d/x", limit=3)
        touching = set(conn.execute(entrytable.layers_touching(b"d/sub")).scalars())
    assert [r.layer for r in rows] == [8, 7, 6]
    assert [r.message for r in rows] == ["step 8", "step 7", "step 6"]
    assert touching == {n for n, e in expected(ws, lambda n, e: e.path == b"d/sub" or below(e.path, b"d/sub"))}


def test_links_and_modified_files(ws):
    with ws.db.read() as conn:
        assert entrytable.ever_linked(conn, b"h1") and entrytable.ever_linked(conn, b"h2")
        assert not entrytable.ever_linked(conn, b"d/x")
        for n, es in model(ws).items():
            want = sorted((e.before.oid, e.after.oid) for e in es
                          if e.before.kind == e.after.kind == "file" and e.before.oid != e.after.oid)
            assert sorted((b, a) for b, a, _size, _inline in entrytable.modified_files(conn, n)) == want, n


def test_object_references(ws):
    m = model(ws)
    committed = {(n, e.path, e.before.oid, e.after.oid) for n, es in m.items() for e in es}
    with ws.db.read() as conn:
        everything = {(r[0], bytes(r[1]), r[2], r[3]) for r in entrytable.object_refs(conn)}
        assert {(r[0], bytes(r[1]), r[2], r[3]) for r in entrytable.committed_object_refs(conn)} == committed
        assert everything == committed | {(9, b"d/x", None, None), (9, b"ghost", None, None)}
        assert entrytable.referenced_oids(conn) == {x for _n, _p, b, a in committed for x in (b, a) if x}
        assert entrytable.referenced_oids(conn, after=6) == {
            x for n, _p, b, a in committed if n > 6 for x in (b, a) if x}
        counted = {layer.number: (layer.added, layer.deleted, layer.added + layer.modified + layer.deleted)
                   for layer in layers.list_layers(conn)}
    for n, es in m.items():
        added = sum(e.before.kind is None for e in es)
        deleted = sum(e.after.kind is None for e in es)
        assert counted[n] == (added, deleted, len(es)), n


def test_fold_rows_and_replace_through(tmp_path):
    w = open_workspace(tmp_path / "ws", {"a": ("file", 0o644, b"a0\n")})
    try:
        for i in range(1, 4):
            s = Stager(w)
            s.file("a", b"a%d\n" % i)
            s.file(f"f{i}", b"%d\n" % i)
            publish.commit_step(w, s.step, overwrite={r.path for r in s.rows()})
        with w.db.read() as conn:
            whole = {n: entrytable.layer_entries(conn, n) for n in layers.committed_numbers(conn)}
            rows = as_pairs(entrytable.fold_rows(conn, 2))
        assert rows == sorted(((n, e) for n in (0, 1, 2) for e in whole[n]), key=lambda p: (p[1].path, p[0]))
        folded = [Entry(b"a", whole[1][0].before, whole[2][0].after, whole[2][0].after_mtime_ns)]
        with w.db.write() as conn:
            entrytable.replace_through(conn, 2, folded)
            conn.execute(update(schema.layers).where(schema.layers.c.number < 2).values(state="pruned"))
        with w.db.read() as conn:
            assert entrytable.layer_entries(conn, 2) == folded
            assert entrytable.layer_entries(conn, 1) == [] and entrytable.layer_entries(conn, 3) == whole[3]
        with w.db.write() as conn:
            entrytable.delete_layer(conn, 3)
        with w.db.read() as conn:
            assert entrytable.layer_entries(conn, 3) == []
    finally:
        w.close()


def test_a_name_linked_to_a_path_without_an_entry_of_its_own(tmp_path):
    """A rollback may publish a name as a hard link of a path it leaves as
    it is on disk (no entry there): that path was linked too."""
    w = open_workspace(tmp_path / "ws", {"kept": ("file", 0o644, b"k\n")})
    try:
        with w.db.write() as conn:
            conn.execute(schema.layers.insert().values(number=1, state="committed", kind="rollback", created_ns=0))
            entrytable.insert(conn, 1, [Entry(b"other", layers.State(None), layers.State("file", 0o644), None,
                                              after_link=b"kept")])
        with w.db.read() as conn:
            assert entrytable.ever_linked(conn, b"kept") and entrytable.ever_linked(conn, b"other")
            assert not entrytable.ever_linked(conn, b"nothing")
    finally:
        w.close()


# -- format 11: before states as markers -----------------------------------------------


def _raw_lists(ws) -> dict[int, list[tuple]]:
    """Each layer's stored rows as decoded, markers unresolved."""
    from stepfs.store import entrylist

    with ws.db.read() as conn:
        got = conn.exec_driver_sql("SELECT layer, data FROM layer_entries ORDER BY layer, first").all()
    out: dict[int, list[tuple]] = {}
    for layer, data in got:
        out.setdefault(layer, []).extend(entrylist.decode(data))
    return out


def test_a_before_that_repeats_the_previous_after_is_stored_as_a_marker_and_read_resolved(ws):
    from stepfs.store import entrylist

    raw = _raw_lists(ws)
    with ws.db.read() as conn:
        pid = entrytable.path_ids(conn, [b"d/x"])[b"d/x"]
        rows = entrytable.path_rows(conn, b"d/x")
    marked = {n for n, rs in raw.items() for r in rs if r[0] == pid and r[3] is entrylist.PREVIOUS}
    assert marked >= set(range(3, 9))  # each step edits d/x; layer 2 is the fold (nothing below it)
    assert 2 not in marked
    # Resolved: each before is the previous committed layer's after.
    assert [r.layer for r in rows] == list(range(2, 9))
    assert all(b.before_oid == a.after_oid and b.before_oid is not None for a, b in zip(rows, rows[1:]))
    assert all(e.before.oid is not entrylist.PREVIOUS for es in model(ws).values() for e in es)


def test_a_list_with_an_unresolvable_marker_is_a_problem_verify_names(tmp_path):
    from stepfs.store import entrylist, verify

    w = open_workspace(tmp_path / "ws", {"a": ("file", 0o644, b"a0\n")})
    try:
        s = Stager(w)
        s.file("a", b"a1\n")
        publish.commit_step(w, s.step, message="one")
        with w.db.write() as conn:
            ids = entrytable.path_ids(conn, [b"b"])
            conn.execute(schema.layers.insert().values(number=5, state="committed", kind="step", created_ns=0))
            row = (ids[b"b"], "file", 0o100644, entrylist.PREVIOUS) + (None,) * 4 + ("file", 0o100644, None) \
                + (None,) * 6
            conn.exec_driver_sql("INSERT INTO layer_entries (layer, first, n, data) VALUES (5, ?, 1, ?)",
                                 (ids[b"b"], entrylist.encode([row])))
            conn.exec_driver_sql("INSERT INTO path_layers (path, layer) VALUES (?, 5)", (ids[b"b"],))
        with w.db.read() as conn:
            problems = entrytable.list_problems(conn)
        assert any("names the previous entry's object" in p for p in problems), problems
        assert not verify.verify(w).ok
    finally:
        w.close()


def test_prune_writes_the_oid_where_the_fold_drops_the_entry_a_marker_pointed_at(tmp_path):
    from stepfs.store import entrylist, verify

    w = open_workspace(tmp_path / "ws", {"p": ("file", 0o644, b"a\n"), "q": ("file", 0o644, b"q\n")})
    try:
        for i, (name, data) in enumerate([("p", b"b\n"), ("p", b"a\n"), ("q", b"q3\n"), ("p", b"c\n")], 1):
            s = Stager(w)
            s.file(name, data)
            assert publish.commit_step(w, s.step, message=f"step {i}", overwrite={r.path for r in s.rows()}) == i
        with w.db.read() as conn:
            a_oid = entrytable.path_rows(conn, b"p")[-1].before_oid
            pid = entrytable.path_ids(conn, [b"p"])[b"p"]
        assert any(r[0] == pid and r[3] is entrylist.PREVIOUS for r in _raw_lists(w)[4])
        result = prune.prune(w, keep_last=2)
        assert result.keep_from == 3
        with w.db.read() as conn:
            rows = entrytable.path_rows(conn, b"p")
        assert [r.layer for r in rows] == [4] and rows[0].before_oid == a_oid  # p ended where it began by 3
        assert not any(r[0] == pid and r[3] is entrylist.PREVIOUS for r in _raw_lists(w)[4])
        report = verify.verify(w)
        assert report.ok, report.problems
    finally:
        w.close()
