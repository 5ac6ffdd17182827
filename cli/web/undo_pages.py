"""Undo from the page: a dry-run preview of a rollback, then the rollback
(presentation side; both go through ``manage.rollback``, the function
behind ``stepfs rollback``, so staged changes are committed first, paths
changed outside stepfs are never overwritten, and the result is a new
layer that can itself be undone).

The preview's form carries the head it was made against; the rollback is
refused (HTTP 409, nothing written) when the history has moved since, and
the page shows a fresh preview instead: compare-and-swap on the head, held
under the commit lock by ``store.rollback``.  The form is a POST with the
CSRF token (``security``); a ``--read-only`` server has neither route.
"""

from __future__ import annotations

import os
from urllib.parse import parse_qs, urlsplit

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import PlainTextResponse, RedirectResponse
from starlette.routing import Route

from stepfs.overlayfs.client import manage
from stepfs.store import diff, errors
from stepfs.store.layers import State

from stepfs.cli.web.history_pages import INLINE_DIFF_ROWS, change_view
from stepfs.cli.web.security import check_csrf
from stepfs.cli.web.site import Site

#: A preview shows this many paths with their diffs, then names this many more.
PREVIEW_DIFFS = 50
PREVIEW_PATHS = 1000
FORGED_TEXT = "403 forbidden: this form did not come from this stepfs page (no valid CSRF token); nothing was changed.\n"


def _site(request: Request) -> Site:
    return request.app.state.site


def _state(d: dict) -> State:
    target = d.get("target")
    return State(d["kind"], d.get("mode"), d.get("oid"), os.fsencode(target) if target is not None else None)


def _preview(site: Site, number: int, paths: list[str]) -> dict:
    """The dry run of a rollback: the first :data:`PREVIEW_DIFFS` paths with
    their diffs, then up to :data:`PREVIEW_PATHS` more by name, then a count."""
    res = manage.rollback(site.target, number, paths, dry_run=True)
    files = res["card"]["files"]
    views = []
    with site.ws.db.read() as conn:
        for f in files[:PREVIEW_DIFFS]:
            c = diff.Change(os.fsencode(f["path"]), _state(f["before"]), _state(f["after"]))
            views.append(change_view(site, conn, c, False, INLINE_DIFF_ROWS))
    res["views"] = list(zip(files, views))
    res["listed"] = files[PREVIEW_DIFFS:PREVIEW_DIFFS + PREVIEW_PATHS]
    res["unlisted"] = max(0, len(files) - PREVIEW_DIFFS - PREVIEW_PATHS)
    return res


def _number(text: str | None, name: str) -> int:
    try:
        return int(text or "")
    except ValueError:
        raise errors.InputError(f"{name}={text!r} is not a layer number.") from None


def preview_page(request: Request):
    site = _site(request)
    number = _number(request.query_params.get("to"), "to")
    paths = [p for p in request.query_params.getlist("path") if p]
    preview = _preview(site, number, paths)
    return site.page(request, "undo.html", preview=preview, number=number, paths=paths, head=preview["head_before"])


def _same_origin(request: Request) -> bool:
    origin = request.headers.get("origin")
    if origin is None or origin == "null":
        return origin is None
    return urlsplit(origin).netloc == request.headers.get("host")


async def _form(request: Request) -> dict[str, list[str]]:
    """The fields of an urlencoded form (the only kind these pages send;
    parsed here rather than through python-multipart).  Bytes that are
    not UTF-8 keep their value as surrogate escapes, as path names do."""
    if request.headers.get("content-type", "").split(";")[0].strip() != "application/x-www-form-urlencoded":
        return {}
    body = await request.body()
    return parse_qs(body.decode("ascii", "replace"), keep_blank_values=True, errors="surrogateescape")


async def undo(request: Request):
    site = _site(request)
    form = await _form(request)
    if not check_csrf(site.token, (form.get("csrf") or [None])[0]) or not _same_origin(request):
        return PlainTextResponse(FORGED_TEXT, status_code=403)
    number = _number((form.get("to") or [None])[0], "to")
    expect = _number((form.get("head") or [None])[0], "head")
    paths = [p for p in form.get("path", []) if p]
    try:
        res = await run_in_threadpool(lambda: manage.rollback(site.target, number, paths, expect_head=expect))
    except errors.HeadMoved as exc:
        fresh = await run_in_threadpool(_preview, site, number, paths)
        return site.page(request, "undo.html", status_code=409, preview=fresh, number=number, paths=paths,
                         refused=str(exc), head=fresh["head_before"])
    return RedirectResponse(f"/layer/{res['layer']}", status_code=303)


def routes() -> list[Route]:
    return [Route("/undo", preview_page, methods=["GET"]), Route("/undo", undo, methods=["POST"])]
