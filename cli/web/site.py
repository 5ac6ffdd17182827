"""What every page of ``stepfs serve`` shares: the open workspace, the
templates, the error table and small helpers (presentation side).

The workspace is opened once, for reading; each request takes its own read
transaction (``ws.db.read()``), so one page sees one consistent store.  All
writing goes through ``manage.rollback``, which opens the workspace itself,
as the CLI does.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from urllib.parse import urlencode

from markupsafe import Markup
from starlette.requests import Request
from starlette.responses import HTMLResponse
from starlette.templating import Jinja2Templates

from stepfs.overlayfs.client import manage
from stepfs.store import errors, history
from stepfs.store.workspace import Workspace

from stepfs.cli.web.security import csrf_token
from stepfs.store.units import human

HERE = Path(__file__).resolve().parent

#: Error class -> HTTP status, most specific first (as ``cli/exitcodes.py``).
STATUS: list[tuple[type, int]] = [
    (errors.ContainmentError, 403),
    (errors.NoSuchLayer, 404),
    (errors.NoSuchPath, 404),
    (errors.HeadMoved, 409),
    (errors.CommitConflict, 409),
    (errors.NothingToCommit, 409),
    (errors.StepfsError, 400),
]


def status_for(exc: BaseException) -> int:
    for cls, code in STATUS:
        if isinstance(exc, cls):
            return code
    return 500


def url(where: str, /, **params) -> str:
    """``where`` with a query string; None values are left out, list values
    repeat the key.  Names that are not UTF-8 keep their bytes."""
    items = []
    for key, value in params.items():
        if value is None:
            continue
        for v in value if isinstance(value, (list, tuple)) else [value]:
            items.append((key, str(v)))
    return where + ("?" + urlencode(items, errors="surrogateescape") if items else "")


def human_bytes(n: int | None) -> str:
    """``store.units.human``, with "-" for a size the page does not know."""
    return "-" if n is None else human(n)


def when(ns: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ns / 1e9))


class Site:
    """One served workspace."""

    def __init__(self, workspace: str, token: str, read_only: bool = False):
        self.ws = Workspace.open(workspace)
        self.target = manage.Target(self.ws.path)
        self.token = token
        self.csrf = csrf_token(token)
        self.read_only = read_only
        self.stopping = threading.Event()  # set when the server shuts down: live streams end
        self.templates = Jinja2Templates(directory=str(HERE / "templates"))
        env = self.templates.env
        env.globals.update(url=url, human_bytes=human_bytes, when=when, read_only=read_only, csrf=self.csrf,
                           workspace=self.ws.path)
        env.filters["oct"] = lambda m: "-" if m is None else f"{m:o}"
        env.filters["metavalue"] = lambda v: v if isinstance(v, str) else json.dumps(v)

    def close(self) -> None:
        self.stopping.set()
        self.ws.close()

    def page(self, request: Request, name: str, status_code: int = 200, **context) -> HTMLResponse:
        context["nonce"] = Markup(request.scope.get("stepfs.nonce", ""))
        return self.templates.TemplateResponse(request, name, context, status_code=status_code)

    def error(self, request: Request, exc: BaseException) -> HTMLResponse:
        return self.page(request, "error.html", status_code=status_for(exc), message=str(exc))

    def user_path(self, text: str | None, allow_root: bool = False) -> bytes:
        """A path from a request, through the CLI's containment check."""
        if text is None or text == "":
            if allow_root:
                return b"."
            raise errors.InputError("this page needs a path= parameter naming a file in the workspace.")
        return history.user_path(self.ws, text, allow_root=allow_root)


def shown(path: bytes) -> str:
    return os.fsdecode(path)


def int_param(request: Request, name: str, default: int | None = None, low: int = 0,
              high: int | None = None) -> int | None:
    """An integer query parameter, clamped, or InputError for a non-number."""
    text = request.query_params.get(name)
    if text is None or text == "":
        return default
    try:
        value = int(text)
    except ValueError:
        raise errors.InputError(f"{name}={text!r} is not a number.") from None
    value = max(low, value)
    return min(high, value) if high is not None else value
