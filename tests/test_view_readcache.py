"""Readers of small staged files are served from a bytes snapshot, kept
after a publish or a read for the next readers (``overlayfs/core/readcache.py``):
no store read for a file just written, a reader keeps the version it
opened, and the kept bytes are bounded."""

from __future__ import annotations

import os

from stepfs.overlayfs.core import content
from stepfs.overlayfs.core.readcache import ReadCache
from stepfs.overlayfs.core.upper import Node
from viewkit import open_view, read_all, read_fh, write_file


def _no_store_reads(monkeypatch, ws) -> None:
    def refuse(*_a, **_k):
        raise AssertionError("the store was read")
    monkeypatch.setattr(ws.objects, "read_all", refuse)
    monkeypatch.setattr(ws.objects, "write_to_fd", refuse)


def test_a_file_just_written_is_read_back_without_the_store(tmp_path, monkeypatch):
    ws, view = open_view(tmp_path)
    write_file(view, "/a.txt", b"hello\n")
    view.sync_rows()  # its bytes are in the store now, no longer held with the rows
    _no_store_reads(monkeypatch, ws)
    assert read_all(view, "/a.txt") == b"hello\n"
    view.rename("/a.txt", "/b.txt")  # a rename keeps the content
    assert read_all(view, "/b.txt") == b"hello\n"
    assert view.handles == {} and os.listdir(view.scratch_dir) == []


def test_a_read_from_the_store_is_kept_for_the_next_reader(tmp_path, monkeypatch):
    ws, view = open_view(tmp_path)
    write_file(view, "/a", b"x" * 1000)
    view.sync_rows()
    view.content.reads.clear()
    assert read_all(view, "/a") == b"x" * 1000  # from the store
    _no_store_reads(monkeypatch, ws)
    assert read_all(view, "/a") == b"x" * 1000


def test_a_reader_keeps_the_version_it_opened_and_a_new_one_sees_the_next(tmp_path):
    ws, view = open_view(tmp_path)
    write_file(view, "/f", b"one")
    view.sync_rows()
    r = view.open("/f", os.O_RDONLY, agent="reader")
    w = view.open("/f", os.O_WRONLY | os.O_TRUNC, agent="writer")
    view.write(w, b"two!", 0)
    view.flush(w)
    view.release(w)
    assert read_fh(view, r) == b"one"  # another agent's publish does not reach an open reader
    view.release(r)
    assert read_all(view, "/f") == b"two!"


def test_a_reader_of_the_same_agent_follows_its_new_draft(tmp_path):
    ws, view = open_view(tmp_path)
    write_file(view, "/f", b"one")
    r = view.open("/f", os.O_RDONLY)
    w = view.open("/f", os.O_WRONLY)
    view.write(w, b"ON", 0)
    assert read_fh(view, r) == b"ONe"  # POSIX inside one agent
    for fh in (w, r):
        view.flush(fh)
        view.release(fh)
    assert read_all(view, "/f") == b"ONe"


def test_a_file_from_the_memory_limit_up_is_not_kept(tmp_path):
    ws, view = open_view(tmp_path)
    big = b"b" * content.MEMORY_DRAFT_MAX
    write_file(view, "/small", b"s")
    write_file(view, "/big", big)
    assert len(view.content.reads) == 1
    assert read_all(view, "/big") == big
    assert len(view.content.reads) == 1


def test_the_kept_bytes_are_bounded_oldest_out_first():
    cache = ReadCache(entry_max=100, limit=250)
    nodes = [Node("file", 0o100644, base="", ino=i, size=80) for i in range(4)]
    for n in nodes:
        cache.put(n, b"z" * 80)
    assert cache.bytes == 240 and cache.get(nodes[0]) is None
    assert cache.get(nodes[1]) == b"z" * 80  # now the most recently used
    cache.put(nodes[0], b"z" * 80)
    assert cache.get(nodes[2]) is None and cache.get(nodes[1]) is not None
    cache.put(nodes[3], b"y" * 100)  # not kept: as big as entry_max; the old entry goes
    assert cache.get(nodes[3]) is None
    nodes[1].size = 5  # a changed node whose entry was not dropped is never served
    assert cache.get(nodes[1]) is None
    assert cache.bytes == 80 and len(cache) == 1
