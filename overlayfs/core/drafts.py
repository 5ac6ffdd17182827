"""What an open file of the view holds: drafts, handles, and copying their bytes (FUSE-free).

A :class:`Draft` is one agent's working copy of one path (``content.py``
says how drafts are shared, published and frozen); a :class:`Handle` is
one open file descriptor of the mount.

Lock rule: changed only under the view's lock.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass, field
from typing import Any

from stepfs.overlayfs.core.upper import Node


@dataclass(eq=False)
class Draft:
    """One agent's working copy of one path."""

    agent: str
    path: str
    scratch: str
    base: str  # the published token this draft starts from / last published
    node_base: str  # workspace token for a node created when publishing
    mode: int
    ino: int
    uid: int
    gid: int
    opens: int = 0
    dirty: bool = False
    stale: bool = False  # a close already lost the compare-and-swap
    detached: bool = False  # unlinked by its own agent: closes succeed, bytes go nowhere
    # Its close published ``scratch`` by reference: the file is the node's
    # content now and is never written again; a write first moves the draft
    # to a copy (``_thaw``).  A frozen draft is forgotten when its last
    # handle closes.
    frozen: bool = False
    xattrs: dict = field(default_factory=dict)  # of the workspace file it copies
    # A small draft lives in memory: ``mem`` is its memfd and ``scratch``
    # names it through /proc (see :meth:`Content._draft_storage`); -1 for a
    # draft in a scratch file.
    mem: int = -1
    # Running XXH3-128 of the draft's bytes [0, sum_end), kept while the
    # draft is written front to back from empty (created, or opened with
    # O_TRUNC), so that staging it by reference needs no re-read of the
    # file for its sum (``cas.py``).  ``sum_end`` -1: no running sum (any
    # other change ends it: ``Content._writable``); 0 with ``sum`` None:
    # one may start at the first write.
    sum: Any = None
    sum_end: int = -1


@dataclass(eq=False)
class Handle:
    """An open file: ``fd`` reads the draft, the published scratch, or the
    workspace file; ``data`` serves files of the ``.stepfs`` tree."""

    path: str
    fd: int
    agent: str
    writable: bool
    draft: Draft | None = None
    node: Node | None = None
    wrote: bool = False
    result: str | None = None  # last compare-and-swap decision: "ok" | "stale"
    data: bytes | None = None
    direct: bool = False
    token: str = ""  # the published version this handle was opened on
    # A small staged file's content as of the open, served instead of
    # ``fd`` (-1 then; ``Content._snapshot``).
    snap: bytes | None = None


def sparse_copy(src: int, dst: int, size: int) -> None:
    """Copy ``size`` bytes, leaving holes where the source has them."""
    pos = 0
    while pos < size:
        try:
            data_start = os.lseek(src, pos, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # only a hole remains
                break
            raise
        hole = os.lseek(src, data_start, os.SEEK_HOLE)
        _copy_range(src, dst, data_start, hole)
        pos = hole
    os.ftruncate(dst, size)


def _copy_range(src: int, dst: int, off: int, end: int) -> None:
    """Copy bytes ``[off, end)`` to the same offsets; ``copy_file_range``
    refuses to cross filesystems (EXDEV: a memory draft and a file), then
    the bytes go through user space (memory drafts are small)."""
    while off < end:
        try:
            n = os.copy_file_range(src, dst, end - off, off, off)
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            data = os.pread(src, min(end - off, 1 << 20), off)
            n = len(data) and os.pwrite(dst, data, off)
        if n == 0:
            break
        off += n
