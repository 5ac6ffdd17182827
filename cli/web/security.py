"""The web page's guard: a secret token on every request, CSRF on every
state change, and headers that keep a page from running anything it did
not ship (presentation side; no store access).

Token (as Jupyter does): ``stepfs serve`` prints a URL with ``?token=...``.
A request carrying the right token gets it as an HttpOnly, SameSite=Strict
cookie and is redirected to the same URL without it (so the token does not
stay in the address bar or the history); every other request needs the
cookie, else 403.  The cookie's name carries an id of the server, since
cookies are not told apart by port and two servers may run at once.

CSRF: every form that changes state carries :func:`csrf_token` (derived from
the secret token, so a page of another origin cannot know it) and is a
POST; :func:`check_csrf` refuses anything else.  The SameSite cookie alone
already keeps a cross-site POST from being authenticated; the form token is
the second lock.

Headers: a Content-Security-Policy that allows scripts only with a fresh
per-response nonce (the one inline script of the live pages carries it) and
styles only from this server, so a file named ``<script>...`` shown on a
page can never run even if some escaping were forgotten.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from urllib.parse import urlencode

from starlette.requests import Request
from starlette.responses import PlainTextResponse, RedirectResponse

FORBIDDEN_TEXT = ("403 forbidden: this stepfs page needs the token printed by 'stepfs serve'; "
                  "open the URL it printed (with ?token=...).\n")


def new_token() -> str:
    return secrets.token_urlsafe(32)


def csrf_token(token: str) -> str:
    return hmac.new(token.encode(), b"stepfs-serve-csrf", hashlib.sha256).hexdigest()


def check_csrf(token: str, given: str | None) -> bool:
    return given is not None and hmac.compare_digest(csrf_token(token), given)


def _csp(nonce: str) -> str:
    return ("default-src 'none'; style-src 'self'; img-src 'self' data:; "
            f"script-src 'nonce-{nonce}'; connect-src 'self'; form-action 'self'; "
            "frame-ancestors 'none'; base-uri 'none'")


class Guard:
    """ASGI middleware: token check and security headers on every response."""

    def __init__(self, app, token: str):
        self.app = app
        self.token = token
        self.cookie = "stepfs_" + hashlib.sha256(token.encode()).hexdigest()[:12]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request = Request(scope)
        given = request.query_params.get("token")
        if given is not None:
            if not hmac.compare_digest(given.encode(), self.token.encode()):
                return await PlainTextResponse(FORBIDDEN_TEXT, status_code=403)(scope, receive, send)
            rest = [(k, v) for k, v in request.query_params.multi_items() if k != "token"]
            target = request.url.path + ("?" + urlencode(rest) if rest else "")
            response = RedirectResponse(target, status_code=303)
            response.set_cookie(self.cookie, self.token, httponly=True, samesite="strict", path="/")
            return await response(scope, receive, send)
        cookie = request.cookies.get(self.cookie)
        if cookie is None or not hmac.compare_digest(cookie.encode(), self.token.encode()):
            return await PlainTextResponse(FORBIDDEN_TEXT, status_code=403)(scope, receive, send)
        nonce = secrets.token_urlsafe(16)
        scope["stepfs.nonce"] = nonce

        async def send_with_headers(message):
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                names = {k.lower() for k, _ in headers}
                extra = {b"content-security-policy": _csp(nonce).encode(), b"x-content-type-options": b"nosniff",
                         b"referrer-policy": b"same-origin", b"x-frame-options": b"DENY",
                         b"cache-control": b"no-store"}
                headers += [(k, v) for k, v in extra.items() if k not in names]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_headers)
