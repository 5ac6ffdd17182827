"""Big files staged by reference (no kernel): the close hands the draft's
scratch file over as the staged content (``store/refs.py``); the bytes are
imported into the object store at the commit or a discard.  The file is
never written again, survives a daemon restart while a row names it, and
goes once none does."""

from __future__ import annotations

import ctypes
import os

import pytest
from sqlalchemy import select

from stepfs.store import refs, schema, staging
from stepfs.store.errors import MissingStagedContent
from stepfs.store.verify import verify
from viewkit import open_view, read_all, read_fh, reopen, write_file

RENAME_EXCHANGE = 2

BIG = refs.MIN_SIZE + 12345


def big(seed: int) -> bytes:
    return bytes((i * seed + i // 4096) & 0xFF for i in range(BIG))


def rows(view) -> dict[bytes, staging.StagedRow]:
    with view.ws.db.read() as conn:
        return {r.path: r for r in staging.load(conn, view.step)}


def scratch_files(view) -> set[str]:
    return set(os.listdir(view.scratch_dir))


def test_a_big_close_stages_the_scratch_file_by_reference_and_the_commit_imports_it(tmp_path):
    ws, view = open_view(tmp_path)
    data = big(7)
    write_file(view, "/big.bin", data)
    row = rows(view)[b"big.bin"]
    assert row.oid is None and row.scratch is not None and row.size == BIG
    path = os.path.join(view.scratch_dir, row.scratch)
    assert open(path, "rb").read() == data
    assert row.scratch_sum == refs.content_sum(os.open(path, os.O_RDONLY))
    with ws.db.read() as conn:  # nothing of it in the object store yet
        assert conn.execute(select(schema.objects.c.oid).where(schema.objects.c.size == BIG)).first() is None
    assert read_all(view, "/big.bin") == data
    assert verify(ws).ok

    view.commit("big")
    assert (tmp_path / "ws" / "big.bin").read_bytes() == data
    assert not os.path.exists(path)  # no row names it any more
    assert read_all(view, "/big.bin") == data
    view.close()


def test_a_small_close_still_stores_at_once(tmp_path):
    _ws, view = open_view(tmp_path)
    write_file(view, "/small.txt", b"x" * 1000)
    row = rows(view)[b"small.txt"]
    assert row.oid is not None and row.scratch is None
    view.close()


def test_the_referenced_file_is_never_written_again(tmp_path):
    """A write after the publishing close (a dup'd descriptor) moves the
    draft to a copy: the published version stays, for every agent."""
    _ws, view = open_view(tmp_path)
    first, second = big(3), big(5)
    fh = view.create("/f", 0o644, os.O_RDWR | os.O_CREAT)
    view.write(fh, first, 0)
    view.flush(fh)  # close of one descriptor: published by reference
    ref = rows(view)[b"f"].scratch
    view.write(fh, second[:100], 0)  # the other descriptor writes on
    assert open(os.path.join(view.scratch_dir, ref), "rb").read() == first
    assert read_all(view, "/f") == second[:100] + first[100:]  # its own agent sees its draft
    other = view.open("/f", os.O_RDONLY, agent="other")
    assert read_fh(view, other) == first
    view.release(other)
    view.flush(fh)
    view.release(fh)
    row = rows(view)[b"f"]
    assert row.scratch != ref and not os.path.exists(os.path.join(view.scratch_dir, ref))
    assert read_all(view, "/f") == second[:100] + first[100:]
    # A new writer copies the node; the file it was published from stays as it is.
    fh = view.open("/f", os.O_WRONLY | os.O_TRUNC)
    view.write(fh, b"short", 0)
    assert open(os.path.join(view.scratch_dir, row.scratch), "rb").read() == second[:100] + first[100:]
    view.flush(fh)
    view.release(fh)
    assert rows(view)[b"f"].scratch is None  # small now: stored, and the big file gone
    assert scratch_files(view).isdisjoint({row.scratch})
    view.close()


def test_a_restart_keeps_referenced_files_and_removes_the_rest(tmp_path):
    ws, view = open_view(tmp_path)
    data = big(11)
    write_file(view, "/keep.bin", data)
    fh = view.create("/unclosed.bin", 0o644, os.O_RDWR | os.O_CREAT)
    view.write(fh, big(13), 0)  # never closed: lost with the daemon
    ref = rows(view)[b"keep.bin"].scratch
    view = reopen(view)  # the daemon died
    assert scratch_files(view) == {ref}
    assert read_all(view, "/keep.bin") == data
    write_file(view, "/next.bin", big(17))  # new scratch names do not collide
    assert len(scratch_files(view)) == 2
    view.commit("after the restart")
    assert (tmp_path / "ws" / "keep.bin").read_bytes() == data
    assert (tmp_path / "ws" / "next.bin").read_bytes() == big(17)
    assert not (tmp_path / "ws" / "unclosed.bin").exists()
    assert scratch_files(view) == set()
    view.close()


def test_an_unlinked_reference_goes_only_once_its_row_is_gone(tmp_path):
    _ws, view = open_view(tmp_path, row_delay=None)  # rows written when the test says
    write_file(view, "/f", big(19))
    ref = rows(view)[b"f"].scratch
    view.unlink("/f")
    assert ref in scratch_files(view)  # the store still names it
    reborn = reopen(view)  # a crash now finds the file the row names
    assert read_all(reborn, "/f") == big(19)
    reborn.unlink("/f")
    reborn.sync_rows()
    assert b"f" not in rows(reborn)
    reborn.close()  # the rows show it gone: nothing names the file
    assert ref not in os.listdir(reborn.scratch_dir)


def test_a_discard_keeps_the_bytes_of_a_version_that_lost_as_a_conflict_object(tmp_path):
    ws, view = open_view(tmp_path)
    data = big(23)
    write_file(view, "/f", data)
    ref = rows(view)[b"f"].scratch
    (tmp_path / "ws" / "f").write_bytes(b"written outside meanwhile\n")  # the staged version lost
    assert view.discard(["/f"]) == ["/f"]
    with ws.db.read() as conn:
        [oid] = [r.oid for r in conn.execute(select(schema.conflicts))]
        assert ws.objects.read_all(conn, oid) == data
    assert ref not in scratch_files(view)
    assert (tmp_path / "ws" / "f").read_bytes() == b"written outside meanwhile\n"
    view.close()


def test_a_discarded_draft_leaves_no_conflict(tmp_path):
    """Issue 20: the path is unchanged in the workspace, so the staged file
    is a draft the user threw away; gc collects its bytes."""
    ws, view = open_view(tmp_path)
    write_file(view, "/f", big(24))
    ref = rows(view)[b"f"].scratch
    assert view.discard(["/f"]) == ["/f"]
    with ws.db.read() as conn:
        assert conn.execute(select(schema.conflicts)).all() == []
    assert ref not in scratch_files(view)
    assert not os.path.exists(tmp_path / "ws" / "f")
    view.close()


def test_a_hard_linked_big_file_commits_once_under_both_names(tmp_path):
    ws, view = open_view(tmp_path)
    write_file(view, "/a", big(29))
    view.link("/b", "/a")
    assert rows(view)[b"a"].scratch == rows(view)[b"b"].scratch is not None
    view.commit("links")
    a, b = tmp_path / "ws" / "a", tmp_path / "ws" / "b"
    assert a.read_bytes() == big(29) and os.stat(a).st_ino == os.stat(b).st_ino
    view.close()


def test_a_damaged_or_missing_reference_is_refused_and_named_by_verify(tmp_path):
    ws, view = open_view(tmp_path)
    write_file(view, "/f", big(31))
    path = os.path.join(view.scratch_dir, rows(view)[b"f"].scratch)
    with open(path, "r+b") as f:  # what a power cut may leave: the bytes not on disk
        f.write(b"\0" * 10)
    problems = verify(ws).problems
    assert any("no longer holds the content" in p for p in problems), problems
    with pytest.raises(MissingStagedContent, match="no longer matches"):
        view.commit("damaged")
    assert rows(view)[b"f"].scratch is not None  # nothing rewritten
    os.unlink(path)
    assert any("cannot be read" in p for p in verify(ws).problems)
    with pytest.raises(MissingStagedContent, match="is missing"):
        view.commit("missing")
    view.close()


def test_a_draft_still_open_on_a_replaced_reference_keeps_its_bytes(tmp_path):
    """Agent a's close published by reference while a's descriptor stays
    open; agent b replaces the file: a's draft moves to a copy before the
    referenced file goes, so a still reads (and stats) what it wrote."""
    _ws, view = open_view(tmp_path)
    mine, theirs = big(37), big(41)
    fh = view.create("/f", 0o644, os.O_RDWR | os.O_CREAT, agent="a")
    view.write(fh, mine, 0)
    view.flush(fh)
    ref = rows(view)[b"f"].scratch
    other = view.open("/f", os.O_WRONLY | os.O_TRUNC, agent="b")
    view.write(other, theirs, 0)
    view.flush(other)
    view.release(other)
    assert ref not in scratch_files(view)
    assert read_fh(view, fh) == mine
    assert view.getattr("/f", fh, agent="a")["st_size"] == len(mine)
    view.release(fh)
    assert read_all(view, "/f") == theirs
    view.close()


@pytest.mark.parametrize("row_delay", [0.0, None])
def test_moves_that_take_nodes_out_and_back_keep_their_files(tmp_path, row_delay):
    """A directory rename and RENAME_EXCHANGE take the staged nodes out of
    the tree (rows written meanwhile when row_delay is 0) and place them
    again: their referenced files must survive."""
    _ws, view = open_view(tmp_path, row_delay=row_delay)
    view.mkdir("/d", 0o755)
    write_file(view, "/d/f", big(43))
    write_file(view, "/a", big(47))
    write_file(view, "/b", big(53))
    view.rename("/d", "/e")
    view.rename("/a", "/b", flags=RENAME_EXCHANGE)
    view.sync_rows()
    assert read_all(view, "/e/f") == big(43)
    assert (read_all(view, "/a"), read_all(view, "/b")) == (big(53), big(47))
    view = reopen(view)
    assert (read_all(view, "/e/f"), read_all(view, "/a"), read_all(view, "/b")) == (big(43), big(53), big(47))
    view.commit("moved")
    assert (tmp_path / "ws" / "a").read_bytes() == big(53)
    view.close()


@pytest.mark.parametrize("how", ["front to back", "from C memory", "rewritten", "truncated", "reopened with O_TRUNC"])
def test_the_sum_kept_while_writing_is_the_file_s_sum(tmp_path, monkeypatch, how):
    """A draft written front to back from empty keeps a running sum, so its
    close reads nothing back; any other change (an overwrite, a truncate)
    drops it and the close sums the file.  Either way the row's sum is the
    file's, and the commit (which checks it) succeeds."""
    _ws, view = open_view(tmp_path)
    data = big(3)
    piece = 256 << 10
    reread = []
    real_sum = refs.content_sum
    monkeypatch.setattr(refs, "content_sum", lambda fd: reread.append(fd) or real_sum(fd))
    fh = view.create("/big.bin", 0o644, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        for off in range(0, BIG, piece):
            chunk = data[off:off + piece]
            if how == "from C memory":  # as the FUSE adapter passes it: a view of libfuse's buffer
                chunk = (ctypes.c_char * len(chunk)).from_buffer(bytearray(chunk))
            view.write(fh, chunk, off)
        if how == "rewritten":
            view.write(fh, b"Z" * 10, 100)
            data = data[:100] + b"Z" * 10 + data[110:]
        elif how == "truncated":
            view.truncate("/big.bin", BIG - 5, fh)
            data = data[:-5]
        view.flush(fh)
    finally:
        view.release(fh)
    if how == "reopened with O_TRUNC":
        data = big(5)
        fh = view.open("/big.bin", os.O_WRONLY | os.O_TRUNC)
        try:
            view.write(fh, data, 0)
            view.flush(fh)
        finally:
            view.release(fh)
    row = rows(view)[b"big.bin"]
    path = os.path.join(view.scratch_dir, row.scratch)
    assert row.scratch_sum == real_sum(os.open(path, os.O_RDONLY))
    assert bool(reread) == (how in ("rewritten", "truncated"))
    view.commit("big")
    assert (tmp_path / "ws" / "big.bin").read_bytes() == data
    view.close()
