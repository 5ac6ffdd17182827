"""Small drafts live in memory (``overlayfs/core/content.py``, ``MEMORY_DRAFT_MAX``):
no file is created on the workspace's filesystem for them, and the fast
path keeps every semantic of a scratch-file draft: per-handle O_APPEND,
POSIX visibility between one agent's handles, the move to a scratch file
when a draft grows, staging by reference of a big close, and no descriptor
or memory kept once nobody has the file open."""

from __future__ import annotations

import gc
import os

from stepfs.overlayfs.core import content
from stepfs.overlayfs.core.changes import UTIME_OMIT
from stepfs.store import refs, staging
from viewkit import open_view, orphan_scratch, read_all, read_fh, write_file

MAX = content.MEMORY_DRAFT_MAX


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _rows(ws, view) -> dict[bytes, staging.StagedRow]:
    view.sync_rows()
    with ws.db.read() as conn:
        return {r.path: r for r in staging.load(conn, view.step)}


def test_a_new_small_file_is_written_in_memory_and_staged_at_close(tmp_path):
    ws, view = open_view(tmp_path)
    fh = view.create("/a.txt", 0o644, os.O_WRONLY | os.O_CREAT)
    view.write(fh, b"hello\n", 0)
    d = view.handles[fh].draft
    assert d.mem >= 0 and os.listdir(view.scratch_dir) == []  # nothing on disk
    assert view.getattr("/a.txt", fh)["st_size"] == 6
    view.flush(fh)
    view.release(fh)
    assert view.drafts == {} and d.mem == -1  # dropped with the last handle
    assert read_all(view, "/a.txt") == b"hello\n"  # served from the store
    assert os.listdir(view.scratch_dir) == [] and orphan_scratch(view) == []
    row = _rows(ws, view)[b"a.txt"]
    with ws.db.read() as conn:
        assert ws.objects.read_all(conn, row.oid) == b"hello\n"


def test_handles_of_one_memory_draft_keep_their_own_append_flag_and_see_each_other(tmp_path):
    ws, view = open_view(tmp_path)
    w = view.create("/log", 0o644, os.O_WRONLY | os.O_CREAT)
    view.write(w, b"0123456789", 0)
    a = view.open("/log", os.O_WRONLY | os.O_APPEND)
    r = view.open("/log", os.O_RDONLY)
    view.write(a, b"END", 0)  # O_APPEND: at the end whatever the offset
    view.write(w, b"ab", 0)  # no O_APPEND: at the offset
    assert read_fh(view, r) == b"ab23456789END"
    for fh in (w, a, r):
        view.flush(fh)
        view.release(fh)
    assert read_all(view, "/log") == b"ab23456789END"


def test_a_memory_draft_that_grows_moves_to_a_scratch_file_with_every_handle(tmp_path):
    ws, view = open_view(tmp_path)
    w = view.create("/grow.bin", 0o644, os.O_RDWR | os.O_CREAT)
    head = os.urandom(1000)
    view.write(w, head, 0)
    a = view.open("/grow.bin", os.O_WRONLY | os.O_APPEND)
    r = view.open("/grow.bin", os.O_RDONLY)
    d = view.handles[w].draft
    assert d.mem >= 0
    tail = os.urandom(MAX)
    view.write(w, tail, len(head))  # past the bound: moves to a scratch file
    assert d.mem == -1 and os.path.dirname(d.scratch) == view.scratch_dir
    view.write(a, b"!", 0)  # the append handle moved too, and still appends
    assert read_fh(view, r) == head + tail + b"!"
    for fh in (w, a, r):
        view.flush(fh)
        view.release(fh)
    assert read_all(view, "/grow.bin") == head + tail + b"!"
    assert orphan_scratch(view) == []


def test_a_memory_draft_truncated_big_is_staged_by_reference(tmp_path):
    ws, view = open_view(tmp_path)
    fh = view.create("/sparse.bin", 0o644, os.O_WRONLY | os.O_CREAT)
    view.write(fh, b"x", 0)
    view.truncate("/sparse.bin", refs.MIN_SIZE + 5, fh)
    view.flush(fh)
    view.release(fh)
    row = _rows(ws, view)[b"sparse.bin"]
    assert row.scratch is not None and row.oid is None and row.size == refs.MIN_SIZE + 5
    assert read_all(view, "/sparse.bin") == b"x" + bytes(refs.MIN_SIZE + 4)


def test_reopening_a_closed_small_file_starts_from_its_published_bytes(tmp_path):
    ws, view = open_view(tmp_path)
    write_file(view, "/f", b"one\n")
    fh = view.open("/f", os.O_WRONLY | os.O_APPEND)
    assert view.handles[fh].draft.mem >= 0  # copied from the store into memory
    view.write(fh, b"two\n", 0)
    view.flush(fh)
    view.release(fh)
    assert read_all(view, "/f") == b"one\ntwo\n"


def test_copy_up_of_a_small_workspace_file_is_in_memory_and_of_a_big_one_in_a_scratch_file(tmp_path):
    ws, view = open_view(tmp_path)
    (tmp_path / "ws" / "small").write_bytes(b"s" * 100)
    (tmp_path / "ws" / "big").write_bytes(b"b" * MAX)
    small = view.open("/small", os.O_RDWR)
    big = view.open("/big", os.O_RDWR)
    assert view.handles[small].draft.mem >= 0
    assert view.handles[big].draft.mem == -1 and os.listdir(view.scratch_dir) != []
    view.write(small, b"S", 0)
    view.write(big, b"B", 0)
    for fh in (small, big):
        view.flush(fh)
        view.release(fh)
    assert read_all(view, "/small") == b"S" + b"s" * 99
    assert read_all(view, "/big") == b"B" + b"b" * (MAX - 1)
    assert (tmp_path / "ws" / "small").read_bytes() == b"s" * 100  # staged, not written through


def test_closed_memory_drafts_keep_no_descriptor(tmp_path):
    ws, view = open_view(tmp_path)
    write_file(view, "/warm", b"w")  # the store's connections are open from here on
    gc.collect()  # descriptors of earlier tests' views
    before = _fds()
    for i in range(300):
        write_file(view, f"/f{i}", b"%d\n" % i)
        assert read_all(view, f"/f{i}") == b"%d\n" % i
    assert _fds() <= before  # not one per file (a memfd kept per closed draft)
    assert view.drafts == {}


def test_an_unlinked_open_memory_draft_keeps_working_and_leaves_nothing(tmp_path):
    ws, view = open_view(tmp_path)
    fh = view.create("/gone", 0o644, os.O_RDWR | os.O_CREAT)
    view.write(fh, b"still here", 0)
    view.unlink("/gone")
    assert view.read(fh, 100, 0) == b"still here"
    view.write(fh, b"S", 0)
    view.flush(fh)
    view.release(fh)
    assert b"gone" not in _rows(ws, view)
    assert view.drafts == {} and orphan_scratch(view) == []


def test_utimens_of_an_open_memory_draft_sets_the_times_its_handles_report(tmp_path):
    # The times go onto the memfd itself (utimens reaches it through the
    # descriptor the draft holds): a handle's getattr and the staged file
    # after the close both carry them.
    ws, view = open_view(tmp_path)
    fh = view.create("/t.txt", 0o644, os.O_WRONLY | os.O_CREAT)
    view.write(fh, b"x" * 100, 0)
    assert view.handles[fh].draft.mem >= 0
    view.utimens("/t.txt", (1_000_000_000_123, 2_000_000_000_456))
    a = view.getattr("/t.txt", fh)
    assert (a["st_atime"], a["st_mtime"]) == (1_000_000_000_123, 2_000_000_000_456)
    view.utimens("/t.txt", (UTIME_OMIT, 3_000_000_000_000))  # the atime kept
    view.flush(fh)
    view.release(fh)
    a = view.getattr("/t.txt")
    assert a["st_atime"] == 1_000_000_000_123 and a["st_mtime"] == 3_000_000_000_000
