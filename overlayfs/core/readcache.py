"""The bytes of small staged files, kept for their next readers (FUSE-free).

A read-only open of a small staged file (under ``content.MEMORY_DRAFT_MAX``
bytes, not staged by reference) is served from one ``bytes`` snapshot of
its content, which the handle keeps (an immutable snapshot: a later publish
replaces the node's content, never this).  The snapshot comes from here
when the file was published or read lately, else from the store.  Tools
read back what they just wrote (``diff -r`` after ``rsync``, ``tar -c`` of
a fresh copy, ``cp -a`` after ``sed -i``, git reading its objects): each
such open used to copy the content from SQLite into a new memfd.

Entries are keyed by the node object (held, so its ``id`` is not reused)
and dropped by every publish of that node (``CompareAndSwap._published``,
the only place a node's content changes; a rename or a commit keeps the
content).  The bytes are bounded (:data:`READ_CACHE_MAX`, least recently
used out first, and at most :data:`READ_CACHE_FILES` files); no
descriptor is held.

Lock rule: called only under the view's lock.
"""

from __future__ import annotations

from stepfs.overlayfs.core.upper import Node

#: Bytes of content kept for readers at most (the daemon's memory).
READ_CACHE_MAX = 64 << 20
#: Files kept at most (an entry holds its node: empty files cost no bytes).
READ_CACHE_FILES = 1 << 16


class ReadCache:
    """``entry_max``: the size from which a file is not kept (its readers
    get a scratch file instead)."""

    __slots__ = ("_entries", "bytes", "limit", "entry_max")

    def __init__(self, entry_max: int, limit: int = READ_CACHE_MAX) -> None:
        self._entries: dict[int, tuple[Node, bytes]] = {}  # id(node) -> (node, content); oldest first
        self.bytes = 0
        self.limit = limit
        self.entry_max = entry_max

    def get(self, node: Node) -> bytes | None:
        """``node``'s content if kept (and now the most recently used)."""
        entry = self._entries.pop(id(node), None)
        if entry is None:
            return None
        if entry[0] is not node or len(entry[1]) != node.size:
            self.bytes -= len(entry[1])
            return None
        self._entries[id(node)] = entry
        return entry[1]

    def put(self, node: Node, data: bytes) -> None:
        """Keep ``data`` as ``node``'s content (it is, as of now)."""
        self.drop(node)
        if len(data) >= self.entry_max:
            return
        self._entries[id(node)] = (node, data)
        self.bytes += len(data)
        entries = self._entries
        while self.bytes > self.limit or len(entries) > READ_CACHE_FILES:
            _node, old = entries.pop(next(iter(entries)))
            self.bytes -= len(old)

    def drop(self, node: Node) -> None:
        """``node``'s content changes (or goes)."""
        entry = self._entries.pop(id(node), None)
        if entry is not None:
            self.bytes -= len(entry[1])

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)
