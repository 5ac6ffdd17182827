"""Link counts of multi-link workspace files, and the names the kernel may
hold attributes of (FUSE-free).

libfuse's high-level API gives every name its own kernel inode, so when the
view covers one name of a workspace file with several links (removes it, or
copies it up as a file of its own), the file's other names must show one
link fewer, and the kernel may still hold their old count.  :class:`Links`
keeps both facts, without a directory scan: only the names the view
answered can be held.

Lock rule: called only under the view's lock.
"""

from __future__ import annotations

import os
import stat as stat_mod
import time
from typing import Callable

from stepfs.overlayfs.core.upper import Node

#: Bound of :attr:`Links.shown` (names); past it every later removal of a
#: name of a multi-link workspace file renews the kernel's names.
LOWER_SHOWN_LIMIT = 50_000


class Links:
    """``renew_names()``: make the kernel look every name up again (the FUSE
    adapter's ``KernelCache.new_epoch``); ``invalidate(path)``: drop the
    kernel's caches of one path."""

    def __init__(self, renew_names: Callable[[], None], invalidate: Callable[[str], None]):
        self._renew_names = renew_names
        self._invalidate = invalidate
        #: A workspace file with several names, some of which the view
        #: covers: (dev, ino) -> (the names covered, when).  Its other names
        #: show that many links fewer.  Kept exact across ``forget``
        #: (:meth:`recount`).
        self.gone: dict[tuple[int, int], tuple[set[str], int]] = {}
        #: The names the kernel may hold attributes of, of workspace files
        #: with several links: (dev, ino) -> view paths the view answered.
        self.shown: dict[tuple[int, int], set[str]] = {}
        self._count = 0
        self._lost = False  # the bound was hit

    def held(self) -> bool:
        """Whether a link count the kernel may hold can change under it."""
        return bool(self.gone or self.shown or self._lost)

    def name_gone(self, st: os.stat_result, path: str) -> None:
        """The name ``path`` of the workspace file ``st`` is now covered by
        the upper layer: the file's other names show one link fewer and a
        new ctime from now on.  When one of them may be held by the kernel
        (each name is an inode of its own to it), the kernel is told to
        look every name up again (:meth:`renew`)."""
        if st.st_nlink > 1 and not stat_mod.S_ISDIR(st.st_mode):
            key = (st.st_dev, st.st_ino)
            gone = self.gone.get(key)
            names_gone = gone[0] if gone is not None else set()
            names_gone.add(path)
            self.gone[key] = (names_gone, time.time_ns())
            names = self.shown.get(key)
            if names is not None and path in names:
                names.discard(path)  # unlinked, or a file of its own now: not a name of this file
                self._count -= 1
                if not names:
                    del self.shown[key]
            if names or self._lost:
                self.renew()

    def recount(self, covered: Callable[[str], bool],
                lower_stat: Callable[[str], os.stat_result | None]) -> None:
        """After the workspace or the upper layer changed other than by the
        view's own operations (a discard, a rollback): keep in :attr:`gone`
        exactly the recorded names the upper layer still ``covered``, under
        the workspace file each one names now (a name given back, or whose
        file was replaced, no longer takes a link from the old file).  One
        ``lower_stat`` per recorded name; clearing it instead showed the
        names a step removed as links again."""
        if not self.gone:
            return
        names = set().union(*(gone[0] for gone in self.gone.values()))
        when = {key: gone[1] for key, gone in self.gone.items()}
        now = time.time_ns()
        self.gone.clear()
        for path in names:
            if not covered(path):
                continue
            st = lower_stat(path)
            if st is None or st.st_nlink <= 1 or stat_mod.S_ISDIR(st.st_mode):
                continue
            key = (st.st_dev, st.st_ino)
            gone = self.gone.get(key)
            if gone is None:
                gone = self.gone[key] = (set(), when.get(key, now))
            gone[0].add(path)

    def shown_lower(self, st: os.stat_result, path: str, ctime: int) -> tuple[int, int]:
        """The view answers the attributes of ``path``, a name of the
        multi-link workspace file ``st``: record it (:meth:`shown_name`) and
        return the ``(st_nlink, st_ctime)`` to show for it."""
        self.shown_name(st, path)
        nlink = st.st_nlink
        if self.gone:
            gone = self.gone.get((st.st_dev, st.st_ino))
            if gone is not None:
                nlink, ctime = max(1, nlink - len(gone[0])), max(ctime, gone[1])
        return nlink, ctime

    def shown_name(self, st: os.stat_result, path: str) -> None:
        """Remember that the kernel may hold the attributes of ``path``, a
        name of the workspace file ``st``, if the file has several names.

        Invariant: every name of a multi-link workspace file whose
        attributes the kernel may use without asking again (until the
        attribute timeout) is in :attr:`shown` -- or the bound was hit.
        Every attribute the kernel holds came from ``getattr`` (libfuse
        asks it for lookups too; a READDIRPLUS listing carries attributes
        only from it), from a commit that turned staged names into
        workspace names (the view records those), or from before the last
        :meth:`renew`, after which the kernel asks again for every name it
        walks.  Extra paths cost at most a needless renewal.  O(1) per
        answer; bounded by :data:`LOWER_SHOWN_LIMIT`."""
        if st.st_nlink <= 1 or stat_mod.S_ISDIR(st.st_mode) or self._lost:
            return
        key = (st.st_dev, st.st_ino)
        names = self.shown.get(key)
        if names is not None and path in names:
            return
        if self._count >= LOWER_SHOWN_LIMIT:
            self._lost = True  # any name may be held: renew at the next removal
            return
        if names is None:
            names = self.shown[key] = set()
        names.add(path)
        self._count += 1

    def renew(self) -> None:
        """Make the kernel look every name up again before it uses the
        attributes it holds (a new FUSE epoch); its lookups reach the view's
        ``getattr``, which records the names afresh.

        Why not invalidate just the recorded names: libfuse3's
        ``fuse_invalidate_path`` drops a name's pages as well as its
        attributes, and on the FUSE loop thread (where unlink runs) that can
        wait for a page locked by a read of that name queued behind this very
        request: a deadlock.  In-mount links avoid it by opening every name
        ``direct_io``; doing that for every multi-link workspace file would
        take the page cache and shared mmap from whole package stores.  Off
        the loop thread the invalidation could not be ordered before the
        reply, so the names would stay stale for a moment.  A new epoch
        takes no lock and is in effect before the reply."""
        self.shown.clear()
        self._count = 0
        self._lost = False
        self._renew_names()

    def invalidate_names(self, node: Node, except_path: str | None = None) -> None:
        """Drop the kernel's caches of the other names of an upper hard link."""
        if node.link_group is not None:
            for name in node.names:
                if name != except_path:
                    self._invalidate(name)
