"""Copy-up of workspace files into the open step (no kernel): the workspace
is untouched until a commit, content is staged at the close after writing."""

from __future__ import annotations

import os

import pytest

from stepfs.store import staging
from viewkit import open_view, orphan_scratch, read_all, read_fh

SIZE_50M = 50 * 1024 * 1024


@pytest.fixture
def ws_view(tmp_path):
    ws_dir = tmp_path / "ws"
    ws_dir.mkdir()
    (ws_dir / "f").write_bytes(b"0123456789")
    return open_view(tmp_path)


def ws_bytes(ws, rel: str) -> bytes:
    with open(os.path.join(ws.path, rel), "rb") as f:
        return f.read()


def staged_rows(ws, view) -> dict[bytes, staging.StagedRow]:
    with ws.db.read() as conn:
        return {r.path: r for r in staging.load(conn, view.step)}


def staged_content(ws, view, rel: bytes) -> bytes:
    row = staged_rows(ws, view)[rel]
    with ws.db.read() as conn:
        return ws.objects.read_all(conn, row.oid)


def test_open_for_write_copies_up_and_leaves_workspace_alone(ws_view):
    ws, view = ws_view
    fh = view.open("/f", os.O_RDWR)
    assert read_fh(view, fh) == b"0123456789"  # the copy holds the file's bytes
    assert view.getattr("/f", fh)["st_size"] == 10
    assert view.write(fh, b"AB", 3) == 2
    assert read_fh(view, fh) == b"012AB56789"
    assert ws_bytes(ws, "f") == b"0123456789"
    assert staged_rows(ws, view) == {}  # nothing staged before the close
    view.flush(fh)
    view.release(fh)
    assert staged_content(ws, view, b"f") == b"012AB56789"
    assert ws_bytes(ws, "f") == b"0123456789"
    assert read_all(view, "/f") == b"012AB56789"


def test_open_with_truncate(ws_view):
    ws, view = ws_view
    fh = view.open("/f", os.O_WRONLY | os.O_TRUNC)
    assert view.getattr("/f")["st_size"] == 0
    view.flush(fh)
    view.release(fh)
    assert read_all(view, "/f") == b""
    assert staged_content(ws, view, b"f") == b""
    assert ws_bytes(ws, "f") == b"0123456789"


def test_open_for_append(ws_view):
    ws, view = ws_view
    fh = view.open("/f", os.O_WRONLY | os.O_APPEND)
    view.write(fh, b"++", 0)  # O_APPEND: the offset is ignored, as in the kernel
    view.flush(fh)
    view.release(fh)
    assert read_all(view, "/f") == b"0123456789++"
    assert staged_content(ws, view, b"f") == b"0123456789++"


def test_write_at_offsets_beyond_the_end_leaves_a_hole(ws_view):
    ws, view = ws_view
    fh = view.open("/f", os.O_RDWR)
    view.write(fh, b"Z", 20)
    view.write(fh, b"Y", 0)
    view.flush(fh)
    view.release(fh)
    expect = b"Y123456789" + b"\0" * 10 + b"Z"
    assert read_all(view, "/f") == expect
    assert view.getattr("/f")["st_size"] == 21
    assert staged_content(ws, view, b"f") == expect


def test_truncate_by_path_is_staged_at_once(ws_view):
    ws, view = ws_view
    view.truncate("/f", 4)
    assert staged_content(ws, view, b"f") == b"0123"
    assert view.getattr("/f")["st_size"] == 4
    view.truncate("/f", 8)
    assert staged_content(ws, view, b"f") == b"0123\0\0\0\0"
    assert ws_bytes(ws, "f") == b"0123456789"


def test_truncate_by_handle_is_staged_at_close(ws_view):
    ws, view = ws_view
    fh = view.open("/f", os.O_RDWR)
    view.truncate("/f", 2, fh)
    assert view.getattr("/f", fh)["st_size"] == 2
    assert staged_rows(ws, view) == {}
    view.flush(fh)
    view.release(fh)
    assert staged_content(ws, view, b"f") == b"01"


def test_flush_stages_and_repeated_flush_is_idempotent(ws_view):
    ws, view = ws_view
    fh = view.open("/f", os.O_RDWR)
    view.write(fh, b"x", 0)
    view.flush(fh)
    first = staged_rows(ws, view)[b"f"]
    assert first.kind == "file" and first.size == 10 and first.base != "absent"
    view.flush(fh)  # dup2'd descriptors close more than once
    view.flush(fh)
    assert staged_rows(ws, view) == {b"f": first}
    view.write(fh, b"y", 1)
    view.flush(fh)
    assert staged_content(ws, view, b"f") == b"xy23456789"
    assert staged_rows(ws, view)[b"f"].base == first.base  # base is from the first copy-up
    view.release(fh)
    assert staged_content(ws, view, b"f") == b"xy23456789"


def test_release_of_an_unwritten_copy_up_stages_nothing(ws_view):
    ws, view = ws_view
    fh = view.open("/f", os.O_RDWR)
    view.flush(fh)
    view.release(fh)
    assert staged_rows(ws, view) == {}
    assert view.staged_paths() == []
    assert orphan_scratch(view) == []
    # The workspace is the truth again: a change outside shows through.
    with open(os.path.join(ws.path, "f"), "wb") as f:
        f.write(b"changed outside")
    assert read_all(view, "/f") == b"changed outside"


def test_sparse_copy_up_keeps_holes(tmp_path):
    ws_dir = tmp_path / "ws"
    ws_dir.mkdir()
    with open(ws_dir / "big", "wb") as f:
        f.write(b"head")
        f.seek(SIZE_50M - 4)
        f.write(b"tail")
    assert os.stat(ws_dir / "big").st_blocks < 1024  # the filesystem here does holes
    ws, view = open_view(tmp_path)
    fh = view.open("/big", os.O_RDWR)
    st = view.getattr("/big", fh)  # fstat of the copy being written
    assert st["st_size"] == SIZE_50M
    assert st["st_blocks"] < 1024, f"copy-up filled the holes: {st['st_blocks']} blocks"
    view.write(fh, b"mid", SIZE_50M // 2)
    view.flush(fh)
    view.release(fh)
    row = staged_rows(ws, view)[b"big"]
    assert row.size == SIZE_50M
    assert view.read(fh2 := view.open("/big", os.O_RDONLY), 4, SIZE_50M - 4) == b"tail"
    assert view.read(fh2, 3, SIZE_50M // 2) == b"mid"
    assert view.read(fh2, 4, 1 << 20) == b"\0\0\0\0"
    view.release(fh2)
    # The staged object is stored once per distinct chunk (holes dedupe).
    with ws.db.read() as conn:
        assert len(set(ws.objects.chunk_ids(conn, row.oid))) <= 4
    # A restart materializes the object sparsely again (all-zero chunks
    # stay holes; the three chunks with data are written whole).
    again = type(view)(ws, mountpoint=view.mountpoint)
    fh3 = again.open("/big", os.O_RDONLY)
    assert again.read(fh3, 3, SIZE_50M // 2) == b"mid"
    assert again.getattr("/big", fh3)["st_blocks"] * 512 <= 4 * (1 << 20)
    again.release(fh3)
