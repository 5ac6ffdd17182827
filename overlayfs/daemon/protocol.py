"""What a client and a mount daemon agree on: the only daemon module the
client imports (no database, no FUSE, no threads).

* Where a daemon is found: an abstract Unix socket named after its
  mountpoint (``\\0stepfs:<mount key>``; abstract names have no path-length
  limit and vanish with the process), and its files in
  ``WORKSPACE/.stepfs/run/``: its lock (held by the live daemon, holding its
  pid) and its log.  Light on purpose: the CLI asks "is this mount's daemon
  alive?" before anything else.
* How they talk: one JSON object and a newline each way (the requests and
  answers are listed in ``daemon/control.py``, the server).
* What the client passes on the daemon's command line: the ``--auto-step``
  policy (:func:`parse_auto_step`), checked by the client before it spawns.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import socket
import time


def mount_key(mountpoint: str) -> str:
    """A short stable name for files and sockets belonging to a mountpoint."""
    return hashlib.sha256(os.path.normpath(os.path.abspath(mountpoint)).encode()).hexdigest()[:16]


def address(mountpoint: str) -> str:
    return "\0stepfs:" + mount_key(mountpoint)


def recv_line(conn: socket.socket) -> str:
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            break
        buf += chunk
    return buf.decode()


def send(conn: socket.socket, obj: dict) -> None:
    conn.sendall(json.dumps(obj).encode() + b"\n")


def parse_auto_step(policy: str) -> float | None:
    """``manual`` -> None, ``close`` -> 0.0, ``idle:S`` -> S seconds; ValueError otherwise."""
    if policy == "manual":
        return None
    if policy == "close":
        return 0.0
    if policy.startswith("idle:"):
        seconds = float(policy[5:])
        if seconds > 0:
            return seconds
    raise ValueError(f"--auto-step takes manual, close or idle:SECONDS, not {policy!r}")


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


#: ``PF_EXITING`` in the flags of ``/proc/<pid>/stat`` (field 9): the
#: process is in ``exit``, closing its descriptors.
_PF_EXITING = 0x4
#: How long a dying daemon is given to release its lock.
DYING_WAIT = 5.0


def _exiting(pid: int) -> bool:
    """The process ``pid`` is dying (in exit, or a zombie) or gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return True
    fields = data[data.rfind(b")") + 2:].split()
    return fields[0] == b"Z" or bool(int(fields[6]) & _PF_EXITING)


def daemon_alive_settled(run_dir: str, mountpoint: str) -> int | None:
    """:func:`daemon_alive`, except that a daemon caught while dying (its
    clients already see ENOTCONN: the kernel closed its ``/dev/fuse``
    descriptor, but not yet its lock file) is waited for, at most
    :data:`DYING_WAIT` seconds, rather than taken for alive.  A live
    daemon is answered at once."""
    pid = daemon_alive(run_dir, mountpoint)
    deadline = time.monotonic() + DYING_WAIT
    while pid is not None and pid > 0 and _exiting(pid) and time.monotonic() < deadline:
        time.sleep(0.01)
        pid = daemon_alive(run_dir, mountpoint)
    return pid
