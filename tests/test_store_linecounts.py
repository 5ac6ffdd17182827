"""Remembered line counts (store/linecounts.py, table ``line_counts``):
``log`` and ``show`` give the same cards with and without the rows, the
rows are filled after a commit by the background pass and by a reader
with the workspace open, the read-only CLI path computes what is missing
and writes nothing, gc drops the rows of objects it collects, and a store
without the table reads and gets it.  Kernel-free."""

from __future__ import annotations

import sqlite3

import pytest

from stepfs.overlayfs.client import reads
from stepfs.store import cards, gc, linecounts, prune, publish
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
    with _db(ws) as db:
        return db.execute("SELECT hex(before_oid), hex(after_oid), lines_added, lines_removed, "
                          "bytes_before, bytes_after FROM line_counts ORDER BY 1, 2").fetchall()


def _forget(ws) -> None:
    with _db(ws) as db:
        db.execute("DELETE FROM line_counts")


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
    with _db(ws) as db:  # a row that says something else is what the log then shows
        assert db.execute("UPDATE line_counts SET lines_added = lines_added + 1000 "
                          "WHERE lines_added IS NOT NULL").rowcount >= 1
    again = _direct(ws, lambda rows: cards.log_of(rows))
    assert sum(c["lines_added"] for c in again) > sum(c["lines_added"] for c in first) + 1000


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
    assert len(rows) == 3  # the layer's three file changes, nothing of older layers
    card = _direct(ws, lambda r: cards.card_at(r, number))
    with ws.db.read() as conn:
        pairs = {linecounts.pair_of(c) for c in cards._changes(cards.Rows.over(conn), number)}
        assert set(linecounts.lookup(cards.Rows.over(conn), pairs)) == pairs
    by_path = {f["path"]: f for f in card["files"]}
    assert (by_path["new.txt"]["lines_added"], by_path["text"]["lines_removed"]) == (3, 1)


def test_rows_of_objects_gc_collects_are_dropped(ws):
    cards.read_log(ws)
    before = len(_rows(ws))
    with _db(ws) as db:  # a row an older stepfs's gc would have left: its object is gone
        db.execute("INSERT INTO line_counts VALUES (x'', x'00112233445566778899aabbccddeeff', 1, 0, 0, 2)")
    assert prune.prune(ws, keep_last=1).keep_from is not None
    report = gc.collect(ws)
    assert report.objects >= 1
    with ws.db.read() as conn:
        live = {bytes(r[0]).hex() for r in conn.exec_driver_sql("SELECT oid FROM objects")}
    after = _rows(ws)
    assert 0 < len(after) < before
    for b, a, *_ in after:
        assert (b == "" or b.lower() in live) and (a == "" or a.lower() in live)
    assert _direct(ws, lambda rows: cards.log_of(rows)) == cards.read_log(ws)


def test_remember_skips_pairs_whose_object_is_gone(ws):
    _forget(ws)
    assert linecounts.remember(ws, {("", "00112233445566778899aabbccddeeff"): (1, 0, 0, 2)}) == 0
    assert _rows(ws) == []


def test_a_store_without_the_table_reads_and_gets_it(ws):
    expected = _everything(ws, lambda answer: _direct(ws, answer))
    path = ws.path
    ws.close()
    with sqlite3.connect(f"{path}/{STORE_DIR}/{DB_NAME}", isolation_level=None) as db:
        db.execute("DROP TABLE line_counts")  # as a store written before the table existed
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
