"""A layer's entry list as bytes (store/entrylist.py, format 8): what is
encoded decodes to the same rows, NULLs and all; a list that does not
decode is damaged, never misread; the cache stays within its budget."""

from __future__ import annotations

import pytest

from stepfs.store import codec, entrylist
from stepfs.store.keytext import to_db


def row(pid: int, **kw) -> tuple:
    values = dict(zip(entrylist.COLUMNS, (pid,) + (None,) * (len(entrylist.COLUMNS) - 1)))
    values.update(kw)
    return tuple(values[c] for c in entrylist.COLUMNS)


ROWS = [
    row(1, after_kind="dir", after_mode=0o755, after_uid=0, after_gid=0),
    row(2, before_kind="file", before_mode=0o644, before_oid="ab" * 16, after_kind="file", after_mode=0o600,
        after_oid="cd" * 16 + ".1", after_mtime_ns=-5, after_xattrs=b"\x00\x01x", after_uid=1000, after_gid=1000),
    row(7, before_kind="symlink", before_target=b"t\xff", after_kind=None),
    row(9, before_kind="special", before_mode=0o600, after_kind="chardev", after_mode=0o600, after_target=b"259",
        after_link=b"a/b", before_xattrs=b""),
    row(2 ** 40, after_kind="file", after_mode=0o644, after_oid="weak-test-key", after_mtime_ns=2 ** 62),
]


def test_rows_come_back_as_they_went_in():
    blob = entrylist.encode(ROWS)
    assert entrylist._decode(blob) == ROWS  # not the cache
    assert entrylist.decode(blob) == ROWS
    assert entrylist.encode([]) and entrylist._decode(entrylist.encode([])) == []
    # The oid columns alone, as stored keys (the cards' stored bytes read only them).
    assert entrylist.stored_oids(blob) == [(to_db(r[3]), to_db(r[10])) for r in ROWS]


@pytest.mark.parametrize("damage", [
    lambda b: b[:-3],  # a torn frame
    lambda b: b"\x00" * len(b),
    lambda b: codec.compressor(entrylist.LEVEL).compress(codec.decompressor().decompress(b) + b"x"),  # a byte after the columns
    lambda b: codec.compressor(entrylist.LEVEL).compress(b"\x02" + codec.decompressor().decompress(b)[1:]),  # another version
])
def test_a_list_that_does_not_decode_is_damaged(damage):
    with pytest.raises(entrylist.ListDamaged):
        entrylist.decode(damage(entrylist.encode(ROWS)))


def test_a_list_whose_header_declares_16_tib_is_damaged_not_a_memory_error():
    blob = HUGE_HEADER + entrylist.encode(ROWS)[13:]
    for read in (entrylist.decode, entrylist.stored_oids):
        with pytest.raises(entrylist.ListDamaged, match="impossible size"):
            read(blob)


#: A zstd frame head: magic, a single-segment descriptor with an 8-byte content size, 2**44.
HUGE_HEADER = bytes.fromhex("28b52ffd") + b"\xe0" + (1 << 44).to_bytes(8, "little")


def test_a_chunk_frame_declaring_more_than_its_size_is_refused_before_it_is_decoded():
    frame = codec.compressor(1).compress(b"x" * 1000)
    assert codec.decode(codec.ZSTD, frame, 1000) == b"x" * 1000
    assert codec.decode(codec.ZSTD, frame, 10**9) == b"x" * 1000  # an upper bound
    with pytest.raises(ValueError, match="1000 bytes, 999 recorded"):
        codec.decode(codec.ZSTD, frame, 999)
    with pytest.raises(ValueError, match="17592186044416 bytes"):
        codec.decode(codec.ZSTD, HUGE_HEADER + b"\x01\x00\x00", 10)


def test_lists_split_at_the_maximum_and_the_cache_keeps_its_budget(monkeypatch):
    rows = [row(i, after_kind="file", after_mode=0o644, after_oid="%032x" % i) for i in range(1, 10_001)]
    parts = entrylist.split(rows)
    assert [len(p) for p in parts] == [4096, 4096, 1808]
    monkeypatch.setattr(entrylist, "CACHE_ENTRIES", 5000)
    for p in parts:
        entrylist.decode(entrylist.encode(p))
        assert entrylist._cached[0] == sum(len(r) for r in entrylist._CACHE.values())
        assert entrylist._cached[0] <= 5000 or len(entrylist._CACHE) == 1
