"""Copy-up of workspace files into the open step (no kernel): the workspace
is untouched until a commit, content is staged at the close after writing."""

from __future__ import annotations

import os

import pytest

from store import staging
from viewkit import open_view, read_all, read_fh

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
