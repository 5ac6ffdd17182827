"""Human text for results that several commands print (output only)."""

from __future__ import annotations


def card_text(card: dict) -> str:
    """A change card (``store.cards.card``) as ``stepfs show`` prints it."""
    lines = [
        f"layer {card['number']} ({card['kind']})  {card['time']}",
        f"message: {card['message']}" if card["message"] else "message: (none)",
    ]
    if card["mount"]:
        lines.append(f"mount: {card['mount']}" + (f"  agent: {card['agent']}" if card["agent"] else ""))
    for key, value in sorted(card["meta"].items()):
        lines.append(f"meta: {key}={value}")
    lines.append(f"files: +{card['added']} ~{card['modified']} -{card['deleted']}   "
                 f"lines: +{card['lines_added']} -{card['lines_removed']}")
    for f in card["files"]:
        if f.get("binary"):
            detail = f"binary {f['bytes_before']} -> {f['bytes_after']} bytes"
        elif "lines_added" in f:
            detail = f"+{f['lines_added']} -{f['lines_removed']}"
        else:
            detail = f["kind"] or ""
        lines.append(f"  {f['op']:<9} {f['path']}  {detail}")
    return "\n".join(lines)
