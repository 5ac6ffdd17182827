"""gc, conflicts drop, compression and deltas of the store (kernel-free)."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
from sqlalchemy import func, select

from stepfs.store import baseref, codec, gc, layers, publish, schema, staging, verify
from stepfs.store.layers import State, entries as load_entries
from store_kit import Stager, open_workspace, rewrite_layer


def counts(ws) -> tuple[int, int]:
    with ws.db.read() as conn:
        return (conn.execute(select(func.count()).select_from(schema.objects)).scalar(),
                conn.execute(select(func.count()).select_from(schema.chunks)).scalar())


def oids(ws) -> set[str]:
    with ws.db.read() as conn:
        return set(conn.execute(select(schema.objects.c.oid)).scalars())


def text(seed: int, n: int = 3000) -> bytes:
    return b"".join(b"line %d of file %d: some words to make it text\n" % (i, seed) for i in range(n))


def check(ws) -> None:
    report = verify.verify(ws)
    assert report.ok, report.problems


def commit(ws, stager) -> int:
    return publish.commit_step(ws, stager.step, message="m", agent="a", mount="/m", overwrite={
        r.path for r in stager.rows()})


def test_staged_then_removed_bytes_go_and_layer_bytes_stay(tmp_path):
    ws = open_workspace(tmp_path / "ws", {"keep": ("file", 0o644, b"kept before\n")})
    s = Stager(ws)
    temp = s.file("tmp.txt", text(1))  # a temp file of the step ...
    with ws.db.write() as conn:
        staging.remove(conn, s.step, b"tmp.txt")  # ... deleted before the commit
    s.file("keep", b"kept after\n")
    s.file("new", text(2))
    commit(ws, s)
    dry = gc.collect(ws, dry_run=True)
    assert dry.objects == 1 and dry.object_bytes == len(text(1))
    assert temp in oids(ws)  # a dry run changes nothing
    report = gc.collect(ws)
    assert (report.objects, report.object_bytes) == (1, len(text(1))) and report.chunks >= 1
    assert temp not in oids(ws)
    with ws.db.read() as conn:
        for e in load_entries(conn, 1):
            for state in (e.before, e.after):
                if state.oid:
                    assert ws.objects.read_all(conn, state.oid)
    assert (tmp_path / "ws" / "new").read_bytes() == text(2)
    check(ws)
    again = gc.collect(ws)
    assert again.objects == 0 and again.chunks == 0  # repeatable
    ws.close()


def test_a_put_of_the_running_generation_is_never_collected(tmp_path):
    """An object put (or put again) after gc's generation began is kept
    even though no row names it yet: a mount daemon holds its id."""
    ws = open_workspace(tmp_path / "ws")
    held = []

    def quiesce():  # runs between the generation and the sweep
        with ws.db.write() as conn:
            held.append(ws.objects.put_bytes(conn, b"held by a daemon, no row yet"))

    with ws.db.write() as conn:
        old = ws.objects.put_bytes(conn, b"garbage from before")
        again = ws.objects.put_bytes(conn, b"put again later")
    # put again after the generation starts: found again, so marked too
    report = gc.collect(ws, quiesce=lambda: (quiesce(), _put(ws, b"put again later")))
    assert old not in oids(ws) and held[0] in oids(ws) and again in oids(ws)
    assert report.objects == 1
    report = gc.collect(ws)  # the next run collects them (nothing names them)
    assert held[0] not in oids(ws) and again not in oids(ws)
    check(ws)
    ws.close()


def _put(ws, data: bytes) -> str:
    with ws.db.write() as conn:
        return ws.objects.put_bytes(conn, data)


def test_a_precaptured_before_state_collected_meanwhile_is_captured_again(tmp_path, monkeypatch):
    ws = open_workspace(tmp_path / "ws", {"f": ("file", 0o644, b"before bytes\n")})
    # The file was just written (within the racy window): taken as settled.
    monkeypatch.setattr(publish.tokens, "is_racy", lambda st, now: False)
    with ws.db.write() as conn:
        before = publish.precapture(ws, conn, b"f")
    s = Stager(ws)
    s.file("f", b"after bytes\n")
    gc.collect(ws)
    assert before.state.oid not in oids(ws)  # nothing named it
    publish.commit_step(ws, s.step, known={b"f": before}, overwrite={b"f"})
    with ws.db.read() as conn:
        [e] = load_entries(conn, 1)
        assert ws.objects.read_all(conn, e.before.oid) == b"before bytes\n"
    check(ws)
    ws.close()


def test_conflicts_are_kept_counted_and_dropped(tmp_path):
    ws = open_workspace(tmp_path / "ws")
    s = Stager(ws)
    s.file("a", text(3))
    with ws.db.write() as conn:
        staging.discard(conn, s.step, b"a", mount="/m")
    report = gc.collect(ws)
    assert report.objects == 0 and report.conflict_objects == 1 and report.conflict_bytes == len(text(3))
    with ws.db.read() as conn:
        [cid] = conn.execute(select(schema.conflicts.c.id)).scalars().all()
    from stepfs.store.errors import InputError

    with pytest.raises(InputError, match="no conflict #999"):
        gc.drop_conflicts(ws, [cid, 999])
    assert gc.drop_conflicts(ws, [cid]) == 1
    report = gc.collect(ws)
    assert report.objects == 1 and report.conflict_objects == 0
    assert counts(ws) == (0, 0)
    check(ws)
    ws.close()


@pytest.mark.parametrize("removed,how", [(40, "full"), (12, "incremental")])
def test_space_goes_back_to_the_file_system(tmp_path, removed, how):
    """Mostly garbage: VACUUM rewrites what lives; some garbage: the free
    pages are given back in place."""
    ws = open_workspace(tmp_path / "ws")
    s = Stager(ws)
    for i in range(40):
        s.file(f"t{i}", os.urandom(200_000))  # incompressible: stored as is
    with ws.db.write() as conn:
        for i in range(removed):
            staging.remove(conn, s.step, b"t%d" % i)
    gc.give_back(ws)
    big = gc.store_bytes(ws)
    report = gc.collect(ws)
    assert report.objects == removed and report.vacuum == how
    assert report.chunk_bytes >= removed * 200_000
    assert report.file_before >= big and report.file_after < big - removed * 180_000
    with ws.db.read() as conn:
        for row in staging.load(conn, s.step):
            assert len(ws.objects.read_all(conn, row.oid)) == 200_000
    check(ws)
    ws.close()


def test_chunks_compress_where_it_pays(tmp_path):
    ws = open_workspace(tmp_path / "ws")
    noise = os.urandom(50_000)
    with ws.db.write() as conn:
        a = ws.objects.put_bytes(conn, text(4))
        b = ws.objects.put_bytes(conn, noise)
    with ws.db.read() as conn:
        rows = {cid: (how, size, len(data)) for cid, how, size, data in conn.execute(
            select(schema.chunks.c.cid, schema.chunks.c.codec, schema.chunks.c.size, schema.chunks.c.data))}
        assert ws.objects.read_all(conn, a) == text(4) and ws.objects.read_all(conn, b) == noise
        assert ws.objects.read_range(conn, a, 1000, 5000) == text(4)[1000:6000]
    assert {how for how, _s, _n in rows.values()} == {codec.ZSTD, codec.RAW}
    assert all(n < size / 3 for how, size, n in rows.values() if how == codec.ZSTD)
    check(ws)
    ws.close()


def test_a_one_line_edit_of_a_100k_text_file_adds_under_2k_at_commit(tmp_path):
    """Format 7: the delta is made when the layer is written, not by gc."""
    body = text(5, 2000)  # ~100 KB
    assert 90_000 < len(body) < 120_000
    ws = open_workspace(tmp_path / "ws", {"src.py": ("file", 0o644, body)})
    s = Stager(ws)
    s.file("src.py", body + b"# touched\n")
    commit(ws, s)
    gc.collect(ws)

    def stored() -> int:
        with ws.db.read() as conn:
            return conn.execute(select(func.sum(func.length(schema.chunks.c.data)))).scalar()

    base = stored()
    lines = body.split(b"\n")
    lines[1000] = b"an edited line in the middle"
    edited = b"\n".join(lines) + b"# touched\n"
    s.file("src.py", edited)
    commit(ws, s)
    before_gc = stored() - base
    assert before_gc <= 2048
    with ws.db.read() as conn:
        assert conn.execute(select(func.count()).where(schema.chunks.c.codec == codec.DELTA)).scalar() >= 1
    report = gc.collect(ws)
    added = stored() - base
    assert report.deltas == 0 and added <= before_gc, (before_gc, added)  # nothing left for gc
    assert (tmp_path / "ws" / "src.py").read_bytes() == edited
    with ws.db.read() as conn:
        e1 = load_entries(conn, 1)[0]
        e2 = load_entries(conn, 2)[0]
        assert ws.objects.read_all(conn, e2.after.oid) == edited
        assert ws.objects.read_all(conn, e1.after.oid) == body + b"# touched\n"
        assert ws.objects.read_all(conn, e1.before.oid) == body
    check(ws)
    ws.close()


def test_a_base_stays_while_a_delta_needs_it(tmp_path):
    """The version a delta was made against goes out of every layer
    (its layer's rows deleted by hand here, as prune would): gc keeps its
    chunk as long as the delta does, and verify checks the pair."""
    body = text(6, 2000)
    ws = open_workspace(tmp_path / "ws", {"f": ("file", 0o644, body)})
    s = Stager(ws)
    edited = body.replace(b"line 700 of", b"LINE 700 of")
    s.file("f", edited)
    commit(ws, s)  # the delta is made here (format 7)
    gc.collect(ws)
    with ws.db.read() as conn:
        bases = set(conn.execute(select(schema.chunks.c.base).where(schema.chunks.c.base.is_not(None))).scalars())
    assert bases
    with ws.db.write() as conn:  # the entry's before state forgotten, as a fold would
        forget_before_states(conn)
    gc.collect(ws)
    with ws.db.read() as conn:
        have = set(conn.execute(select(schema.chunks.c.cid)).scalars())
        [e] = load_entries(conn, 1)
        assert ws.objects.read_all(conn, e.after.oid) == edited
    assert bases <= have
    ws.close()


def test_verify_names_a_delta_whose_base_is_damaged(tmp_path):
    body = text(7, 2000)
    ws = open_workspace(tmp_path / "ws", {"f": ("file", 0o644, body)})
    s = Stager(ws)
    s.file("f", body.replace(b"line 10 of", b"LINE 10 of"))
    commit(ws, s)
    gc.collect(ws)
    with ws.db.write() as conn:
        [base] = conn.execute(select(schema.chunks.c.base).where(schema.chunks.c.base.is_not(None))).scalars()
        data = conn.execute(select(schema.chunks.c.data, schema.chunks.c.codec)
                            .where(schema.chunks.c.cid == base)).one()
        raw = codec.decode(data.codec, data.data, 10**9)
        conn.execute(schema.chunks.update().where(schema.chunks.c.cid == base)
                     .values(codec=codec.RAW, data=raw.replace(b"line 5 of", b"line 6 of")))
    problems = verify.verify(ws).problems
    assert any(base in p for p in problems)
    assert sum("is corrupt" in p for p in problems) >= 2  # the base and the delta made from it
    ws.close()


def test_an_older_store_gives_space_back_after_one_full_vacuum(tmp_path):
    """A store made before format 6 has auto_vacuum NONE: gc frees pages
    for reuse and says so; --full-vacuum rewrites it into incremental mode."""
    import sqlite3

    ws = open_workspace(tmp_path / "ws")
    db_path = ws.db.label
    ws.close()
    raw = sqlite3.connect(db_path, isolation_level=None)
    raw.execute("PRAGMA auto_vacuum=NONE")
    raw.execute("VACUUM")
    assert raw.execute("PRAGMA auto_vacuum").fetchone() == (0,)
    raw.close()
    from stepfs.store.workspace import Workspace

    ws = Workspace.open(str(tmp_path / "ws"))
    s = Stager(ws)
    for i in range(20):
        s.file(f"t{i}", os.urandom(100_000))
    with ws.db.write() as conn:
        for i in range(20):
            staging.remove(conn, s.step, b"t%d" % i)
    gc.give_back(ws)
    report = gc.collect(ws)
    assert report.objects == 20 and report.vacuum == "none" and "--full-vacuum" in report.notes[0]
    big = gc.store_bytes(ws)
    report = gc.collect(ws, full_vacuum=True)
    assert report.vacuum == "full" and gc.store_bytes(ws) < big - 1_500_000
    with ws.db.read() as conn:
        assert conn.exec_driver_sql("PRAGMA auto_vacuum").scalar() == 2
    check(ws)
    ws.close()


def test_a_read_of_a_collected_object_is_an_error_not_an_empty_file(tmp_path):
    from stepfs.store.errors import CorruptObject

    ws = open_workspace(tmp_path / "ws")
    oid = _put(ws, text(8))
    gc.collect(ws)
    with ws.db.read() as conn, pytest.raises(CorruptObject, match="missing"):
        ws.objects.read_range(conn, oid, 0, 100)
    ws.close()


def test_du_counts_each_chunk_once_for_the_layer_that_added_it(tmp_path, monkeypatch):
    from stepfs.store import du

    monkeypatch.setattr(du, "_BATCH", 3)  # several IN lists, as a big history needs
    ws = open_workspace(tmp_path / "ws")
    s = Stager(ws)
    for i in range(7):
        s.file(f"f{i}", text(20 + i))
    commit(ws, s)
    s.file("f0", text(20))  # the same bytes again: nothing new
    s.file("g", text(40))
    commit(ws, s)
    usage = du.usage(ws)
    with ws.db.read() as conn:
        added = du.added_bytes(conn)
        stored = conn.execute(select(func.sum(func.length(schema.chunks.c.data)))).scalar()
    assert added[2] > 0 and added[1] > added[2]
    assert usage["history_bytes"] == sum(added.values()) == stored
    assert usage["garbage_bytes"] == 0 and usage["layers"] == {str(k): v for k, v in added.items() if v}
    ws.close()


def small(seed: int, version: int) -> bytes:
    """A package file as an installer writes it: a few hundred bytes, a
    version number that changes."""
    return b"".join(b'{"name": "pkg%d", "version": "1.%d.0", "line": %d}\n' % (seed, version, i) for i in range(8))


def test_a_small_file_is_inline_and_its_next_version_a_delta_kept_with_its_base(tmp_path):
    """Format 7: content of at most INLINE_MAX bytes lives in its object row;
    a new version of it becomes a delta against the version before when
    the layer is written; gc keeps the base while the delta needs it, and
    verify names a damaged base and the delta made from it."""
    O = schema.objects
    ws = open_workspace(tmp_path / "ws", {"p.json": ("file", 0o644, small(1, 0))})
    s = Stager(ws)
    versions = [small(1, v) for v in range(1, 6)]
    for data in versions:
        s.file("p.json", data)
        commit(ws, s)
    with ws.db.read() as conn:
        assert conn.execute(select(func.count()).select_from(schema.chunks)).scalar() == 0
        rows = conn.execute(select(O.c.oid, O.c.size, func.length(O.c.data), O.c.codec, O.c.base)).all()
        deltas = [r for r in rows if r.codec == codec.DELTA]
        assert len(deltas) == len(versions)  # every version after the first one
        [root] = [r.oid for r in rows if r.codec != codec.DELTA]
        assert {r.base for r in deltas} == {baseref.of(root)}  # one root, named by its key's prefix (format 10)
        root_stored = {r.oid: r[2] for r in rows}[root]
        assert all(r[2] * 4 <= root_stored * 3 for r in deltas)
        by_layer = {n: load_entries(conn, n)[0] for n in range(1, 6)}
        for n, data in zip(range(1, 6), versions):
            assert ws.objects.read_all(conn, by_layer[n].after.oid) == data
            assert ws.objects.read_range(conn, by_layer[n].after.oid, 5, 20) == data[5:25]
    check(ws)
    with ws.db.write() as conn:  # every before state forgotten, as a fold would: only deltas name the root
        forget_before_states(conn)
    gc.collect(ws)
    with ws.db.read() as conn:
        assert ws.objects.exists(conn, root)
        assert conn.execute(select(O.c.is_base).where(O.c.oid == root)).scalar()  # never made a delta
        for n, data in zip(range(1, 6), versions):
            assert ws.objects.read_all(conn, by_layer[n].after.oid) == data
    # (The hand edit broke the layers' intent checksums; nothing else.)
    assert all("intent checksum" in p for p in verify.verify(ws).problems)
    with ws.db.write() as conn:  # damage the root
        conn.execute(O.update().where(O.c.oid == root).values(codec=codec.RAW, data=small(2, 0)))
    problems = verify.verify(ws).problems
    assert any(root in p for p in problems) and sum("corrupt" in p for p in problems) >= 2
    ws.close()


@pytest.mark.parametrize("n", [1, 70, 255, 256, 257, 2048, codec.SMALL_BASE])
def test_a_small_delta_decodes_against_its_base_in_a_stored_frame(n):
    """codec.stored_frame: the base as an uncompressed zstd frame, the first
    link of the content-dictionary chain a small delta is decoded with."""
    import random

    base = random.Random(n).randbytes(n)
    edited = base[: n // 2] + b"edit" + base[n // 2 + 1:]
    packed = codec.delta(edited, base, codec.COMMIT_DELTA_LEVEL)
    assert codec.decode(codec.DELTA, packed, len(edited), base) == edited
    import zstandard

    assert zstandard.ZstdDecompressor().decompress(codec.stored_frame(base)) == base


def forget_before_states(conn) -> None:
    """Every entry's before state absent (what prune's fold does to the
    oldest kept layer), in the caller's transaction."""
    for n in layers.committed_numbers(conn):
        rewrite_layer(conn, n, lambda es: [replace(e, before=State(None)) for e in es])


def test_deltas_whose_bases_share_their_key_prefix_each_find_their_own(tmp_path):
    """Format 10: a delta names its base by the first 4 bytes of its key
    (store/baseref.py).  With a hasher whose keys all share them, every
    delta has several candidates; each reads its own bytes (the hash tells
    them apart), verify passes, and gc keeps every base."""
    from stepfs.store.objects import xxh3_hex

    O = schema.objects
    ws = open_workspace(tmp_path / "ws", {})
    ws.objects.hasher = lambda data: "00000000" + xxh3_hex(data)[8:]
    want = {}
    for version in range(4):
        s = Stager(ws)
        for seed in (1, 2, 3):
            s.file(f"p{seed}.json", small(seed, version))
        n = commit(ws, s)
        with ws.db.read() as conn:
            for e in load_entries(conn, n):
                want[e.after.oid] = small(int(e.path[1:2]), version)
    with ws.db.read() as conn:
        deltas = conn.execute(select(O.c.oid, O.c.base).where(O.c.codec == codec.DELTA)).all()
        assert len(deltas) >= 6 and {r.base for r in deltas} == {b"\0" * baseref.BASE_BYTES}
        for oid, data in want.items():
            assert ws.objects.read_all(conn, oid) == data
    check(ws)
    with ws.db.write() as conn:  # only the deltas name the bases now
        forget_before_states(conn)
    gc.collect(ws)
    with ws.db.read() as conn:
        for oid, data in want.items():
            assert ws.objects.read_all(conn, oid) == data
    assert all("intent checksum" in p for p in verify.verify(ws).problems)
    ws.close()
