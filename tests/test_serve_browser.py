"""``stepfs serve`` in a real browser: Debian's chromium driven by
Playwright, against a real workspace with a real mount and steps made by
real programs (mount tier).

Covers what only a browser shows: the pages render and link up, a diff
expands, undo goes through its preview and form, the timeline and the live
view refresh by themselves (server-sent events, no reload), and the guard
refuses a browser without the token and a forged form.  Screenshots of the
main pages go to the test's temp dir, or to ``docs/screenshots/`` when
``STEPFS_SCREENSHOTS=1`` (so a plain test run leaves the checkout clean).

Skipped only where chromium is absent, and never under CI (``CI`` set):
there a missing browser is a failure.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, sh
from stepfs.cli.web.app import create_app
from stepfs.cli.web.security import new_token
from stepfs.cli.web.server import Server
from stepfs.overlayfs.client import manage

pytestmark = pytest.mark.mount

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
DOC_SHOTS = ROOT / "docs" / "screenshots"
#: How long a page may take to show what the test waits for (ms).
WAIT_MS = 30_000


def _browser_problem() -> tuple[str | None, bool]:
    """(what is missing, whether it is only the browser itself)."""
    if not os.access(CHROMIUM, os.X_OK):
        return f"{CHROMIUM} is missing: run docker/install-system-deps.sh (Debian's chromium package)", True
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed: pip install -e '.[test]'", False
    return None, False


@pytest.fixture(scope="module")
def browser():
    problem, browser_only = _browser_problem()
    if problem:
        if browser_only and not os.environ.get("CI"):
            pytest.skip(problem)
        pytest.fail(f"REAL-BROWSER TEST CANNOT RUN: {problem}", pytrace=False)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


class Served:
    def __init__(self, workspace: Path):
        self.token = new_token()
        self.server = Server(create_app(str(workspace), self.token), "127.0.0.1", 0)
        self.base = f"http://127.0.0.1:{self.server.port}"

    def url(self, path: str = "/") -> str:
        return self.base + path + ("&" if "?" in path else "?") + "token=" + self.token


@pytest.fixture
def served():
    """Factory: ``served(workspace)`` starts a server on an ephemeral port,
    stopped after the test whatever happened."""
    made: list[Served] = []

    def start(workspace: Path) -> Served:
        s = Served(workspace)
        made.append(s)
        s.server.start()
        return s

    try:
        yield start
    finally:
        for s in made:
            s.server.stop()


def shot(page, name: str) -> None:
    if os.environ.get("STEPFS_SCREENSHOTS") == "1":
        shots = DOC_SHOTS
    else:
        shots = Path(os.environ.get("TMPDIR", "/tmp")) / "stepfs-screenshots"
    shots.mkdir(parents=True, exist_ok=True)
    path = shots / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 0, f"the screenshot {path} is empty"


APP_V1 = 'def greet(name):\n    return "hi " + name\n'


def three_steps(m, target) -> list[int]:
    """Three layers made by shell programs through the mount."""
    sh(f"mkdir -p src && printf '%s' '{APP_V1}' > src/app.py && printf '# demo\\n' > README.md", m.mountpoint)
    (n1,) = manage.step(target, message="add the app", meta={"tool": "write", "call_id": "t1"})
    sh("sed -i 's/hi /hello /' src/app.py && printf 'def bye():\\n    return 1\\n' >> src/app.py"
       " && chmod 600 README.md && mkdir -p '<script>alert(1)<' && echo x > '<script>alert(1)</script>.txt'",
       m.mountpoint)
    (n2,) = manage.step(target, message="edit greet, add bye", meta={"tool": "bash", "exit_code": "0"})
    sh("mv README.md README.txt && head -c 3000 /dev/urandom > blob.bin", m.mountpoint)
    (n3,) = manage.step(target, message="rename and a binary", meta={"tool": "bash", "exit_code": "1"})
    return [n1, n2, n3]


def test_browse_a_layer_and_undo_one_path(browser, workspace, mount, served):
    m = mount(workspace)
    target = manage.Target(str(workspace), str(m.mountpoint))
    n1, n2, n3 = three_steps(m, target)
    s = served(workspace)
    ctx = browser.new_context(viewport={"width": 1280, "height": 800})
    try:
        page = ctx.new_page()
        page.set_default_timeout(WAIT_MS)
        assert page.goto(s.url("/")).status == 200
        assert "token=" not in page.url  # traded for a cookie
        rows = page.locator("table.layers td.n a")
        assert rows.all_inner_texts() == [str(n3), str(n2), str(n1), "0"]
        assert page.locator("text=edit greet, add bye").is_visible()
        assert page.locator("figure.chart svg rect").count() == 4
        shot(page, "timeline")

        page.click(f"a[href='/layer/{n2}'] >> text=edit greet, add bye")
        page.wait_for_url(f"**/layer/{n2}")
        diff_row = page.locator("details.file", has_text="src/app.py").locator("tr.add").first
        assert not diff_row.is_visible()
        page.locator("details.file summary", has_text="src/app.py").click()  # expand the diff
        diff_row.wait_for(state="visible")
        assert "hello" in page.locator("details.file", has_text="src/app.py").inner_text()
        assert page.locator("text=mode 644 → 600").is_visible()
        assert page.locator("details.file summary", has_text="<script>alert(1)</script>.txt").count() == 1
        assert page.evaluate("document.querySelectorAll('main script').length") == 0
        shot(page, "card")

        page.locator("details.file", has_text="src/app.py").locator("text=side by side").click()
        page.wait_for_selector("table.diff.split tr.replace")
        shot(page, "diff-side-by-side")

        page.goto(f"{s.base}/layer/{n1}")
        page.click("text=files as of this layer")
        page.click("a:text-is('src/')")
        page.click("a:text-is('app.py')")
        page.wait_for_url(f"**/file/{n1}?path=src%2Fapp.py")
        assert '"hi "' in page.locator("table.source").inner_text()
        touched = page.locator("aside.touched li").all_inner_texts()
        assert [t.split()[0] for t in touched] == [str(n2), str(n1)]
        shot(page, "file-as-of-layer")

        watcher = ctx.new_page()  # the timeline, left open: it must show the rollback by itself
        watcher.goto(f"{s.base}/")
        watcher.evaluate("window.notReloaded = true")

        page.click(f"text=restore this file as of layer {n1}")
        page.wait_for_selector("form.confirm button")
        assert page.locator("details.file summary", has_text="src/app.py").count() == 1
        assert (workspace / "src" / "app.py").read_text() != APP_V1  # the preview changed nothing
        shot(page, "undo-preview")
        page.click("form.confirm button")
        page.wait_for_url(f"**/layer/{n3 + 1}")
        assert page.locator("text=undo this rollback").is_visible()
        assert (workspace / "src" / "app.py").read_text() == APP_V1
        assert (m.mountpoint / "src" / "app.py").read_text() == APP_V1
        assert (workspace / "README.txt").exists()  # one path only

        watcher.wait_for_selector(f"table.layers td.n a[href='/layer/{n3 + 1}']")
        assert watcher.evaluate("window.notReloaded") is True
        assert watcher.locator("table.layers tr.kind-rollback").count() == 1
        shot(watcher, "timeline-after-rollback")
    finally:
        ctx.close()


def test_a_stale_rollback_a_missing_token_and_a_forged_form_are_refused(browser, workspace, mount, served):
    m = mount(workspace)
    target = manage.Target(str(workspace), str(m.mountpoint))
    n1, _n2, n3 = three_steps(m, target)
    s = served(workspace)

    stranger = browser.new_context()
    try:
        page = stranger.new_page()
        response = page.goto(f"{s.base}/")
        assert response.status == 403 and "token" in page.inner_text("body")
        assert page.goto(f"{s.base}/?token=wrong").status == 403
    finally:
        stranger.close()

    ctx = browser.new_context(viewport={"width": 1280, "height": 800})
    try:
        page = ctx.new_page()
        page.set_default_timeout(WAIT_MS)
        page.goto(s.url(f"/undo?to={n1}&path=src%2Fapp.py"))
        page.wait_for_selector("form.confirm button")
        sh("printf 'moved on\\n' > notes.txt", m.mountpoint)  # meanwhile an agent steps on
        (n4,) = manage.step(target, message="the agent moves on")
        before = (workspace / "src" / "app.py").read_text()
        with page.expect_response(lambda r: r.request.method == "POST") as answer:
            page.click("form.confirm button")
        assert answer.value.status == 409
        assert f"moved from layer {n3} to layer {n4}" in page.inner_text("#refused")
        assert page.locator("input[name=head]").get_attribute("value") == str(n4)  # a fresh preview
        assert (workspace / "src" / "app.py").read_text() == before
        shot(page, "undo-refused-stale")

        # A form from elsewhere: another page posting to /undo without the CSRF token.
        forged = ctx.new_page()
        forged.set_content(f"<form method='post' action='{s.base}/undo'><input name='to' value='{n1}'>"
                           f"<input name='head' value='{n4}'><button>go</button></form>")
        with forged.expect_response(lambda r: r.url.endswith("/undo")) as answer:
            forged.click("button")
        assert answer.value.status == 403
        # Same origin, with the cookie, but a wrong CSRF token.
        r = page.request.post(f"{s.base}/undo", form={"to": str(n1), "head": str(n4), "csrf": "0" * 64})
        assert r.status == 403
        with page.expect_navigation():
            page.click("a.brand")
        assert page.locator("table.layers td.n a").first.inner_text() == str(n4)  # nothing was rolled back
        assert (workspace / "src" / "app.py").read_text() == before
    finally:
        ctx.close()


WRITER = r"""
import sys, time
with open(sys.argv[1], "w") as f:
    f.write("draft written through the mount\n")
print("written", flush=True)
sys.stdin.readline()  # stay alive until the test has looked
"""


def test_live_view_shows_a_staged_file_while_a_process_writes(browser, workspace, mount, served):
    (workspace / "README").write_text("hello\n")
    m = mount(workspace)
    s = served(workspace)
    ctx = browser.new_context(viewport={"width": 1280, "height": 700})
    writer = None
    try:
        page = ctx.new_page()
        page.set_default_timeout(WAIT_MS)
        page.goto(s.url("/live"))
        assert "notes/draft.md" not in page.inner_text("#live")
        page.evaluate("window.notReloaded = true")
        sh("mkdir -p notes", m.mountpoint)
        writer = subprocess.Popen([sys.executable, "-c", WRITER, "notes/draft.md"], cwd=m.mountpoint,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert writer.stdout.readline().strip() == "written"
        page.wait_for_selector("#live ul.staged li:has-text('notes/draft.md')")
        assert page.evaluate("window.notReloaded") is True
        assert str(m.mountpoint) in page.inner_text("#live")
        shot(page, "live")
        writer.stdin.write("\n")
        writer.stdin.flush()
        assert writer.wait(timeout=30) == 0
    finally:
        if writer is not None and writer.poll() is None:
            writer.kill()
            writer.wait()
        ctx.close()
