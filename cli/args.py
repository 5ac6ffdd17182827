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


def add_exclude_args(p) -> None:
    """``--exclude PATTERN`` and ``--no-default-excludes`` (mount and run)."""
    p.add_argument("--exclude", action="append", default=[], metavar="PATTERN",
                   help="an unversioned path (gitignore syntax; repeatable): never staged, its writes go to the "
                        "workspace directly")
    p.add_argument("--no-default-excludes", action="store_true",
                   help="version node_modules/, .venv/, __pycache__/ and the other default unversioned trees too")
