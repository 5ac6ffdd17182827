"""Remembered line counts (store/linecounts.py, table ``layer_counts``, one
frame a layer): ``log`` and ``show`` give the same cards with and without
the rows, the rows are filled after a commit by the background pass and by
a reader with the workspace open, the read-only CLI path computes what is
missing and writes nothing, prune carries what its folded layer still
needs, a row whose layer's list changed is never read, gc drops the rows
of layers that are gone, verify names a damaged or stale row, and a store
without the table reads and gets it.  Kernel-free."""

from __future__ import annotations

import sqlite3

import pytest

from stepfs.overlayfs.client import reads
from stepfs.store import cards, gc, linecounts, prune, publish, verify
from stepfs.store.paths import DB_NAME, STORE_DIR
from stepfs.store.workspace import Workspace
from store_kit import Stager, open_workspace

LONG = b"".join(b"line %d of a text file\n" % i for i in range(300))


def _history(path):
    """Layers 1-3: text edits, a binary edit, an added and a deleted file,
    a rename, a file replaced by a symlink, a .git directory's churn."""
    w = open_workspace(path, {
        "text": ("file", 0o644, b"a\nb\nc\n"),
        "blob": ("file", 0o644, b"\0\1\2" * 10),
        "gone.txt": ("file", 0o644, b"x\ny\n"),
        "moved-from": ("file", 0o644, b"content that moves\n"),
        "becomes-link": ("file", 0o644, b"one\ntwo\n"),
    })
    st = Stager(w)
    st.file("text", b"a\nB\nc\nd\n")
    st.file("blob", b"\0\3" * 40)
    st.whiteout("gone.txt")
    st.whiteout("moved-from")
    st.file("moved-to", b"content that moves\n")
    st.symlink("becomes-link", "text")
    st.file("long.txt", LONG)
    publish.commit_step(w, st.step, message="first")
    st = Stager(w)
    st.dir(".git")
    st.file(".git/HEAD", b"ref: refs/heads/main\n")
    st.file("long.txt", LONG.replace(b"line 7 ", b"LINE 7 "))
    publish.commit_step(w, st.step, message="second")
    st = Stager(w)
    st.file("text", b"only this\n")
    publish.commit_step(w, st.step, message="third")
    return w


def _db(ws) -> sqlite3.Connection:
    return sqlite3.connect(f"{ws.path}/{STORE_DIR}/{DB_NAME}", isolation_level=None)


def _rows(ws) -> list[tuple]:
    """Every remembered count: ``(layer, before, after, counts)``."""
    with ws.db.read() as conn:
        rows = cards.Rows.over(conn, ws.objects.hasher)
        return sorted((n, b, a, c) for (n,) in rows.fetch("SELECT layer FROM layer_counts", ())
                      for (b, a), c in linecounts.lookup(rows, n).items())


def _forget(ws) -> None:
    with _db(ws) as db:
        db.execute("DELETE FROM layer_counts")


def _rewrite(ws, number, change) -> None:
    """Layer ``number``'s row holding ``change(counts)`` instead."""
    with ws.db.read() as conn:
        rows = cards.Rows.over(conn, ws.objects.hasher)
        entries = rows.entries(number)
        data = linecounts.encode(entries, change(linecounts.lookup(rows, number)))
    with _db(ws) as db:
        db.execute("UPDATE layer_counts SET data = ? WHERE layer = ?", (data, number))


def _direct(ws, answer):
    out = reads._read_only(ws.path, answer)
    assert out is not None  # the read-only sqlite3 path answered
    return out


def _everything(ws, read) -> tuple:
    """Log (folded and not) and every card, read by ``read(answer)``."""
    return (read(lambda rows: cards.log_of(rows)), read(lambda rows: cards.log_of(rows, fold=False)),
            [read(lambda rows, n=n: cards.card_at(rows, n, fold=f)) for n in range(4) for f in (True, False)])


@pytest.fixture
def ws(tmp_path):
    w = _history(tmp_path / "ws")
    yield w
    w.close()


def test_cards_are_the_same_with_and_without_remembered_counts(ws):
    _forget(ws)
    computed = _everything(ws, lambda answer: _direct(ws, answer))
    assert _rows(ws) == []  # the read-only path wrote nothing
    cards.read_log(ws, fold=False)  # a reader with the workspace open remembers what it computed
    remembered = _rows(ws)
    assert len(remembered) >= 5
    assert _everything(ws, lambda answer: _direct(ws, answer)) == computed
    with ws.db.read() as conn:  # and through SQLAlchemy
        assert _everything(ws, lambda answer: answer(cards.Rows.over(conn, ws.objects.hasher))) == computed
    assert _rows(ws) == remembered
    by_path = {f["path"]: f for f in computed[2][2]["files"]}  # layer 1's unfolded card
    assert (by_path["text"]["lines_added"], by_path["text"]["lines_removed"]) == (2, 1)
    assert by_path["blob"]["binary"] and by_path["blob"]["bytes_after"] == 80
    assert by_path["long.txt"]["lines_added"] == 300 and by_path["gone.txt"]["lines_removed"] == 2
    assert by_path["moved-to"]["op"] == "renamed" and by_path["moved-to"]["lines_added"] == 0


def test_log_reads_the_rows_instead_of_the_content(ws):
    cards.read_log(ws)
    first = _direct(ws, lambda rows: cards.log_of(rows))
    # a row that says something else is what the log then shows
    _rewrite(ws, 1, lambda counts: {p: ((c[0] + 1000, *c[1:]) if c[0] is not None else c)
                                     for p, c in counts.items()})
    again = _direct(ws, lambda rows: cards.log_of(rows))
    assert sum(c["lines_added"] for c in again) > sum(c["lines_added"] for c in first) + 1000


def test_a_frame_round_trips_and_names_changes_by_position(ws):
    cards.read_log(ws, fold=False)
    with ws.db.read() as conn:
        rows = cards.Rows.over(conn, ws.objects.hasher)
        entries = rows.entries(1)
        counts = linecounts.lookup(rows, 1)
        assert len(counts) >= 5
        data = linecounts.encode(entries, counts)
        assert linecounts.decode(data, entries) == counts
        # the same positions over another list name other pairs: not read
        assert linecounts.decode(data, entries[1:]) is None
        assert linecounts.decode(data, rows.entries(2)) is None
        with pytest.raises(linecounts.Damaged):
            linecounts.decode(data[:-3], entries)
    assert ("", entries[0].after.oid) in counts or any(not b for b, _a in counts)  # an added file: no before


def test_a_stale_or_damaged_row_is_not_read_and_verify_names_it(ws):
    cards.read_log(ws, fold=False)
    expected = _everything(ws, lambda answer: _direct(ws, answer))
    with _db(ws) as db:
        two = db.execute("SELECT data FROM layer_counts WHERE layer = 2").fetchone()[0]
        db.execute("UPDATE layer_counts SET data = ? WHERE layer = 1", (two,))  # names layer 2's pairs
        db.execute("UPDATE layer_counts SET data = x'00112233' WHERE layer = 3")
    assert _everything(ws, lambda answer: _direct(ws, answer)) == expected  # computed instead
    problems = verify.verify(ws).problems
    assert any("layer 1 no longer match" in p for p in problems), problems
    assert any("layer 3 are damaged" in p for p in problems), problems
    cards.read_log(ws, fold=False)  # a reader writes them again
    assert verify.verify(ws).ok


def test_the_background_pass_fills_a_new_layers_counts(ws):
    _forget(ws)
    ws.deltas.start()
    try:
        st = Stager(ws)
        st.file("text", b"a\nb\n")
        st.file("new.txt", b"1\n2\n3\n")
        st.whiteout("blob")
        number = publish.commit_step(ws, st.step, message="fourth")
        assert ws.deltas.wait_idle(60)
    finally:
        ws.deltas.stop()
    rows = _rows(ws)
    assert len(rows) == 3 and {r[0] for r in rows} == {number}  # the layer's three file changes
    card = _direct(ws, lambda r: cards.card_at(r, number))
    with ws.db.read() as conn:
        pairs = {linecounts.pair_of(c) for c in cards._changes(cards.Rows.over(conn), number)}
        assert set(linecounts.lookup(cards.Rows.over(conn), number)) == pairs
    by_path = {f["path"]: f for f in card["files"]}
    assert (by_path["new.txt"]["lines_added"], by_path["text"]["lines_removed"]) == (3, 1)


def test_prune_carries_what_the_folded_layer_still_needs_and_gc_drops_the_rest(ws):
    cards.read_log(ws, fold=False)
    before = _rows(ws)
    assert {r[0] for r in before} == {1, 2, 3}
    expected_two = {(b, a): c for n, b, a, c in before if n == 2}
    assert prune.prune(ws, keep_last=2).keep_from == 2
    after = _rows(ws)
    assert {r[0] for r in after} == {2, 3}
    carried = {(b, a): c for n, b, a, c in after if n == 2}
    with ws.db.read() as conn:
        rows = cards.Rows.over(conn, ws.objects.hasher)
        needed = {p for c in cards._changes(rows, 2) if (p := linecounts.pair_of(c)) is not None}
    assert carried and set(carried) <= needed
    assert all(expected_two.get(p, c) == c for p, c in carried.items())  # .git/HEAD's addition, kept
    assert verify.verify(ws).ok
    assert _direct(ws, lambda rows: cards.log_of(rows)) == cards.read_log(ws)
    with _db(ws) as db:  # a row an older stepfs's prune would have left: its layer is pruned
        db.execute("INSERT INTO layer_counts (layer, data) SELECT 1, data FROM layer_counts WHERE layer = 3")
    assert any("layer 1 remain" in p for p in verify.verify(ws).problems)
    report = gc.collect(ws)
    assert report.objects >= 1
    assert {r[0] for r in _rows(ws)} == {2, 3}
    with _db(ws) as db:
        assert db.execute("SELECT count(*) FROM layer_counts WHERE layer = 1").fetchone()[0] == 0
    assert verify.verify(ws).ok


def test_remember_skips_pairs_the_layer_does_not_name(ws):
    _forget(ws)
    assert linecounts.remember(ws, {3: {("", "00112233445566778899aabbccddeeff"): (1, 0, 0, 2)}}) == 0
    assert linecounts.remember(ws, {99: {("", "00112233445566778899aabbccddeeff"): (1, 0, 0, 2)}}) == 0
    assert _rows(ws) == []


def test_a_store_without_the_table_reads_and_gets_it(ws):
    expected = _everything(ws, lambda answer: _direct(ws, answer))
    path = ws.path
    ws.close()
    with sqlite3.connect(f"{path}/{STORE_DIR}/{DB_NAME}", isolation_level=None) as db:
        db.execute("DROP TABLE layer_counts")  # as a store written before the table existed
    from types import SimpleNamespace

    old = SimpleNamespace(path=path)
    assert _everything(old, lambda answer: _direct(old, answer)) == expected
    with Workspace.open(path) as again:
        assert _rows(again) == []  # made again, empty
        assert cards.read_log(again) == expected[0]
        assert len(_rows(again)) >= 5


def test_added_bytes_in_one_statement_is_the_rows_answer(ws):
    """``Rows.added_bytes`` (one SQL statement) against the row-by-row
    reference, with chunked and inline objects, deltas and a pruned layer."""
    st = Stager(ws)
    st.file("long.txt", LONG.replace(b"line 9 ", b"LINE 9 "))  # a delta against layer 2's version
    st.file("text", b"a\nb\n")
    publish.commit_step(ws, st.step, message="fourth")

    def both(numbers):
        return _direct(ws, lambda rows: (rows.added_bytes(numbers), rows.added_bytes_by_rows(numbers)))

    for numbers in (None, [4], [1, 3], [0, 1, 2, 3, 4]):
        fast, reference = both(numbers)
        assert fast == reference
    assert sum(both(None)[0].values()) > 0
    gc.collect(ws)  # deltas made
    assert prune.prune(ws, keep_last=3).keep_from == 2
    for numbers in (None, [4], [2, 3]):
        fast, reference = both(numbers)
        assert fast == reference
