"""Which view paths are unversioned (DESIGN.md semantics 13; FUSE-free).

An unversioned path is never staged, never in a layer or a card, never
rolled back and never conflict-checked: the mount passes its changes
straight to the workspace (``passthrough.py``).  The rules, in order
(``store/ignorefile.py`` has the syntax; a later pattern overrides an earlier):

1. :data:`DEFAULT_PATTERNS`, unless the mount was made with
   ``--no-default-excludes``;
2. ``.stepfsignore`` at the workspace root, as the mount shows it (a
   staged edit counts at once); re-read when its version token changes,
   looked at no more often than every :data:`RELOAD_INTERVAL` seconds;
3. the mount's ``--exclude`` patterns.

Never unversioned, whatever the patterns say: the root, ``/.stepfs`` and
below (the read-only history tree), and ``/.stepfsignore`` itself (the
rules are versioned like any file, so a rollback brings back the rules of
its layer).

Threading: :meth:`Rules.covers` and :meth:`Rules.refresh` run on the FUSE
loop, with or without the view's lock (the re-read takes it, re-entrant,
through ``read_ignore``); :meth:`Rules.dir_covered` also runs on the
watcher thread, which only reads the matcher and adds to the memo and
``seen`` (single dict and set operations, atomic under the GIL; a stale
memo entry at a rules change costs one watch at worst).  The memo of
directories is cleared whenever the rules change.
"""

from __future__ import annotations

import logging
import os
import stat as stat_mod
import time
from typing import Callable

from stepfs.store.ignorefile import Matcher, Pattern, parse, parse_lenient

log = logging.getLogger("stepfs.unversioned")

#: Always-generated trees nobody wants versioned (README "Unversioned paths").
DEFAULT_PATTERNS = (
    "node_modules/",
    ".venv/",
    "__pycache__/",
    ".pytest_cache/",
    ".mypy_cache/",
    ".ruff_cache/",
    ".tox/",
    ".nox/",
    ".hypothesis/",
    ".gradle/",
    ".next/cache/",
    ".parcel-cache/",
)
IGNORE_FILE = "/.stepfsignore"
#: Seconds between two looks at ``.stepfsignore``'s version token.
RELOAD_INTERVAL = 0.5
#: The agent name under which the view reads ``.stepfsignore`` itself (no
#: real agent's observations are touched).
RULES_AGENT = "\0stepfs-rules"
#: Bytes of ``.stepfsignore`` read at most.
IGNORE_LIMIT = 1 << 20
#: Bound of the directory memo (cleared when reached: costs matches only).
MEMO_LIMIT = 200_000


def _never(path: str) -> bool:
    return path == "/" or path == IGNORE_FILE or path == "/.stepfs" or path.startswith("/.stepfs/")


class Rules:
    """The unversioned-path decision of one mount.

    ``read_ignore(last_token)`` -> ``(token, text or None, changed)``: the
    version token of ``/.stepfsignore`` as the view shows it, and, when it
    differs from ``last_token``, its text (None: absent) with ``changed``
    True; called at most every :data:`RELOAD_INTERVAL` seconds."""

    def __init__(self, excludes: list[str] = (), defaults: bool = True,
                 read_ignore: Callable[[str | None], tuple[str | None, str | None, bool]] | None = None,
                 clock=time.monotonic):
        self.defaults = defaults
        self.default_patterns = parse(DEFAULT_PATTERNS) if defaults else []
        self.exclude_patterns = parse(excludes)  # refused earlier (CLI) with a sentence
        self.file_patterns: list[Pattern] = []
        self.file_problems: list[str] = []
        self._read_ignore = read_ignore
        self._clock = clock
        self._token: str | None = None
        self._next_look = 0.0
        self._memo: dict[str, bool] = {}
        #: Top-most unversioned directories this mount has seen (for status).
        self.seen: set[str] = set()
        #: Counts the rule changes (``dirhandles.DirHandles`` empties its table at each).
        self.generation = 0
        self._build()

    def _build(self) -> None:
        self.generation += 1
        self.matcher = Matcher(self.default_patterns + self.file_patterns + self.exclude_patterns)
        self._any = bool(self.matcher.patterns)
        self._memo.clear()
        self.seen.clear()

    # -- .stepfsignore -----------------------------------------------------------

    def refresh(self, force: bool = False) -> bool:
        """Re-read ``.stepfsignore`` if its token changed; True when the
        rules changed."""
        if self._read_ignore is None:
            return False
        now = self._clock()
        if not force and now < self._next_look:
            return False
        self._next_look = now + RELOAD_INTERVAL
        try:
            token, text, changed = self._read_ignore(self._token)
        except Exception:
            log.exception("reading .stepfsignore failed; the rules stay as they were")
            return False
        if not changed:
            return False
        self._token = token
        patterns, problems = parse_lenient((text or "").splitlines())
        for p in problems:
            if p not in self.file_problems:
                log.warning(".stepfsignore: %s (line skipped)", p)
        self.file_problems = problems
        if patterns == self.file_patterns:
            return False
        self.file_patterns = patterns
        self._build()
        log.info(".stepfsignore read: %d patterns", len(patterns))
        return True

    # -- the decision --------------------------------------------------------------

    def dir_covered(self, path: str) -> bool:
        """Whether the directory at view path ``path`` (or one above it) is
        unversioned."""
        hit = self._memo.get(path)
        if hit is not None:
            return hit
        if _never(path):
            out = False
        else:
            parent = path.rpartition("/")[0] or "/"
            if parent != "/" and self.dir_covered(parent):
                out = True
            else:
                out = self.matcher.match(path[1:], True)
                if out:
                    self.seen.add(path)
        if len(self._memo) >= MEMO_LIMIT:
            self._memo.clear()
        self._memo[path] = out
        return out

    def covers(self, path: str, is_dir: bool | Callable[[], bool]) -> bool:
        """Whether view path ``path`` is unversioned.  ``is_dir``: whether it
        is (or is to be) a directory, or a callable asked only when the
        answer depends on it (a pattern with a trailing ``/``)."""
        if self._read_ignore is not None and self._clock() >= self._next_look:
            self.refresh()
        if not self._any or _never(path):
            return False
        parent = path.rpartition("/")[0] or "/"
        if parent != "/" and self.dir_covered(parent):
            return True
        if is_dir is True or is_dir is False:
            return self.dir_covered(path) if is_dir else self.matcher.match(path[1:], False)
        as_file = self.matcher.match(path[1:], False)
        if as_file:
            return True
        if not self.matcher.match(path[1:], True):
            return False
        return is_dir() and self.dir_covered(path)

    # -- for status ------------------------------------------------------------------

    def describe(self) -> dict:
        """What ``stepfs status`` shows: the patterns by source and the
        unversioned trees seen so far."""
        return {
            "defaults": [p.text for p in self.default_patterns],
            "stepfsignore": [p.text for p in self.file_patterns],
            "excludes": [p.text for p in self.exclude_patterns],
            "ignored_lines": list(self.file_problems),
            "trees": sorted(self.seen),
        }


def ignore_reader(lock, versions, content):
    """``Rules``' ``read_ignore`` for a view: ``/.stepfsignore`` as the mount
    shows it (a staged edit included), through the view's own content
    calls under its lock, as the internal agent :data:`RULES_AGENT`."""
    from stepfs.overlayfs.core.errors import ViewError
    from stepfs.store import tokens

    def read(last: str | None) -> tuple[str | None, str | None, bool]:
        with lock:
            try:
                token = versions.current_token(IGNORE_FILE)[0]
            except (ViewError, OSError):
                token = tokens.ABSENT
            if token == last:
                return token, None, False
            if not _is_file(versions, IGNORE_FILE):
                return token, None, True  # a FIFO there would block the view (under its lock) at the open
            try:
                fh = content.open(IGNORE_FILE, os.O_RDONLY, agent=RULES_AGENT)
            except (ViewError, OSError):
                return token, None, True  # absent, or not a file: no patterns
            try:
                chunks, offset = [], 0
                while offset < IGNORE_LIMIT:
                    data = content.read(fh, 65536, offset)
                    if not data:
                        break
                    chunks.append(data)
                    offset += len(data)
            finally:
                content.release(fh)
            return token, b"".join(chunks).decode("utf-8", "replace"), True

    return read


def _is_file(versions, path: str) -> bool:
    """Whether ``path`` is a regular file in the view (staged or not)."""
    from stepfs.overlayfs.core.errors import ViewError
    try:
        node, st = versions.ns.resolve(path)
    except (ViewError, OSError):
        return False
    return node.kind == "file" if node is not None else stat_mod.S_ISREG(st.st_mode)
