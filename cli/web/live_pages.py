"""Live state: the mounts, their open steps and the conflicts, and the
server-sent events that make the live and timeline pages refresh by
themselves (presentation side; answers come from ``manage.status``, the
function behind ``stepfs status``).

The event stream polls :func:`store.timeline.activity` (the head, each open
step's number of staged rows, the conflicts) every :data:`POLL_SECONDS` and
sends an event when it changed; the page then fetches itself and swaps in
the part that changed.  It ends when the client goes or the server stops.
"""

from __future__ import annotations

import asyncio

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from stepfs.overlayfs.client import manage
from stepfs.store import diff, errors, history, timeline
from stepfs.store.errors import NoSuchPath

from stepfs.cli.web import diffs
from stepfs.cli.web.history_pages import DIFF_BYTES, FULL_DIFF_ROWS
from stepfs.cli.web.site import Site

POLL_SECONDS = 0.3
#: A comment line this often keeps proxies and the browser from timing out.
KEEPALIVE_SECONDS = 15.0


def _site(request: Request) -> Site:
    return request.app.state.site


def live_page(request: Request):
    site = _site(request)
    st = manage.status(site.target)
    return site.page(request, "live.html", status=st, head=st["head"], live=True)


def _activity(site: Site) -> tuple:
    with site.ws.db.read() as conn:
        return timeline.activity(conn)


async def events(request: Request):
    site = _site(request)

    async def stream():
        last = await run_in_threadpool(_activity, site)
        yield f"retry: 2000\nevent: ready\ndata: {last[0]}\n\n"
        quiet = 0.0
        while not site.stopping.is_set():
            await asyncio.sleep(POLL_SECONDS)
            if await request.is_disconnected():
                return
            now = await run_in_threadpool(_activity, site)
            if now != last:
                last = now
                quiet = 0.0
                yield f"data: {now[0]}\n\n"
            else:
                quiet += POLL_SECONDS
                if quiet >= KEEPALIVE_SECONDS:
                    quiet = 0.0
                    yield ": keepalive\n\n"

    return StreamingResponse(stream(), media_type="text/event-stream", headers={"x-accel-buffering": "no"})


def _conflict(site: Site, number: int) -> tuple[dict, int]:
    st = manage.status(site.target)
    for c in st["conflicts"]:
        if c["id"] == number:
            return c, st["head"]
    raise NoSuchPath(f"there is no conflict #{number}; the live page lists the conflicts.")


def _lines(data: bytes | None) -> list[str] | None:
    return None if data is None else diff.text_lines(data)


def conflict_page(request: Request):
    """A conflict's losing bytes next to what won (the path as of the head)."""
    site = _site(request)
    c, head = _conflict(site, request.path_params["id"])
    loser = winner = None
    with site.ws.db.read() as conn:
        if c["oid"] is not None and site.ws.objects.size(conn, c["oid"]) <= DIFF_BYTES:
            loser = site.ws.objects.read_all(conn, c["oid"])
    try:
        winner = history.file_bytes(site.ws, head, c["path"])
    except NoSuchPath:
        winner = b""
    view = None
    if loser is not None and len(winner) <= DIFF_BYTES:
        a, b = _lines(winner), _lines(loser)
        if a is not None and b is not None:
            view = diffs.render(a, b, c["path"], side_by_side=True, max_rows=FULL_DIFF_ROWS)
    return site.page(request, "conflict.html", c=c, head=head, view=view, live=True)


def conflict_raw(request: Request):
    site = _site(request)
    c, _head = _conflict(site, request.path_params["id"])
    if c["oid"] is None:
        raise errors.NoSuchPath(f"conflict #{c['id']} kept no bytes (the losing writer deleted {c['path']}).")
    with site.ws.db.read() as conn:
        data = site.ws.objects.read_all(conn, c["oid"])
    text = diff.text_lines(data[:8192]) is not None
    return Response(data, media_type="text/plain; charset=utf-8" if text else "application/octet-stream",
                    headers={"content-security-policy": "sandbox; default-src 'none'"})


def routes() -> list[Route]:
    return [
        Route("/live", live_page),
        Route("/events", events),
        Route("/conflict/{id:int}", conflict_page),
        Route("/conflict/{id:int}/raw", conflict_raw),
    ]
