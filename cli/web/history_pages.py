"""Pages of the history: the timeline, a layer's card with its diffs, the
tree and a file as of a layer, and raw bytes (presentation side; every
answer comes from ``store``, as the CLI's ``log``, ``show``, ``diff`` and
``cat`` do).

Sizes are bounded per page: layers and files are paginated, a diff of more
than :data:`DIFF_BYTES` is summarised, and a diff or a file view is cut
after a number of rows, with a link to the raw bytes.
"""

from __future__ import annotations

import os

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Route

from stepfs.store import diff, errors, history, layers, timeline
from stepfs.store.snapshot import Snapshot

from stepfs.cli.web import chart, diffs
from stepfs.cli.web.site import Site, int_param, shown, url

PAGE_LAYERS = 50
PAGE_FILES = 50
PAGE_TREE = 200
#: Larger files (either side) are summarised, not diffed, on a page.
DIFF_BYTES = 1 << 20
INLINE_DIFF_ROWS = 400
FULL_DIFF_ROWS = 5000
#: Files shown as text up to this size; larger ones link to their raw bytes.
FILE_VIEW_BYTES = 1 << 20
FILE_VIEW_ROWS = 5000


def _site(request: Request) -> Site:
    return request.app.state.site


def _meta_filter(text: str) -> dict[str, str]:
    meta = {}
    for item in text.split():
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise errors.InputError(f"the metadata filter takes KEY=VALUE words, got {item!r}.")
        meta[key] = value
    return meta


def timeline_page(request: Request):
    site = _site(request)
    limit = int_param(request, "limit", PAGE_LAYERS, 1, 500)
    before = int_param(request, "before")
    path_text = request.query_params.get("path") or ""
    meta_text = request.query_params.get("meta") or ""
    rel = site.user_path(path_text, allow_root=True) if path_text else None
    with site.ws.db.read() as conn:
        page = timeline.layer_page(site.ws.objects, conn, before=before, limit=limit,
                                   path=None if rel == b"." else rel, meta=_meta_filter(meta_text))
        head = layers.head(conn)
    return site.page(request, "timeline.html", rows=page.rows, next_before=page.next_before, before=before,
                     limit=limit, path=path_text, meta=meta_text, head=head, chart=chart.build(page.rows),
                     live=before is None)


def change_view(site: Site, conn, c: diff.Change, side_by_side: bool, max_rows: int) -> dict:
    """What a page shows of one change: a rendered diff, or why not."""
    n_old, n_new = diff.sizes(conn, c)
    if "dir" in (c.before.kind, c.after.kind) and c.before.kind == c.after.kind:
        return {"what": "none"}
    if (c.before.kind, c.before.oid, c.before.target) == (c.after.kind, c.after.oid, c.after.target):
        return {"what": "same"}
    if max(n_old, n_new) > DIFF_BYTES:
        return {"what": "large", "n_old": n_old, "n_new": n_new}
    a, b, n_old, n_new = diff.lines_of(site.ws.objects, conn, c)
    if a is None or b is None:
        return {"what": "binary", "n_old": n_old, "n_new": n_new}
    return {"what": "text", "diff": diffs.render(a, b, shown(c.path), side_by_side, max_rows)}


def card_page(request: Request):
    site = _site(request)
    number = request.path_params["number"]
    page = int_param(request, "page", 0)
    with site.ws.db.read() as conn:
        card, changes = timeline.card_page(site.ws.objects, conn, number, page * PAGE_FILES, PAGE_FILES)
        views = [change_view(site, conn, c, False, INLINE_DIFF_ROWS) for c in changes]
        head = layers.head(conn)
    files = list(zip(card["files"], views))
    pages = (card["total_files"] + PAGE_FILES - 1) // PAGE_FILES
    return site.page(request, "card.html", card=card, files=files, page=page, pages=pages, head=head)


def file_diff_page(request: Request):
    site = _site(request)
    number = request.path_params["number"]
    rel = site.user_path(request.query_params.get("path"))
    side = request.query_params.get("view") == "split"
    with site.ws.db.read() as conn:
        layers.get(conn, number)
        c = timeline.change_at(conn, number, rel)
        if c is None:
            raise errors.NoSuchPath(f"layer {number} did not change {shown(rel)}; its card lists what it changed.")
        view = change_view(site, conn, c, side, FULL_DIFF_ROWS)
        head = layers.head(conn)
    return site.page(request, "filediff.html", number=number, head=head, path=shown(rel), change=c, view=view, side=side,
                     old_path=shown(c.old_path if c.old_path is not None else c.path))


def _crumbs(rel: bytes) -> list[tuple[str, str]]:
    if rel == b".":
        return []
    parts = shown(rel).split("/")
    return [(p, "/".join(parts[:i + 1])) for i, p in enumerate(parts)]


def tree_page(request: Request):
    site = _site(request)
    number = request.path_params["number"]
    rel = site.user_path(request.query_params.get("path"), allow_root=True)
    page = int_param(request, "page", 0)
    with site.ws.db.read() as conn:
        snap = Snapshot(site.ws, conn, number)
        item = snap.lookup(rel)
        if item is None:
            raise errors.NoSuchPath(f"{shown(rel)} did not exist as of layer {number}.")
        if item.kind != "dir":
            return RedirectResponse(url(f"/file/{number}", path=shown(rel)), status_code=303)
        names = snap.listdir(rel)
        head = layers.head(conn)
    prefix = "" if rel == b"." else shown(rel) + "/"
    entries = [(shown(name), kind, prefix + shown(name)) for name, kind in
               names[page * PAGE_TREE:(page + 1) * PAGE_TREE]]
    pages = (len(names) + PAGE_TREE - 1) // PAGE_TREE
    return site.page(request, "tree.html", number=number, path=shown(rel) if rel != b"." else "", entries=entries,
                     total=len(names), page=page, pages=pages, crumbs=_crumbs(rel), head=head)


def file_page(request: Request):
    site = _site(request)
    number = request.path_params["number"]
    rel = site.user_path(request.query_params.get("path"))
    with site.ws.db.read() as conn:
        snap = Snapshot(site.ws, conn, number)
        item = snap.lookup(rel)
        if item is None:
            raise errors.NoSuchPath(f"{shown(rel)} did not exist as of layer {number}; the timeline filtered "
                                    f"by this path lists the layers that touched it.")
        if item.kind == "dir":
            return RedirectResponse(url(f"/tree/{number}", path=shown(rel)), status_code=303)
        touched = timeline.touching(conn, rel)
        head = layers.head(conn)
        rows, cut, what = [], False, item.kind
        if item.kind == "file":
            if item.size > FILE_VIEW_BYTES:
                what = "large"
            else:
                lines = diff.text_lines(snap.read(rel, item, 0, item.size))
                if lines is None:
                    what = "binary"
                else:
                    rows, cut = diffs.numbered(lines, shown(rel), FILE_VIEW_ROWS)
    return site.page(request, "file.html", number=number, path=shown(rel), item=item, what=what, rows=rows,
                     cut=cut, touched=touched, head=head, crumbs=_crumbs(rel),
                     target=os.fsdecode(item.target) if item.target is not None else None)


def raw_file(request: Request):
    """A file's bytes as of a layer, never rendered as a page: plain text or
    a download, in a sandbox that runs nothing."""
    site = _site(request)
    number = request.path_params["number"]
    path = request.query_params.get("path")
    if not path:
        raise errors.InputError("this page needs a path= parameter naming a file in the workspace.")
    data = history.file_bytes(site.ws, number, path)
    text = diff.text_lines(data[:8192]) is not None
    return Response(data, media_type="text/plain; charset=utf-8" if text else "application/octet-stream",
                    headers={"content-security-policy": "sandbox; default-src 'none'"})


def routes() -> list[Route]:
    return [
        Route("/", timeline_page),
        Route("/layer/{number:int}", card_page),
        Route("/layer/{number:int}/diff", file_diff_page),
        Route("/tree/{number:int}", tree_page),
        Route("/file/{number:int}", file_page),
        Route("/raw/{number:int}", raw_file),
    ]
