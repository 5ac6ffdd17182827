"""The control channel between the CLI and a mount daemon (no FUSE import).

A daemon listens on an abstract Unix socket named after its mountpoint
(``\\0stepfs:<mount key>``): abstract names have no path-length limit and
vanish with the process, so a dead daemon leaves nothing to clean up.  Only
peers with the daemon's uid (or root) are answered.

Protocol: the client sends one JSON object and a newline; the server answers
with one JSON object and a newline and closes.  Requests: ``{"op": "ping"}``,
``{"op": "commit", "message", "meta", "allow_empty", "overwrite"}``,
``{"op": "invalidate", "paths": ["/a/b", ...]}`` (the workspace changed under
the mount: the view forgets its copies of those paths and the kernel its
cached attributes and pages; answered once done, so a caller that got the
answer knows the mount shows the new state), ``{"op": "sync"}`` (write the
staged rows the view recorded but has not written yet, see ``view.py``;
answered once they are in the store).
Answers: ``{"ok": true, ...}`` or ``{"ok": false, "error": <class name>,
"message": <sentence>, "paths": [...]}``.

The handler is called as ``handler(request, reply)`` and returns the
answer's fields, or None after it called ``reply(fields)`` itself: a
commit answers as soon as its layer is published (``store.publish``:
intent durable, renames done), and the daemon's own bookkeeping and the
layer's completion after that are no longer part of the caller's wait (an
error raised after the answer went out is logged, not sent; the daemon
turns its mount read-only for it, so the next request reports it).

Threading: the server runs in one daemon thread and handles one request at a
time; each request takes the view's lock through the view's own methods.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
import threading
from typing import Callable

from store import errors as store_errors

from .mounts import mount_key

log = logging.getLogger("stepfs.control")


def address(mountpoint: str) -> str:
    return "\0stepfs:" + mount_key(mountpoint)


class ControlServer:
    def __init__(self, mountpoint: str, handler: Callable[[dict, Callable[[dict], None]], dict | None]):
        self.handler = handler
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self.sock.bind(address(mountpoint))
        self.sock.listen(8)
        self.thread = threading.Thread(target=self._serve, name="stepfs-control", daemon=True)
        self._stopped = False

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stopped = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()

    def _serve(self) -> None:
        while not self._stopped:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                try:
                    self._handle(conn)
                except Exception:  # one bad request must not end the server
                    log.exception("control request failed")

    def _handle(self, conn: socket.socket) -> None:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _pid, uid, _gid = struct.unpack("3i", creds)
        if uid not in (0, os.geteuid()):
            _send(conn, {"ok": False, "error": "PermissionError", "message": "only the mount's owner may control it."})
            return
        request = json.loads(_recv_line(conn))
        sent = False

        def reply(fields: dict) -> None:
            nonlocal sent
            if not sent:
                sent = True
                try:
                    _send(conn, {"ok": True, **fields})
                except OSError as exc:  # the caller went away: the work is done all the same
                    log.warning("could not answer control op %s: %s", request.get("op"), exc)

        try:
            fields = self.handler(request, reply)
            answer = {"ok": True, **(fields or {})}
        except store_errors.StepfsError as exc:
            answer = {"ok": False, "error": type(exc).__name__, "message": str(exc),
                      "paths": getattr(exc, "paths", [])}
        except Exception as exc:
            log.exception("control op %s failed", request.get("op"))
            answer = {"ok": False, "error": "DaemonError",
                      "message": f"the mount daemon failed: {type(exc).__name__}: {exc}; see its log in .stepfs/run/."}
        if sent:
            if not answer["ok"]:
                log.error("control op %s failed after its answer was sent: %s", request.get("op"), answer["message"])
            return
        _send(conn, answer)


def _recv_line(conn: socket.socket) -> str:
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            break
        buf += chunk
    return buf.decode()


def _send(conn: socket.socket, obj: dict) -> None:
    conn.sendall(json.dumps(obj).encode() + b"\n")


def request(mountpoint: str, payload: dict, timeout: float = 600.0) -> dict:
    """Send one request to the daemon of ``mountpoint``; raises
    :class:`store.errors.DaemonError` if nobody answers, and re-raises the
    daemon's domain error by class name."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    sock.settimeout(timeout)
    try:
        try:
            sock.connect(address(mountpoint))
        except OSError:
            raise store_errors.DaemonError(
                f"the stepfs daemon of {mountpoint} does not answer; is it mounted? ('stepfs status' lists mounts)"
            ) from None
        _send(sock, payload)
        line = _recv_line(sock)
    except socket.timeout:
        raise store_errors.DaemonError(f"the stepfs daemon of {mountpoint} did not answer within {timeout:.0f} s.") from None
    except (OSError, UnicodeDecodeError) as exc:
        # A daemon that died or dropped us mid-answer (ECONNRESET, EPIPE):
        # whether the request took effect is for 'stepfs log' to tell.
        raise store_errors.DaemonError(
            f"the stepfs daemon of {mountpoint} broke the connection before answering ({exc}); "
            f"see 'stepfs log' for whether the request took effect and 'stepfs status' for the mount."
        ) from None
    finally:
        sock.close()
    if not line:
        raise store_errors.DaemonError(f"the stepfs daemon of {mountpoint} closed the connection without an answer.")
    try:
        answer = json.loads(line)
    except ValueError:
        raise store_errors.DaemonError(f"the stepfs daemon of {mountpoint} sent an answer that is not JSON; "
                                       f"see its log under the workspace's .stepfs/run/.") from None
    if not isinstance(answer, dict):
        raise store_errors.DaemonError(f"the stepfs daemon of {mountpoint} sent an answer that is not an object.")
    if answer.get("ok"):
        return answer
    cls = getattr(store_errors, answer.get("error", ""), None)
    if isinstance(cls, type) and issubclass(cls, store_errors.StepfsError):
        if cls is store_errors.CommitConflict:
            raise cls(answer["message"], answer.get("paths", []))
        raise cls(answer["message"])
    raise store_errors.DaemonError(answer.get("message", "the daemon refused the request."))
