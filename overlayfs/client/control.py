"""The client's side of the control channel: one request to a mount daemon,
its answer, and the daemon's domain error re-raised here (the framing and
the daemon's address are in ``daemon/protocol.py``; the requests in
``daemon/control.py``)."""

from __future__ import annotations

import json
import socket

from stepfs.overlayfs.daemon.protocol import address, recv_line, send
from stepfs.store import errors as store_errors


def request(mountpoint: str, payload: dict, timeout: float = 600.0) -> dict:
    """Send one request to the daemon of ``mountpoint``; raises
    :class:`stepfs.store.errors.DaemonError` if nobody answers, and re-raises the
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
        send(sock, payload)
        line = recv_line(sock)
    except socket.timeout:
        raise store_errors.DaemonError(f"the stepfs daemon of {mountpoint} did not answer within {timeout:.0f} s.") from None
    finally:
        sock.close()
    if not line:
        raise store_errors.DaemonError(f"the stepfs daemon of {mountpoint} closed the connection without an answer.")
    answer = json.loads(line)
    if answer.get("ok"):
        return answer
    cls = getattr(store_errors, answer.get("error", ""), None)
    if isinstance(cls, type) and issubclass(cls, store_errors.StepfsError):
        if cls is store_errors.CommitConflict:
            raise cls(answer["message"], answer.get("paths", []))
        raise cls(answer["message"])
    raise store_errors.DaemonError(answer.get("message", "the daemon refused the request."))
