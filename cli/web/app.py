"""The ``stepfs serve`` application: routes, the guard and error pages
(presentation side; see ``site`` for what the pages share).

``create_app(workspace, token, read_only)`` is all a caller needs: the CLI
serves it with ``server.Server``, the tests drive it in-process.  With
``read_only`` the undo routes do not exist at all (404), rather than
existing and refusing.
"""

from __future__ import annotations

import contextlib

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.routing import Mount
from starlette.staticfiles import StaticFiles

from stepfs.store.errors import StepfsError

from stepfs.cli.web import history_pages, live_pages, undo_pages
from stepfs.cli.web.security import Guard
from stepfs.cli.web.site import HERE, Site


def create_app(workspace: str, token: str, read_only: bool = False) -> Starlette:
    site = Site(workspace, token, read_only)
    routes = history_pages.routes() + live_pages.routes()
    if not read_only:
        routes += undo_pages.routes()
    routes.append(Mount("/static", StaticFiles(directory=str(HERE / "static")), name="static"))

    async def stepfs_error(request: Request, exc: StepfsError):
        return site.error(request, exc)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        try:
            yield
        finally:
            site.close()

    app = Starlette(routes=routes, middleware=[Middleware(Guard, token=token)],
                    exception_handlers={StepfsError: stepfs_error}, lifespan=lifespan)
    app.state.site = site
    return app
