"""Kernel-free helpers for the history tests: drive an ``Overlay`` like an
agent would, commit steps, and read a layer's tree through the view's
``.stepfs/layers`` routing (the same code a mount serves)."""

from __future__ import annotations

import os
import stat as stat_mod
import time
from pathlib import Path

from stepfs.overlayfs.core.changes import removal_time
from stepfs.overlayfs.core.errors import NotFound
from stepfs.overlayfs.core.view import Overlay
from stepfs.store.workspace import Workspace

#: Linux's clock id (the ``time`` module does not name it): the clock file
#: timestamps are taken from.
CLOCK_REALTIME_COARSE = 5


def open_ws(path: Path) -> tuple[Workspace, Overlay]:
    ws = Workspace.open(str(path), create=True)
    return ws, Overlay(ws, str(path.parent / f"mnt-of-{path.name}"))


def write(view: Overlay, path: str, data: bytes, mode: int = 0o644, append: bool = False) -> None:
    try:
        fh = view.open(path, os.O_WRONLY | (os.O_APPEND if append else os.O_TRUNC))
    except NotFound:
        fh = view.create(path, mode)
    offset = view.getattr(path, fh)["st_size"] if append else 0
    view.write(fh, data, offset)
    view.flush(fh)
    view.release(fh)


def read(view: Overlay, path: str) -> bytes:
    fh = view.open(path, os.O_RDONLY)
    try:
        out, offset = [], 0
        while True:
            data = view.read(fh, 1 << 16, offset)
            if not data:
                return b"".join(out)
            out.append(data)
            offset += len(data)
    finally:
        view.release(fh)


def tree(view: Overlay, top: str) -> dict[bytes, tuple]:
    """The tree below view path ``top`` in ``conftest.manifest``'s format."""
    out: dict[bytes, tuple] = {}
    todo = [top]
    while todo:
        d = todo.pop()
        for name, _kind, _ino in view.readdir(d)[2:]:
            path = d + "/" + name
            rel = os.fsencode(path[len(top) + 1:])
            st = view.getattr(path)
            if stat_mod.S_ISLNK(st["st_mode"]):
                out[rel] = ("symlink", None, os.fsencode(view.readlink(path)))
            elif stat_mod.S_ISDIR(st["st_mode"]):
                out[rel] = ("dir", st["st_mode"] & 0o7777, None)
                todo.append(path)
            else:
                data = read(view, path)
                assert len(data) == st["st_size"], path
                out[rel] = ("file", st["st_mode"] & 0o7777, data)
    return out


def layer_tree(view: Overlay, number: int) -> dict[bytes, tuple]:
    return tree(view, f"/.stepfs/layers/{number}")


def after_the_removal_tick() -> None:
    """Wait until every ``ctime`` the kernel stamps from now on is later
    than a removal the view made before this call: a name made outside
    within the removal's own coarse clock tick counts as seen (FORMAT.md,
    known limitations).  The removal time is the fine clock, so waiting for
    it to change proves nothing; the coarse clock the kernel stamps from
    must pass it."""
    removed = removal_time()
    while time.clock_gettime_ns(CLOCK_REALTIME_COARSE) <= removed:
        time.sleep(0.001)
