"""A history's connection opened in a thread while the caller does its
local work (opening the workspace), so a step does not wait for the two
one after the other: a new PostgreSQL session (the server forks a
backend, which then loads its catalog) costs about as much as opening a
workspace.

The URL is a guess made before the workspace is open (``attachment.peek``);
:meth:`Connecting.remote` hands the connection over only for the URL the
caller settles on, and otherwise opens the right one.  A connection
nobody takes is closed by its thread; the caller never waits for it.
"""

from __future__ import annotations

import threading

from stepfs.store.shared.remote import Remote
from stepfs.store.shared.url import HistoryURL


class Connecting:
    def __init__(self, url: HistoryURL | None):
        self.url = url
        self._lock = threading.Lock()
        self._remote: Remote | None = None
        self._error: BaseException | None = None
        self._dropped = False
        self._thread: threading.Thread | None = None
        if url is not None:
            self._thread = threading.Thread(target=self._open, name="stepfs-history-connect", daemon=True)
            self._thread.start()

    def _open(self) -> None:
        try:
            remote = Remote.open(self.url)
        except BaseException as exc:  # handed to the caller by remote()
            with self._lock:
                self._error = exc
            return
        with self._lock:
            if not self._dropped:
                self._remote = remote
                return
        remote.close()

    def remote(self, url: HistoryURL) -> Remote:
        """The open history of ``url``: the one this thread opened if it is
        the same history, else a new one."""
        if self._thread is None or url != self.url:
            self.drop()
            return Remote.open(url)
        self._thread.join()
        self._thread = None
        if self._error is not None:
            raise self._error
        remote, self._remote = self._remote, None
        return remote

    def drop(self) -> None:
        """Not wanted: closed now if open, else by its thread when it is."""
        with self._lock:
            self._dropped = True
            remote, self._remote = self._remote, None
        if remote is not None:
            remote.close()

    def __enter__(self) -> "Connecting":
        return self

    def __exit__(self, *exc) -> None:
        self.drop()
