"""Helpers for the kernel-free view tier: drive :class:`overlayfs.view.Overlay`
the way ``fuse_ops.py`` does (view paths, fh integers, ``os.O_*`` flags) and
read the merged view back as a manifest comparable with
``conftest.manifest`` of a directory on disk.
"""

from __future__ import annotations

import os
import stat as stat_mod
from pathlib import Path

from stepfs.overlayfs.core.view import Overlay
from stepfs.store.contained import kind_of
from stepfs.store.workspace import Workspace


def open_view(tmp_path: Path, mount_name: str = "mnt", **options) -> tuple[Workspace, Overlay]:
    """A workspace at ``tmp_path/ws`` (created if needed) and a view of it
    for the mountpoint ``tmp_path/<mount_name>`` (never mounted).
    ``options`` go to :class:`Overlay` (``row_delay``)."""
    ws_dir = tmp_path / "ws"
    ws_dir.mkdir(exist_ok=True)
    ws = Workspace.open(str(ws_dir), create=True)
    return ws, Overlay(ws, mountpoint=str(tmp_path / mount_name), **options)


def reopen(view: Overlay) -> Overlay:
    """A new view of the same workspace and mountpoint: a daemon that died
    (nothing closed, staged rows it had not written yet lost) and restarted
    with the same options.  The new view clears the scratch directory, so
    the old view must not be used afterwards; its handles and row timer
    are dropped here so that nothing touches the store through it."""
    for h in view.handles.values():
        if h.fd >= 0:
            os.close(h.fd)
    view.handles.clear()
    if view.rows.timer is not None:
        view.rows.timer.stop()
    view.rows.pending.clear()
    view.upper = view.ns.upper = view.scratch.upper = None  # any further use of the dead view fails loudly
    return Overlay(view.ws, mountpoint=view.mountpoint, row_delay=view.row_delay)


def read_all(view: Overlay, path: str) -> bytes:
    fh = view.open(path, os.O_RDONLY)
    try:
        return read_fh(view, fh)
    finally:
        view.release(fh)


def read_fh(view: Overlay, fh: int, chunk: int = 1 << 16) -> bytes:
    out, off = [], 0
    while True:
        data = view.read(fh, chunk, off)
        if not data:
            return b"".join(out)
        out.append(data)
        off += len(data)


def write_file(view: Overlay, path: str, data: bytes, mode: int = 0o644) -> None:
    """``open(path, "wb").write(data); close()`` through the view."""
    fh = view.create(path, mode, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        assert view.write(fh, data, 0) == len(data)
        view.flush(fh)
    finally:
        view.release(fh)


def view_manifest(view: Overlay, with_stat: bool = False) -> dict[bytes, tuple]:
    """``{relative path: (kind, mode, bytes or link target)}`` of the merged
    view (without ``.stepfs``), in the format of ``conftest.manifest``.

    Also checks that readdir's type bits agree with getattr for every entry.
    With ``with_stat`` the values get ``(size, mtime)`` appended.
    """
    out: dict[bytes, tuple] = {}
    todo = ["/"]
    while todo:
        d = todo.pop()
        for name, kind_bits, ino in view.readdir(d)[2:]:
            path = (d if d != "/" else "") + "/" + name
            assert ino != 0, path
            st = view.getattr(path)
            assert stat_mod.S_IFMT(st["st_mode"]) == kind_bits, (path, st["st_mode"], kind_bits)
            kind = kind_of(st["st_mode"])
            key = os.fsencode(path[1:])
            if kind == "dir":
                value: tuple = ("dir", st["st_mode"] & 0o7777, None)
                todo.append(path)
            elif kind == "symlink":
                value = ("symlink", None, os.fsencode(view.readlink(path)))
            else:
                data = read_all(view, path)
                assert len(data) == st["st_size"], (path, len(data), st["st_size"])
                value = ("file", st["st_mode"] & 0o7777, data)
            if with_stat:
                value += (st["st_size"] if kind == "file" else None, st["st_mtime"] if kind != "dir" else None)
            out[key] = value
    return out


def orphan_scratch(view: Overlay) -> list[str]:
    """Scratch files nothing in the view refers to any more (a leak).

    A scratch file is legitimately alive while it is an agent's draft (idle
    drafts are kept as a cache of the version they are based on and are
    dropped when that version moves on) or the cache of a published node;
    an unlinked draft still open lives only through its descriptor, which
    does not keep a name in the scratch directory.
    """
    live = {os.path.basename(d.scratch) for d in view.drafts.values()}
    live |= {os.path.basename(n.scratch) for n in view.upper.nodes.values() if n.scratch is not None}
    live |= {os.path.basename(h.draft.scratch) for h in view.handles.values() if h.draft is not None}
    return sorted(set(os.listdir(view.scratch_dir)) - live)
