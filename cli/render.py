"""Human text for results that several commands print (output only): the
one renderer of a change card, used by ``show``, ``run`` and ``rollback``."""

from __future__ import annotations


def _file_line(f: dict) -> str:
    op = f["op"]
    if op == "renamed":
        op_text = f"renamed   {f['from']} -> {f['path']}"
    else:
        op_text = f"{op:<9} {f['path']}"
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
        detail = f"symlink -> {target}"
    b, a = f["before"], f["after"]
    if b["kind"] == a["kind"] and b["mode"] is not None and a["mode"] is not None and b["mode"] != a["mode"]:
        detail += f"  mode {b['mode']:o} -> {a['mode']:o}"
    return f"  {op_text}  {detail}"


def card_text(card: dict) -> str:
    """A change card (``store.cards.card``) as ``stepfs show`` prints it:
    renames, symlink targets and mode changes included."""
    from stepfs.store.du import human

    lines = [
        f"layer {card['number']} ({card['kind']})  {card['time']}",
        f"message: {card['message']}" if card["message"] else "message: (none)",
    ]
    if card["mount"] or card["agent"]:
        lines.append(f"mount: {card['mount'] or '-'}" + (f"  agent: {card['agent']}" if card["agent"] else ""))
    for key, value in sorted(card["meta"].items()):
        lines.append(f"meta: {key}={value}")
    renamed = f" >{card['renamed']}" if card["renamed"] else ""
    # What the layer added to the store (store/du.py); absent on a dry run's card.
    stored = f"   stored: +{human(card['stored_bytes'])}" if "stored_bytes" in card else ""
    lines.append(f"files: +{card['added']} ~{card['modified']} -{card['deleted']}{renamed}   "
                 f"lines: +{card['lines_added']} -{card['lines_removed']}{stored}")
    lines += [_file_line(f) for f in card["files"]]
    return "\n".join(lines)
