"""Who holds a store's write locks, read from ``/proc/locks``.

Only for messages: when a write gave up waiting for SQLite's write lock,
the user is told which process to wait for instead of SQLite's bare
"database is locked".  Two locks count: ``commit.lock`` (an ``flock`` every
commit, prune, gc and sync takes) and SQLite's WAL write and checkpoint
locks, bytes 120 and 121 of the ``-shm`` file (SQLite's unix VFS).
Best effort: a kernel that hides other pids, or a holder in another pid
namespace, gives an empty answer.
"""

from __future__ import annotations

import os

#: First and last byte of the -shm file's write and checkpoint locks.
_SHM_WRITE_LOCKS = (120, 121)


def _file_ids(path: str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return os.major(st.st_dev), os.minor(st.st_dev), st.st_ino


def _parse(line: str) -> tuple[str, int, tuple[int, int, int], int, str] | None:
    """(type, pid, (major, minor, inode), start, end) of one held lock; None
    for a waiter (``->``) or a line of another shape."""
    fields = line.split()
    if len(fields) < 8 or "->" in fields:
        return None
    try:
        kind, pid, dev_ino, start, end = fields[3], int(fields[4]), fields[5], int(fields[6]), fields[7]
        major, minor, inode = dev_ino.split(":")
        ids = (int(major, 16), int(minor, 16), int(inode))
    except ValueError:
        return None
    return kind, pid, ids, start, end


def write_holders(db_path: str, lock_path: str) -> list[int]:
    """Pids (not this process) holding the commit lock or SQLite's write or
    checkpoint lock on the store at ``db_path``."""
    lock_ids = _file_ids(lock_path)
    shm_ids = _file_ids(db_path + "-shm")
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    found: list[int] = []
    for line in lines:
        held = _parse(line)
        if held is None:
            continue
        kind, pid, ids, start, _end = held
        if kind != "WRITE" or pid <= 0 or pid == os.getpid() or pid in found:
            continue
        if ids == lock_ids or (ids == shm_ids and _SHM_WRITE_LOCKS[0] <= start <= _SHM_WRITE_LOCKS[1]):
            found.append(pid)
    return found


def describe(pid: int) -> str:
    """``pid 123 (stepfs gc /ws)``: the pid and what it runs, as far as
    /proc tells."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode("utf-8", "replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return f"pid {pid}"
    if len(argv) > 1 and os.path.basename(argv[0]).startswith("python") and argv[1:2] != ["-c"]:
        argv = argv[1:]  # `python -m stepfs.cli …` reads better without the interpreter
    text = " ".join(argv)
    if len(text) > 80:
        text = text[:77] + "..."
    return f"pid {pid} ({text})" if text else f"pid {pid}"
