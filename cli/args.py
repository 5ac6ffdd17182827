"""Argument checks shared by the CLI's commands (a usage error exits with
``exitcodes.USAGE`` before anything is touched)."""

from __future__ import annotations

import sys

from stepfs.cli import exitcodes


def usage_error(message: str) -> None:
    print(f"stepfs: usage: {message}", file=sys.stderr)
    raise SystemExit(exitcodes.USAGE)


def parse_meta(items: list[str]) -> dict:
    meta = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            usage_error(f"--meta takes KEY=VALUE, got {item!r}")
        meta[key] = value
    return meta
