"""What a workspace records about the shared history it is attached to:
``WORKSPACE/.stepfs/history.json`` (mode 0600: the URL may hold a password).

``{"url": URL, "workspace": ID, "base": B, "at": A}``: ``ID`` names this
workspace in the shared history (a random hex id, given once); local
layers numbered ``B`` or lower were made before the attachment and are
never published; ``A`` is the shared layer the workspace held when it was
attached (0) or cloned.  Everything else about its position is derived
from the layers themselves (``sync.position``), so there is no second
record to keep in step with the store.  Written once, atomically (a
temporary file fsynced and renamed, then the directory fsynced).
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass

from stepfs.store.errors import HistoryError
from stepfs.store.paths import STORE_DIR
from stepfs.store.shared.url import HistoryURL, parse

FILE = "history.json"


@dataclass(frozen=True)
class Attachment:
    url: HistoryURL
    workspace: str
    base: int
    at: int


def attached(ws_path: str) -> bool:
    """Cheap (one stat): whether the workspace at ``ws_path`` is attached."""
    return os.path.exists(os.path.join(ws_path, STORE_DIR, FILE))


def read(ws) -> Attachment | None:
    """The attachment of opened workspace ``ws``, or None."""
    try:
        fd = os.open(os.path.join(ws.store_dir, FILE), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as f:
        raw = f.read()
    try:
        d = json.loads(raw)
        return Attachment(parse(d["url"]), str(d["workspace"]), int(d["base"]), int(d["at"]))
    except (ValueError, KeyError, TypeError):
        raise HistoryError(f"{os.path.join(ws.store_path, FILE)} is damaged; move it away to detach the workspace "
                           f"from its shared history, then clone the history anew.") from None


def peek(ws_path: str) -> HistoryURL | None:
    """The URL the workspace at ``ws_path`` is attached to, read before the
    workspace is opened (to start connecting meanwhile), or None if it
    cannot be read: a hint only, never trusted in place of :func:`read`.
    Neither ``.stepfs`` nor the file is followed through a symlink."""
    try:
        dfd = os.open(os.path.join(ws_path, STORE_DIR), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            fd = os.open(FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
        finally:
            os.close(dfd)
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            return parse(json.loads(f.read(1 << 16))["url"])
    except (OSError, ValueError, KeyError, TypeError, HistoryError):
        return None


def write(ws, att: Attachment) -> None:
    data = json.dumps({"url": att.url.text, "workspace": att.workspace, "base": att.base, "at": att.at},
                      sort_keys=True).encode()
    tmp = os.path.join(ws.store_dir, FILE + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, os.path.join(ws.store_dir, FILE))
    dfd = os.open(ws.store_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
