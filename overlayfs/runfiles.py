"""A mount daemon's files in ``WORKSPACE/.stepfs/run/``: its lock (held by
the live daemon, holding its pid) and its log.

Light on purpose (no database, no FUSE): the CLI asks "is this mount's
daemon alive?" before anything else.
"""

from __future__ import annotations

import fcntl
import os

from .mounts import mount_key


def log_path(ws_path: str, mountpoint: str) -> str:
    return os.path.join(ws_path, ".stepfs", "run", mount_key(mountpoint) + ".log")


def daemon_alive(run_dir: str, mountpoint: str) -> int | None:
    """The pid of the live daemon of ``mountpoint``, or None.  A lock we can
    take means no daemon holds it; a held lock without a readable pid gives -1."""
    path = os.path.join(run_dir, mount_key(mountpoint) + ".lock")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            data = os.pread(fd, 32, 0).strip()
            return int(data) if data.isdigit() else -1
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)
