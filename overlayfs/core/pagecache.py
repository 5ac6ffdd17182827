"""Whether a handle may use the kernel's page cache (FUSE-free).

One agent at a time has a file's page cache and shared ``mmap``; a handle
opened while another agent has the file open bypasses it (``direct_io``).
"""

from __future__ import annotations

import os
from typing import Iterable

from stepfs.overlayfs.core.drafts import Handle
from stepfs.overlayfs.core.namespace import Namespace


def needs_direct_io(ns: Namespace, handles: Iterable[Handle], observed: dict, path: str, agent: str) -> bool:
    """The kernel's page cache and size of an inode are shared by every
    process, whatever its agent.  A handle may use them only while no
    other agent has the path open: then the cache holds one agent's view
    (its draft, or the published version), and the next agent to open
    it gets a handle that bypasses the cache.  That handle's direct
    writes drop the cached pages they overlap, so the first agent
    re-reads them through its own handle; and an open that keeps no
    cache drops the previous agent's pages (see fuse_ops ``_keep_pages``).
    So one agent at a time -- the default one or a named one -- has the
    cache and shared ``mmap`` (SQLite in WAL mode needs it); handles
    opened while another agent has the path open do not.

    Handles keep the path they were opened on (another agent's rename
    does not move them), while the kernel's inode moves with the name:
    so another agent's handle counts if it was opened on ``path`` or
    holds the very file ``path`` names now (the same inode number as
    the view shows it).

    Cost: nothing while only one agent has ever opened a file (every
    open records an observation); otherwise a pass over the open
    handles, which are few, and, if none was opened on ``path``, one
    ``lstat`` and an ``fstat`` per other agent's workspace handle."""
    node = ns.upper.get(path)
    if node is not None and node.link_group is not None:
        return True  # the kernel caches each name of a hard link as its own inode
    if len(observed) < 2 and agent in observed:
        return False
    others = [h for h in handles if h.agent != agent and h.data is None]
    if not others:
        return False
    if any(h.path == path for h in others):
        return True
    ino = ns.file_ino(path)
    return ino is not None and any(_handle_ino(ns, h) == ino for h in others)


def _handle_ino(ns: Namespace, h: Handle) -> int | None:
    """The inode number of the file handle ``h`` holds, or None."""
    if h.draft is not None:
        return ns.shown_ino(ns.root_dev, h.draft.ino)
    if h.node is not None:
        return ns.shown_ino(ns.root_dev, h.node.ino)
    if h.fd < 0:
        return None
    st = os.fstat(h.fd)
    return ns.shown_ino(st.st_dev, st.st_ino)
