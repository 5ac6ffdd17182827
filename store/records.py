"""What a layer records and what a card counts, as plain values (no
database import: the CLI's no-mount ``log`` and ``show`` load this).

:class:`State`, :class:`Entry` and :class:`Layer` are the rows of
``entries`` and ``layers`` (``store.layers`` reads them with SQLAlchemy,
``store.cardrows`` with plain SQL); :class:`Change` is one path's change
between two states (``store.diff``).  The functions take the reads they need
as callables, so both readers share them.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Callable

#: Files above this size are not diffed or line-counted (reported as binary).
TEXT_LIMIT = 4 << 20


@dataclass(frozen=True)
class State:
    """A path's state in a layer entry; ``kind is None`` means absent."""

    kind: str | None
    mode: int | None = None
    oid: str | None = None
    target: bytes | None = None
    uid: int | None = None
    gid: int | None = None
    xattrs: bytes | None = None  # store/xattrs.py encoding

    def op_against(self, before: "State") -> str:
        if before.kind is None:
            return "added"
        if self.kind is None:
            return "deleted"
        if before.kind != self.kind:
            return "replaced"
        if before.oid == self.oid and before.target == self.target:
            return "mode" if before.mode != self.mode else "metadata"
        return "modified"


@dataclass
class Entry:
    path: bytes
    before: State
    after: State
    after_mtime_ns: int | None = None
    after_link: bytes | None = None  # publish as a hard link of this path

    @property
    def op(self) -> str:
        return self.after.op_against(self.before)


@dataclass
class Layer:
    number: int
    state: str
    kind: str
    created_ns: int
    message: str
    agent: str
    mount: str
    meta: dict = field(default_factory=dict)
    added: int = 0
    modified: int = 0
    deleted: int = 0


@dataclass
class Change:
    """``before`` -> ``after`` at ``path``; a rename also has ``old_path``."""

    path: bytes
    before: State
    after: State
    old_path: bytes | None = None

    @property
    def op(self) -> str:
        if self.old_path is not None:
            return "renamed"
        return self.after.op_against(self.before)


def text_lines(data: bytes) -> list[str] | None:
    """``data`` split into lines (ends kept), or None if it is binary."""
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8").splitlines(keepends=True)
    except UnicodeDecodeError:
        return None


def count_lines(a: list[str], b: list[str]) -> tuple[int, int]:
    """``(added, removed)`` lines between two texts."""
    added = removed = 0
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b).get_opcodes():
        if tag in ("replace", "delete"):
            removed += i2 - i1
        if tag in ("replace", "insert"):
            added += j2 - j1
    return added, removed


def _content_key(size_of: Callable[[str], int], s: State) -> tuple | None:
    if s.kind == "file" and s.oid is not None and size_of(s.oid) > 0:
        return ("file", s.oid)
    if s.kind == "symlink":
        return ("symlink", s.target)
    return None


def pair_renames(changes: list[Change], size_of: Callable[[str], int]) -> list[Change]:
    """Pair deletions with additions of the same content (one to one, in
    path order); everything else is returned unchanged, sorted by path.
    ``size_of(oid)``: an object's size (empty files are never paired)."""
    gone: dict[tuple, list[Change]] = {}
    for c in changes:
        if c.after.kind is None and c.before.kind is not None:
            key = _content_key(size_of, c.before)
            if key is not None:
                gone.setdefault(key, []).append(c)
    if not gone:
        return sorted(changes, key=lambda c: c.path)
    paired: set[int] = set()
    out = []
    for c in sorted(changes, key=lambda c: c.path):
        if c.before.kind is None and c.after.kind is not None:
            key = _content_key(size_of, c.after)
            candidates = gone.get(key) if key is not None else None
            if candidates:
                src = candidates.pop(0)
                paired.add(id(src))
                out.append(Change(c.path, src.before, c.after, old_path=src.path))
                continue
        out.append(c)
    return sorted((c for c in out if id(c) not in paired), key=lambda c: c.path)


def lines_of(c: Change, size_of: Callable[[str], int], read: Callable[[str], bytes]
             ) -> tuple[list[str] | None, list[str] | None, int, int]:
    """``(old lines, new lines, old size, new size)``; lines are None for
    binary or oversized content.  Only files and symlinks have lines.
    ``size_of(oid)`` and ``read(oid)``: an object's size and bytes."""
    def size(s: State) -> int:
        if s.kind == "file" and s.oid is not None:
            return size_of(s.oid)
        if s.kind == "symlink":
            return len(s.target or b"")
        return 0

    def content(s: State) -> bytes:
        if s.kind == "file" and s.oid is not None:
            return read(s.oid)
        if s.kind == "symlink":
            return s.target or b""
        return b""

    n_old, n_new = size(c.before), size(c.after)
    if max(n_old, n_new) > TEXT_LIMIT:
        return None, None, n_old, n_new
    old = content(c.before) if c.before.kind in ("file", "symlink") else b""
    new = content(c.after) if c.after.kind in ("file", "symlink") else b""
    return text_lines(old), text_lines(new), len(old), len(new)
