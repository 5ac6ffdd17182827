"""Diffs and file text as rows of highlighted HTML (presentation only).

The content comes from ``store.diff`` (``lines_of``: lines or None for
binary and oversized content); this module only pairs lines up (difflib)
and highlights them with Pygments.  Highlighting lexes the whole text once
and cuts the tokens at line ends, so a token spanning lines (a docstring)
keeps its colour on every line.  Every piece of text is escaped here:
templates get :class:`markupsafe.Markup` rows and nothing else.

Limits, so a huge file never makes a huge page: a text above
:data:`HIGHLIGHT_LIMIT` characters is shown without colours, and at most
``max_rows`` rows are made (``truncated`` then says so; the page links the
raw file).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field

from markupsafe import Markup, escape
from pygments.lexers import get_lexer_for_filename
from pygments.lexers.special import TextLexer
from pygments.token import STANDARD_TYPES
from pygments.util import ClassNotFound

#: Texts longer than this are shown without syntax colours (lexing is slow).
HIGHLIGHT_LIMIT = 512 * 1024
#: Context lines around a change, as ``diff -u``.
CONTEXT = 3


def _bare(line: str) -> str:
    """A line without its line break (any that ``str.splitlines`` knows)."""
    return (line.splitlines() or [""])[0]


def _css_class(ttype) -> str:
    while ttype not in STANDARD_TYPES:
        ttype = ttype.parent
    return STANDARD_TYPES[ttype]


def _lexer(filename: str):
    try:
        return get_lexer_for_filename(filename, stripnl=False, stripall=False, ensurenl=True)
    except ClassNotFound:
        return TextLexer(stripnl=False, ensurenl=True)


def highlight(lines: list[str], filename: str) -> list[Markup]:
    """``lines`` (as ``store.diff.text_lines`` gives them) as one escaped,
    highlighted HTML fragment per line."""
    bare = [_bare(line) for line in lines]
    if sum(len(b) for b in bare) > HIGHLIGHT_LIMIT:
        return [Markup(escape(b)) for b in bare]
    out: list[list[str]] = [[]]
    for ttype, value in _lexer(filename).get_tokens("\n".join(bare)):
        cls = _css_class(ttype)
        for i, part in enumerate(value.split("\n")):
            if i:
                out.append([])
            if part:
                text = str(escape(part))
                out[-1].append(f'<span class="{cls}">{text}</span>' if cls else text)
    rows = [Markup("".join(parts)) for parts in out[:len(bare)]]
    return rows + [Markup("")] * (len(bare) - len(rows))


@dataclass
class Row:
    """One row of a diff: ``tag`` is ' ', '-', '+' (unified) or
    equal/replace/delete/insert (side by side); a None number is an empty cell."""

    tag: str
    old_no: int | None = None
    old: Markup = Markup("")
    new_no: int | None = None
    new: Markup = Markup("")


@dataclass
class Hunk:
    header: str
    rows: list[Row] = field(default_factory=list)


@dataclass
class Rendered:
    hunks: list[Hunk]
    truncated: bool
    rows: int


def render(old: list[str], new: list[str], filename: str, side_by_side: bool = False,
           max_rows: int = 2000) -> Rendered:
    """The diff of two texts as hunks of rows (unified or side by side)."""
    hi_old, hi_new = highlight(old, filename), highlight(new, filename)
    matcher = difflib.SequenceMatcher(None, [_bare(x) for x in old], [_bare(x) for x in new], autojunk=False)
    hunks: list[Hunk] = []
    count = 0
    for group in matcher.get_grouped_opcodes(CONTEXT):
        i1, i2, j1, j2 = group[0][1], group[-1][2], group[0][3], group[-1][4]
        hunk = Hunk(f"@@ -{i1 + 1},{i2 - i1} +{j1 + 1},{j2 - j1} @@")
        for tag, a1, a2, b1, b2 in group:
            rows = _side_rows(tag, a1, a2, b1, b2, hi_old, hi_new) if side_by_side else \
                _unified_rows(tag, a1, a2, b1, b2, hi_old, hi_new)
            for row in rows:
                if count >= max_rows:
                    hunks.append(hunk)
                    return Rendered(hunks, True, count)
                hunk.rows.append(row)
                count += 1
        hunks.append(hunk)
    return Rendered(hunks, False, count)


def _unified_rows(tag, a1, a2, b1, b2, hi_old, hi_new):
    if tag == "equal":
        for k in range(a2 - a1):
            yield Row(" ", a1 + k + 1, hi_old[a1 + k], b1 + k + 1, hi_new[b1 + k])
        return
    for i in range(a1, a2):
        yield Row("-", i + 1, hi_old[i])
    for j in range(b1, b2):
        yield Row("+", None, Markup(""), j + 1, hi_new[j])


def _side_rows(tag, a1, a2, b1, b2, hi_old, hi_new):
    for k in range(max(a2 - a1, b2 - b1)):
        i, j = a1 + k, b1 + k
        left = i < a2
        right = j < b2
        yield Row(tag, i + 1 if left else None, hi_old[i] if left else Markup(""),
                  j + 1 if right else None, hi_new[j] if right else Markup(""))


def numbered(lines: list[str], filename: str, max_rows: int = 5000) -> tuple[list[tuple[int, Markup]], bool]:
    """A whole text as ``[(line number, highlighted line)]``, at most
    ``max_rows`` of them, and whether it was cut."""
    cut = lines[:max_rows]
    return list(enumerate(highlight(cut, filename), 1)), len(lines) > max_rows
