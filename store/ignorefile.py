"""Gitignore-syntax patterns: parsing and matching (no I/O; the format of
``.stepfsignore``, here so the CLI can check ``--exclude`` before it mounts).

What ``.stepfsignore`` and ``stepfs mount --exclude`` are written in, with
git's rules (``gitignore(5)``):

* a blank line or one starting with ``#`` is nothing; ``\\#`` and ``\\!``
  start a pattern with that character; trailing spaces are dropped unless
  escaped with a backslash;
* ``!`` re-includes what an earlier pattern excluded; the last matching
  pattern decides;
* a trailing ``/`` matches directories only;
* a pattern with a ``/`` at its start or in its middle is anchored at the
  workspace root; one without matches a name at any depth;
* ``*`` and ``?`` match within one component, ``[...]`` is a character
  class (``[!...]`` or ``[^...]`` negated); a leading ``**/`` matches in
  every directory, a trailing ``/**`` everything inside, ``/**/`` zero or
  more directories;
* a path under an excluded directory is excluded, and no ``!`` pattern
  can re-include it (git's own rule: git never lists the directory).

Written here rather than taken from ``pathspec``: the matcher sits on the
mount's hot path (every create, unlink, rename), where one compiled
alternation per pattern set and a per-directory memo (``unversioned.py``)
cost a dict lookup, and pathspec's per-call pattern loop does not; and the
syntax is small enough to be tested completely (tests/test_unversioned_rules.py).

A pattern can only ever name paths inside the mount: patterns are matched
against the view paths the kernel hands the daemon, never resolved
themselves.  A pattern with a ``..`` component is refused (:func:`parse`
raises :class:`BadPattern`; a ``.stepfsignore`` line with one is skipped)
because it could only ever mislead a reader into thinking it reaches out.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


class BadPattern(ValueError):
    """A pattern stepfs will not use (the message says why)."""


@dataclass(frozen=True)
class Pattern:
    text: str            # as written (for status)
    negate: bool
    dir_only: bool
    regex: str           # matches the whole relative path (no leading slash)


def _class(pat: str, i: int) -> tuple[str, int]:
    """Translate the character class starting at ``pat[i] == '['``; returns
    the regex and the index after it (an unclosed ``[`` is a literal)."""
    j = i + 1
    if j < len(pat) and pat[j] in "!^":
        j += 1
    if j < len(pat) and pat[j] == "]":
        j += 1
    while j < len(pat) and pat[j] != "]":
        j += 1
    if j >= len(pat):
        return re.escape("["), i + 1
    body = pat[i + 1:j]
    neg = body[:1] in ("!", "^")
    if neg:
        body = body[1:]
    body = body.replace("\\", "\\\\")
    # '/' never matches inside a class (it would cross a component).
    return ("[^/" if neg else "(?!/)[") + body + "]", j + 1


def _translate(pat: str) -> str:
    """Glob (already stripped of ``!``, the trailing ``/`` and the anchor
    slash) -> regex body over a relative path."""
    out = []
    i, n = 0, len(pat)
    while i < n:
        c = pat[i]
        if c == "*":
            if pat.startswith("**", i) and (i == 0 or pat[i - 1] == "/") and (i + 2 == n or pat[i + 2] == "/"):
                if i + 2 == n:  # trailing '**': everything below
                    out.append(".*")
                    i += 2
                else:  # '**/': zero or more directories
                    out.append("(?:.*/)?")
                    i += 3
                continue
            while i < n and pat[i] == "*":
                i += 1
            out.append("[^/]*")
            continue
        if c == "?":
            out.append("[^/]")
        elif c == "[":
            piece, i = _class(pat, i)
            out.append(piece)
            continue
        elif c == "\\" and i + 1 < n:
            i += 1
            out.append(re.escape(pat[i]))
        else:
            out.append(re.escape(c))
        i += 1
    return "".join(out)


def parse_line(line: str) -> Pattern | None:
    """One line -> a :class:`Pattern`, or None for a blank or comment line.
    Raises :class:`BadPattern` for a pattern with a ``..`` component."""
    text = line.rstrip("\n").rstrip("\r")
    # Trailing spaces go unless the last one is escaped.
    stripped = text.rstrip(" ")
    if stripped.endswith("\\") and len(stripped) < len(text):
        stripped += " "
    text = stripped
    if not text or text.startswith("#"):
        return None
    pat = text
    negate = False
    if pat.startswith("!"):
        negate, pat = True, pat[1:]
    elif pat.startswith("\\!") or pat.startswith("\\#"):
        pat = pat[1:]
    dir_only = pat.endswith("/") and not pat.endswith("\\/")
    pat = pat.rstrip("/") if dir_only else pat
    if not pat:
        return None
    if ".." in pat.split("/"):
        raise BadPattern(f"the pattern {text!r} has a '..' component: patterns name paths inside the workspace, "
                         f"relative to its root")
    anchored = "/" in pat
    pat = pat.lstrip("/")
    if not pat:
        return None
    body = _translate(pat)
    if not anchored and not pat.startswith("**"):
        body = "(?:.*/)?" + body
    return Pattern(text, negate, dir_only, body)


def parse(lines) -> list[Pattern]:
    """Every pattern of ``lines`` (an iterable of str), in order; raises
    :class:`BadPattern` at the first refused one."""
    out = []
    for line in lines:
        p = parse_line(line)
        if p is not None:
            out.append(p)
    return out


def parse_lenient(lines) -> tuple[list[Pattern], list[str]]:
    """:func:`parse` that skips refused lines: ``(patterns, reasons)``
    (a file the agent can edit must not stop the mount)."""
    out, bad = [], []
    for line in lines:
        try:
            p = parse_line(line)
        except BadPattern as exc:
            bad.append(str(exc))
            continue
        if p is not None:
            out.append(p)
    return out, bad


class Matcher:
    """The decision of an ordered list of patterns for one path.

    ``match(rel, is_dir)`` -> whether the last pattern that matches ``rel``
    (a relative path, no leading slash) excludes it.  Ancestors are not
    looked at here (``unversioned.Rules`` does that, with a memo)."""

    def __init__(self, patterns: list[Pattern]):
        self.patterns = list(patterns)
        self._negations = any(p.negate for p in patterns)
        if not self._negations:
            # One alternation per kind of path: a single regex call.
            any_kind = [p.regex for p in patterns if not p.dir_only]
            dirs = [p.regex for p in patterns]
            self._file_re = re.compile("(?:" + "|".join(any_kind) + r")\Z", re.S) if any_kind else None
            self._dir_re = re.compile("(?:" + "|".join(dirs) + r")\Z", re.S) if dirs else None
        else:
            self._ordered = [(re.compile(p.regex + r"\Z", re.S), p.negate, p.dir_only) for p in reversed(patterns)]

    def match(self, rel: str, is_dir: bool) -> bool:
        if not self._negations:
            r = self._dir_re if is_dir else self._file_re
            return r is not None and r.match(rel) is not None
        for rx, negate, dir_only in self._ordered:
            if dir_only and not is_dir:
                continue
            if rx.match(rel) is not None:
                return not negate
        return False
