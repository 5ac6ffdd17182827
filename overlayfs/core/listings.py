"""Listings of workspace directories, reused while a directory is unchanged.

The kernel caches listings only while the mount watches the workspace
(``libfuse.lowlevel.ListingCache``), and drops a cached listing at every change;
every other ``getdents`` (the first listing after a change, a mount that
cannot watch) comes to the view, and reading the workspace directory again
(``openat2`` + ``getdents``) was most of what such a ``readdir`` cost.  :class:`Listings` keeps the last listing of each
workspace directory with a *stamp* of the directory taken before it was
read, and hands it out again while a fresh ``lstat`` of the directory
shows the same stamp.

Why an equal stamp means an equal listing: adding, removing or renaming an
entry sets the directory's mtime and ctime to the current time, and a new
directory at the same path has another inode or a new ctime.  The one
hole is the timestamp granularity: a change within the same clock tick as
the stamp leaves the times equal.  So a listing is only kept when the
directory's ctime was older than :data:`RACY_NS` (:data:`RACY_COARSE_NS`
for a filesystem that stores whole seconds) when the listing was read; a
later change then gets a later ctime.  (The same rule as git's "racily
clean" index entries.)  A change between the ``lstat`` and the read only
makes the kept listing newer than its stamp, so the next ``lstat`` misses.

Assumes the workspace is a local filesystem whose directory times follow
the system clock (ext4, xfs, btrfs, tmpfs...), as the inotify watcher does.

Not thread-safe: the view calls it under its lock.
"""

from __future__ import annotations

import os
import time

from stepfs.store.contained import Root

#: A directory changed this recently may change again with an equal ctime
#: (coarse clock ticks are at most 10 ms; the rest is margin).
RACY_NS = 100_000_000
#: ... and on a filesystem whose timestamps have no nanoseconds (ext4 with
#: 128-byte inodes: 1 s; FAT: 2 s).
RACY_COARSE_NS = 2_000_000_000
#: Bound of the cache (cleared when full: only the reuse is lost).
LIMIT = 20_000

Stamp = tuple[int, int, int, int, int, int]


def stamp_of(st: os.stat_result) -> Stamp:
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_nlink)


def settled(st: os.stat_result, now_ns: int) -> bool:
    """True when any later change of the directory must change its ctime."""
    ctime = st.st_ctime_ns
    racy = RACY_COARSE_NS if ctime % 1_000_000_000 == 0 else RACY_NS
    return ctime < now_ns - racy


class Listings:
    """Workspace path (``upper.rel``) -> ``(stamp, [(name, S_IFMT bits,
    inode)])``, names decoded as the view shows them (``os.fsdecode``)."""

    def __init__(self, root: Root, limit: int = LIMIT):
        self.root = root
        self.limit = limit
        self._kept: dict[bytes, tuple[Stamp, list[tuple[str, int, int]]]] = {}

    def listdir(self, path: bytes, st: os.stat_result) -> list[tuple[str, int, int]]:
        """``Root.listdir(path)`` with decoded names, sorted by name (shared:
        do not modify);
        ``st``: the directory's ``lstat``, taken just before this call.
        Raises like ``Root.listdir``."""
        stamp = stamp_of(st)
        kept = self._kept.get(path)
        if kept is not None and kept[0] == stamp:
            return kept[1]
        now = time.time_ns()
        entries = sorted(self.root.listdir(path, decoded=True))  # names are unique: sorted by name
        if settled(st, now):
            if len(self._kept) >= self.limit:
                self._kept.clear()
            self._kept[path] = (stamp, entries)
        else:
            self._kept.pop(path, None)
        return entries
