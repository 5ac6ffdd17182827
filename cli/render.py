"""Human text for results that several commands print (output only): the
one renderer of a change card, used by ``show``, ``run`` and ``rollback``."""

from __future__ import annotations

import re

#: What a terminal would act on instead of show: C0 and C1 controls, DEL,
#: the bidirectional overrides and isolates (they reorder what follows),
#: and the surrogates ``os.fsdecode`` makes of bytes that are not UTF-8;
#: plus the quote and backslash, so a quoted name reads back unambiguously.
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\udc80-\udcff\"\\\\]")
_ESCAPES = {"\a": "\\a", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\v": "\\v", "\f": "\\f",
            "\r": "\\r", '"': '\\"', "\\": "\\\\"}


def _escape(match: re.Match) -> str:
    ch = match.group()
    if ch in _ESCAPES:
        return _ESCAPES[ch]
    return "".join(f"\\{b:03o}" for b in ch.encode("utf-8", "surrogateescape"))


def escape(text: str) -> str:
    """``text`` (a sentence that cites names) with each terminal control
    escaped in place, no quotes added: for error messages."""
    return _UNSAFE.sub(lambda m: m.group() if m.group() in '"\\' else _escape(m), text)


def quote(text: object) -> str:
    """``text`` safe to print on a terminal: unchanged when it holds
    nothing a terminal would interpret, else in double quotes with C
    escapes (``"evil\\033[2K\\r  M x"``), as git quotes a path.  A name or
    value from a file, an agent or a hook goes through this before it is
    printed, so it can only ever show as itself."""
    text = "" if text is None else str(text)
    if not _UNSAFE.search(text):
        return text
    return '"' + _UNSAFE.sub(_escape, text) + '"'


def _file_line(f: dict) -> str:
    op = f["op"]
    if op == "renamed":
        op_text = f"renamed   {quote(f['from'])} -> {quote(f['path'])}"
    else:
        op_text = f"{op:<9} {quote(f['path'])}"
    if f.get("binary"):
        detail = f"binary {f['bytes_before']} -> {f['bytes_after']} bytes"
    elif f.get("binary") is None and "bytes_before" in f:
        detail = f"too large to count lines, {f['bytes_before']} -> {f['bytes_after']} bytes"
    elif "lines_added" in f:
        detail = f"+{f['lines_added']} -{f['lines_removed']}"
    else:
        detail = f["kind"] or ""
    if f["kind"] == "symlink":
        target = (f["after"] if f["after"]["kind"] else f["before"]).get("target", "")
        detail = f"symlink -> {quote(target)}"
    b, a = f["before"], f["after"]
    if b["kind"] == a["kind"] and b["mode"] is not None and a["mode"] is not None and b["mode"] != a["mode"]:
        detail += f"  mode {b['mode']:o} -> {a['mode']:o}"
    return f"  {op_text}  {detail}"


def folded_text(fold: dict) -> str:
    """A folded ``.git`` directory as one line: ``.git/  +59 ~2 -1 files``."""
    counts = [f"{sign}{fold[key]}" for sign, key in (("+", "added"), ("~", "modified"), ("-", "deleted"),
                                                        (">", "renamed")) if fold[key]]
    return f"{fold['path']}  {' '.join(counts)} files"


def card_text(card: dict) -> str:
    """A change card (``store.cards.card``) as ``stepfs show`` prints it:
    renames, symlink targets and mode changes included, each folded ``.git``
    directory as one line."""
    from stepfs.store.units import human

    lines = [
        f"layer {card['number']} ({card['kind']})  {card['time']}",
        f"message: {quote(card['message'])}" if card["message"] else "message: (none)",
    ]
    if card["mount"] or card["agent"]:
        lines.append(f"mount: {quote(card['mount']) or '-'}" + (f"  agent: {quote(card['agent'])}" if card["agent"] else ""))
    for key, value in sorted(card["meta"].items()):
        lines.append(f"meta: {quote(key)}={quote(value)}")
    renamed = f" >{card['renamed']}" if card["renamed"] else ""
    # What the layer added to the store (store/du.py); absent on a dry run's card.
    stored = f"   stored: +{human(card['stored_bytes'])}" if "stored_bytes" in card else ""
    lines.append(f"files: +{card['added']} ~{card['modified']} -{card['deleted']}{renamed}   "
                 f"lines: +{card['lines_added']} -{card['lines_removed']}{stored}")
    lines += [_file_line(f) for f in card["files"]]
    lines += ["  " + folded_text(f) for f in card.get("folded", [])]
    return "\n".join(lines)
