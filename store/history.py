"""A path's state as of any layer (store side, no FUSE).

The state of path ``p`` after layer ``n`` is, in order of precedence:

1. the *after* state of the newest committed entry for ``p`` in a layer <= n;
2. else the *before* state of the oldest committed entry for ``p`` in a
   layer > n (layers record "before" lazily, so an untouched path's baseline
   is captured by the first layer that touches it);
3. else the path was never touched: its state is the workspace's now.
"""

from __future__ import annotations

import os
import stat as stat_mod

from sqlalchemy import select

from . import schema
from .errors import ContainmentError, NoSuchLayer
from .layers import State, entry_from_row, head
from .workspace import STORE_DIR, Workspace

L, E = schema.layers, schema.entries


def user_path(ws: Workspace, path: str) -> bytes:
    """A user-supplied path, relative to the workspace, checked to stay
    inside it and out of its store; raises ContainmentError."""
    raw = os.fsencode(path)
    if raw.startswith(b"/"):
        root = os.fsencode(ws.path).rstrip(b"/") + b"/"
        if raw.rstrip(b"/") + b"/" == root:
            raw = b""  # the workspace itself: refused below with that reason
        elif not raw.startswith(root):
            raise ContainmentError(f"{path} is outside the workspace {ws.path}; give a path inside it.")
        else:
            raw = raw[len(root):]
    parts: list[bytes] = []
    for part in raw.split(b"/"):
        if part in (b"", b"."):
            continue
        if part == b"..":
            if not parts:
                raise ContainmentError(f"{path} leaves the workspace; give a path inside it.")
            parts.pop()
            continue
        parts.append(part)
    if not parts:
        raise ContainmentError(f"{path!r} names the workspace itself; give a file inside it.")
    if parts[0] == STORE_DIR.encode():
        raise ContainmentError(f"{path} is inside the stepfs store, which is not part of the workspace.")
    return b"/".join(parts)


def state_at(conn, path: bytes, number: int) -> State | None:
    """The state of ``path`` after layer ``number``; None if it was never
    touched by any layer (then the workspace holds it as it is now)."""
    committed = select(L.c.number).where(L.c.state == "committed")
    row = conn.execute(
        select(E).where(E.c.path == path, E.c.layer <= number, E.c.layer.in_(committed))
        .order_by(E.c.layer.desc()).limit(1)
    ).first()
    if row is not None:
        return entry_from_row(row).after
    row = conn.execute(
        select(E).where(E.c.path == path, E.c.layer > number, E.c.layer.in_(committed))
        .order_by(E.c.layer).limit(1)
    ).first()
    if row is not None:
        return entry_from_row(row).before
    return None


def file_bytes(ws: Workspace, number: int, path: str) -> bytes:
    """A file's bytes as of layer ``number`` (``stepfs cat``)."""
    rel = user_path(ws, path)
    with ws.db.read() as conn:
        if number < 0 or number > head(conn) or conn.execute(
            select(L.c.number).where(L.c.number == number, L.c.state == "committed")
        ).first() is None:
            raise NoSuchLayer(f"layer {number} does not exist; 'stepfs log' lists the layers.")
        state = state_at(conn, rel, number)
        if state is not None:
            if state.kind is None:
                raise ContainmentError(f"{path} did not exist as of layer {number}.")
            if state.kind != "file":
                raise ContainmentError(f"{path} was a {state.kind} as of layer {number}, not a file.")
            return ws.objects.read_all(conn, state.oid)
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer (regular files ignore it).
        fd = ws.root.open(rel, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise ContainmentError(f"{path} did not exist as of layer {number}.") from None
    except OSError as exc:
        raise ContainmentError(f"{path} cannot be read inside the workspace ({exc.strerror}).") from None
    try:
        st = os.fstat(fd)
        if not stat_mod.S_ISREG(st.st_mode):
            # Untouched by any layer: the workspace's kind now is its kind then.
            kind = "dir" if stat_mod.S_ISDIR(st.st_mode) else "special file"
            raise ContainmentError(f"{path} was a {kind} as of layer {number}, not a file.")
        chunks = []
        while True:
            data = os.read(fd, 1 << 20)
            if not data:
                break
            chunks.append(data)
        return b"".join(chunks)
    finally:
        os.close(fd)
