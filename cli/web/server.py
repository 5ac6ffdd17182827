"""Running the web app: a socket bound before anything is printed, uvicorn
serving it, and a clean stop (presentation side).

The socket is bound here (not by uvicorn) so the URL printed and the port a
test connects to are the port actually bound, ``--port 0`` included.  A
:class:`Server` runs in the calling thread (:meth:`run`, the CLI: uvicorn
handles Ctrl-C) or in a thread of its own (:meth:`start` / :meth:`stop`,
the tests).  Stopping ends the live event streams first, so uvicorn's
graceful shutdown does not wait on them.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from typing import Callable

import uvicorn

from stepfs.store.errors import InputError

STOP_TIMEOUT = 10.0


def is_local(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind(host: str, port: int) -> socket.socket:
    """A listening socket at ``host:port`` (0: any free port), or InputError."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise InputError(f"cannot resolve --host {host} ({exc.strerror}); give an address such as 127.0.0.1.") from None
    family, _type, _proto, _name, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as exc:
        sock.close()
        raise InputError(f"cannot listen on {host}:{port} ({exc.strerror}); choose another port with --port "
                         f"(0 picks a free one).") from None
    sock.listen(64)
    sock.set_inheritable(True)
    return sock


class _Uvicorn(uvicorn.Server):
    """uvicorn's server, calling ``on_ready`` once it serves: from then on
    its own Ctrl-C handler is in place, so a signal sent by a client that
    waited for the announcement stops it cleanly (before, a process started
    with SIGINT ignored, as a script's background job is, ignored it and
    never stopped)."""

    on_ready: Callable[[], None] | None = None

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        if self.started and self.on_ready is not None:
            self.on_ready()


class Server:
    """``app`` served on ``host:port``; :attr:`port` is the bound port."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0):
        self.app = app
        self.host = host
        self.sock = bind(host, port)
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2, lifespan="on",
                                access_log=False)
        self.server = _Uvicorn(config)
        self.thread: threading.Thread | None = None

    def url(self, token: str) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/?token={token}"

    def run(self, on_ready: Callable[[], None] | None = None) -> None:
        """Serve in this thread; ``on_ready()`` once requests and Ctrl-C are
        handled (the CLI prints its announcement there)."""
        self.server.on_ready = on_ready
        try:
            self.server.run(sockets=[self.sock])
        finally:
            self.sock.close()

    def start(self) -> None:
        """Serve in a thread; returns once the server accepts requests."""
        self.thread = threading.Thread(target=self.run, name="stepfs-serve", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + STOP_TIMEOUT
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the web server did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        site = getattr(self.app.state, "site", None)
        if site is not None:
            site.stopping.set()
        self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(STOP_TIMEOUT)
