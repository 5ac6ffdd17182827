"""The system mount table as seen by stepfs (no FUSE import).

A stepfs mount appears in ``/proc/self/mounts`` with type ``fuse.stepfs`` and
fsname ``stepfs:<absolute workspace path>``; that is how a mountpoint given to
the CLI is traced back to its workspace without asking the daemon.
"""

from __future__ import annotations

import os
import re
from collections import namedtuple

FSTYPE = "fuse.stepfs"
FSNAME_PREFIX = "stepfs:"


class MountEntry(namedtuple("MountEntry", "source mountpoint fstype")):
    # A named tuple rather than a dataclass: dataclasses pulls in inspect,
    # a real share of a `stepfs step` start-up.
    __slots__ = ()

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



def _device(mountpoint: str) -> str | None:
    """The ``major:minor`` of the mount at ``mountpoint`` in our namespace (mountinfo; no stat)."""
    found = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            parts = line.split()
            if len(parts) > 4 and _unescape(parts[4]) == mountpoint:
                found = parts[2]  # the last one is on top
    return found


def holders_elsewhere(mountpoint: str) -> list[int]:
    """Processes of *other* mount namespaces that still have the mount at
    ``mountpoint`` (``stepfs run`` gives its command a namespace of its own
    for the binds of unversioned trees, and a background process it left
    keeps its copy of the mount, and so the daemon, alive after the mount
    is gone here).  Empty when none, or when ``/proc`` cannot tell."""
    device = _device(os.path.normpath(os.path.abspath(mountpoint)))
    if device is None:
        return []
    try:
        own = os.stat("/proc/self/ns/mnt").st_ino
    except OSError:
        return []
    verdict: dict[int, bool] = {}  # namespace inode -> has the mount
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            ns = os.stat(f"/proc/{name}/ns/mnt").st_ino
            if ns == own:
                continue
            if ns not in verdict:
                with open(f"/proc/{name}/mountinfo") as f:
                    verdict[ns] = any(line.split(maxsplit=3)[2] == device for line in f)
        except (OSError, IndexError):
            continue  # gone meanwhile, or not ours to read
        if verdict[ns]:
            out.append(int(name))
    return sorted(out)
