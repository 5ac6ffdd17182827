"""The timeline's small chart: lines changed (bars) and new content (a
line) per layer of the page, oldest on the left (presentation only; the
template draws the shapes as inline SVG, so no script is needed)."""

from __future__ import annotations

from dataclasses import dataclass

WIDTH, HEIGHT, PAD = 600, 90, 4


@dataclass
class Bar:
    number: int
    x: float
    y: float
    w: float
    h: float
    title: str


@dataclass
class Chart:
    bars: list[Bar]
    points: str  # the polyline of new content
    max_lines: int
    max_bytes: int
    width: int = WIDTH
    height: int = HEIGHT


def build(rows: list[dict]) -> Chart | None:
    """The chart of timeline rows (newest first, as the page lists them)."""
    if not rows:
        return None
    rows = list(reversed(rows))
    lines = [(r["lines_added"] or 0) + (r["lines_removed"] or 0) for r in rows]
    sizes = [r.get("new_bytes") or 0 for r in rows]
    top_l, top_b = max(lines) or 1, max(sizes) or 1
    step = (WIDTH - 2 * PAD) / len(rows)
    usable = HEIGHT - 2 * PAD
    bars, points = [], []
    for i, (r, n, b) in enumerate(zip(rows, lines, sizes)):
        h = usable * n / top_l
        x = PAD + i * step
        counted = "lines not counted" if r["lines_added"] is None else f"+{r['lines_added']} -{r['lines_removed']} lines"
        bars.append(Bar(r["number"], round(x + step * 0.1, 1), round(HEIGHT - PAD - h, 1), round(step * 0.8, 1),
                        round(h, 1), f"layer {r['number']}: {counted}, {b} bytes of new content"))
        points.append(f"{round(x + step / 2, 1)},{round(HEIGHT - PAD - usable * b / top_b, 1)}")
    return Chart(bars, " ".join(points), max(lines), max(sizes))
