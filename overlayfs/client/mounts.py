"""The system mount table as seen by stepfs (no FUSE import).

A stepfs mount appears in ``/proc/self/mounts`` with type ``fuse.stepfs`` and
fsname ``stepfs:<absolute workspace path>``; that is how a mountpoint given to
the CLI is traced back to its workspace without asking the daemon.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

FSTYPE = "fuse.stepfs"
FSNAME_PREFIX = "stepfs:"


@dataclass(frozen=True)
class MountEntry:
    source: str
    mountpoint: str
    fstype: str

    @property
    def workspace(self) -> str | None:
        if self.fstype == FSTYPE and self.source.startswith(FSNAME_PREFIX):
            return self.source[len(FSNAME_PREFIX):]
        return None


def _unescape(field: str) -> str:
    # /proc/mounts escapes space, tab, newline and backslash as \ooo.
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def table() -> list[MountEntry]:
    out = []
    with open("/proc/self/mounts", "rb") as f:
        for raw in f:
            parts = os.fsdecode(raw).split()
            if len(parts) >= 3:
                out.append(MountEntry(_unescape(parts[0]), _unescape(parts[1]), parts[2]))
    return out


def find(mountpoint: str) -> MountEntry | None:
    """The mount whose mountpoint is exactly ``mountpoint`` (absolute, no stat)."""
    target = os.path.normpath(os.path.abspath(mountpoint))
    found = None
    for entry in table():
        if entry.mountpoint == target:
            found = entry  # the last one is on top
    return found


def stepfs_mounts(workspace: str | None = None) -> list[MountEntry]:
    return [m for m in table() if m.workspace is not None and (workspace is None or m.workspace == workspace)]


def containing(path: str) -> MountEntry | None:
    """The stepfs mount that ``path`` lies in, if any (longest prefix)."""
    p = os.path.normpath(os.path.abspath(path))
    best = None
    for m in stepfs_mounts():
        if p == m.mountpoint or p.startswith(m.mountpoint.rstrip("/") + "/"):
            if best is None or len(m.mountpoint) > len(best.mountpoint):
                best = m
    return best

