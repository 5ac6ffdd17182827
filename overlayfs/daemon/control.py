"""The daemon's side of the control channel (no FUSE import).

A daemon listens on an abstract Unix socket named after its mountpoint
(``protocol.address``): a dead daemon leaves nothing to clean up.  Only
peers with the daemon's uid (or root) are answered; the client side is
``client/control.py``.

Protocol: the client sends one JSON object and a newline; the server answers
with one JSON object and a newline and closes.  Requests: ``{"op": "ping"}``,
``{"op": "commit", "message", "meta", "allow_empty", "overwrite"}``,
``{"op": "invalidate", "paths": ["/a/b", ...]}`` (the workspace changed under
the mount: the view forgets its copies of those paths and the kernel its
cached attributes and pages; answered once done, so a caller that got the
answer knows the mount shows the new state), ``{"op": "sync"}`` (write the
staged rows the view recorded but has not written yet, see ``view.py``;
answered once they are in the store), ``{"op": "run", "pid", "command",
"confinement"}`` (a command ``stepfs run`` / ``confine`` started in the
mount, and whether it is confined: ``runs.py``).
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

from stepfs.store import errors as store_errors

from stepfs.overlayfs.daemon.protocol import address, recv_line, send

log = logging.getLogger("stepfs.control")


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
            send(conn, {"ok": False, "error": "PermissionError", "message": "only the mount's owner may control it."})
            return
        request = json.loads(recv_line(conn))
        sent = False

        def reply(fields: dict) -> None:
            nonlocal sent
            if not sent:
                sent = True
                try:
                    send(conn, {"ok": True, **fields})
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
        send(conn, answer)
