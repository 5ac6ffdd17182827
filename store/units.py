"""Byte counts as people read them (``12.3 MiB``): kept apart from
:mod:`store.du` (which imports SQLAlchemy) so the CLI can print a log or a
card answered by a mount's daemon without loading the database layer."""

from __future__ import annotations


def human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
