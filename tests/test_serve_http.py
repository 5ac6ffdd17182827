"""``stepfs serve`` over plain HTTP, in-process (kernel-free tier): every
route's status codes, the token and the CSRF check, ``--read-only``,
containment of path parameters, escaping, pagination, and undo with its
compare-and-swap on the head.  The workspaces are real stores with layers
committed through ``publish.commit_step``; no mount."""

from __future__ import annotations

import os
import re
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx2 as httpx
import pytest
from starlette.testclient import TestClient

from stepfs.cli.web.app import create_app
from stepfs.cli.web.security import csrf_token
from conftest import stepfs
from stepfs.store import publish
from stepfs.store.workspace import Workspace
from store_kit import Stager, open_workspace

TOKEN = "t0k3n-for-the-tests"
#: A name can hold no slash: this is the file "script>.txt" in the directory "<script>alert(1)<".
SCRIPT_NAME = "<script>alert(1)</script>.txt"
APP_PY_1 = "def greet(name):\n    return 'hello ' + name\n"
APP_PY_2 = "def greet(name):\n    \"\"\"Say hello.\"\"\"\n    return f'hello {name}'\n"


def commit(ws, stage, message: str, meta: dict | None = None) -> int:
    st = Stager(ws)
    stage(st)
    return publish.commit_step(ws, st.step, message=message, meta=meta or {}, mount="/mnt/agent")


def build(root):
    """Layers: 1 adds files (one named like a script tag, one binary); 2 edits
    app.py, changes README's mode, renames data.bin; 3 adds a 2 MiB text and
    deletes README; 4 adds 450 files in one directory."""
    ws = open_workspace(root, {"src": ("dir", 0o755)})
    commit(ws, lambda st: (st.dir("<script>alert(1)<"), st.file("src/app.py", APP_PY_1.encode()), st.file("README.md", b"# read me\n"),
                           st.file(SCRIPT_NAME, b"<b>not bold</b>\n"), st.file("data.bin", b"\0\1\2binary" * 50)),
           "first files", {"tool": "edit", "call_id": "c1"})
    commit(ws, lambda st: (st.file("src/app.py", APP_PY_2.encode()), st.file("README.md", b"# read me\n", 0o600),
                           st.whiteout("data.bin"), st.file("moved.bin", b"\0\1\2binary" * 50)),
           "edit and rename", {"tool": "shell", "exit_code": "0"})
    commit(ws, lambda st: (st.file("big.txt", b"line of a large text file\n" * 80_000), st.whiteout("README.md")),
           "big file", {"tool": "edit"})
    commit(ws, lambda st: [st.file(f"many/f{i:03}.txt", f"{i}\n".encode()) for i in range(450)] + [st.dir("many")],
           "many files", {"tool": "gen"})
    return ws


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """A workspace the read-only tests share, and a decoy outside it."""
    base = tmp_path_factory.mktemp("serve")
    (base / "secret.txt").write_text("decoy outside the workspace\n")
    ws = build(base / "ws")
    os.symlink("../secret.txt", base / "ws" / "outlink")
    ws.close()
    return base / "ws"


def client_for(workspace, read_only: bool = False, token: str | None = TOKEN) -> TestClient:
    app = create_app(str(workspace), TOKEN, read_only=read_only)
    c = TestClient(app, base_url="http://127.0.0.1:8765")
    if token is not None:
        r = c.get(f"/?token={token}", follow_redirects=False)
        assert r.status_code == 303 and "token" not in r.headers["location"]
    return c


@pytest.fixture(scope="module")
def client(shared):
    with client_for(shared) as c:
        yield c


# -- token and headers ---------------------------------------------------------------


@pytest.mark.parametrize("route", ["/", "/layer/1", "/tree/1", "/file/1?path=src/app.py", "/raw/1?path=src/app.py",
                                   "/live", "/events", "/undo?to=1", "/static/style.css", "/nowhere"])
def test_every_route_needs_the_token(shared, route):
    with client_for(shared, token=None) as c:
        r = c.get(route)
        assert r.status_code == 403
        assert "token" in r.text
        assert c.post("/undo", data={"to": "1", "head": "4"}).status_code == 403
        c.cookies.set("stepfs_x", TOKEN)  # the token under another server's cookie name
        assert c.get(route).status_code == 403


def test_a_wrong_token_is_refused_and_sets_no_cookie(shared):
    with client_for(shared, token=None) as c:
        r = c.get("/?token=guess", follow_redirects=False)
        assert r.status_code == 403 and "set-cookie" not in r.headers
        assert c.get("/").status_code == 403


def test_the_token_becomes_a_strict_httponly_cookie(shared):
    with client_for(shared, token=None) as c:
        r = c.get(f"/layer/1?token={TOKEN}&page=0", follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"] == "/layer/1?page=0"
        cookie = r.headers["set-cookie"].lower()
        assert "httponly" in cookie and "samesite=strict" in cookie
        assert c.get("/layer/1").status_code == 200


def test_pages_forbid_foreign_scripts(client):
    r = client.get("/")
    csp = r.headers["content-security-policy"]
    assert "script-src 'nonce-" in csp and "default-src 'none'" in csp
    assert r.headers["x-content-type-options"] == "nosniff"
    nonce = re.search(r"'nonce-([^']+)'", csp).group(1)
    assert f'<script nonce="{nonce}">' in r.text
    assert "<script src" not in r.text


# -- pages ----------------------------------------------------------------------------


def test_timeline_lists_layers_newest_first_with_their_numbers(client):
    r = client.get("/")
    assert r.status_code == 200
    order = [int(n) for n in re.findall(r'<td class="n"><a href="/layer/(\d+)">', r.text)]
    assert order == [4, 3, 2, 1, 0]
    assert "edit and rename" in r.text and "exit_code=0" in r.text and "/mnt/agent" in r.text
    assert "<svg" in r.text and 'href="/layer/2"><rect' in r.text
    row1 = r.text.split('<td class="n"><a href="/layer/1">1</a></td>')[1].split("</tr>")[0]
    assert "5 <span" in row1 and "(+5 ~0 -0)" in row1  # a directory and four files
    assert '+4</span> <span class="minus">-0' in row1  # 2 + 1 + 1 text lines; the binary file has none


def test_timeline_filters_by_path_and_metadata(client):
    by_path = client.get("/", params={"path": "src/app.py"}).text
    assert re.findall(r'<td class="n"><a href="/layer/(\d+)">', by_path) == ["2", "1"]
    by_dir = client.get("/", params={"path": "many"}).text
    assert re.findall(r'<td class="n"><a href="/layer/(\d+)">', by_dir) == ["4"]
    by_meta = client.get("/", params={"meta": "tool=edit"}).text
    assert re.findall(r'<td class="n"><a href="/layer/(\d+)">', by_meta) == ["3", "1"]
    both = client.get("/", params={"meta": "tool=edit call_id=c1"}).text
    assert re.findall(r'<td class="n"><a href="/layer/(\d+)">', both) == ["1"]
    assert client.get("/", params={"meta": "novalue"}).status_code == 400


def test_timeline_pages(client):
    first = client.get("/", params={"limit": 2}).text
    assert re.findall(r'<td class="n"><a href="/layer/(\d+)">', first) == ["4", "3"]
    nxt = re.search(r'rel="next" href="([^"]+)"', first).group(1).replace("&amp;", "&")
    second = client.get(nxt).text
    assert re.findall(r'<td class="n"><a href="/layer/(\d+)">', second) == ["2", "1"]
    third = client.get(re.search(r'rel="next" href="([^"]+)"', second).group(1).replace("&amp;", "&")).text
    assert re.findall(r'<td class="n"><a href="/layer/(\d+)">', third) == ["0"]
    assert 'rel="next"' not in third
    assert client.get("/", params={"before": "x"}).status_code == 400


def test_card_shows_diffs_renames_modes_and_binary(client):
    r = client.get("/layer/2")
    assert r.status_code == 200
    text = r.text
    assert "from data.bin" in text and "moved.bin" in text
    assert "mode 644 → 600" in text
    assert 'class="diff hl' in text and "Say hello." in text
    assert '<span class="k">def</span>' in text  # Pygments classes
    one = client.get("/layer/1").text
    assert "binary content" in one


def test_a_large_file_is_summarised_with_a_raw_link(client):
    text = client.get("/layer/3").text
    assert "too large to show here" in text
    assert 'href="/raw/3?path=big.txt"' in text
    raw = client.get("/raw/3", params={"path": "big.txt"})
    assert raw.status_code == 200 and len(raw.content) == 26 * 80_000
    assert raw.headers["content-security-policy"].startswith("sandbox")


def test_card_files_are_paginated(client):
    first = client.get("/layer/4").text
    assert first.count('<details class="file"') == 50
    assert "files 1–50 of 451" in first
    last = client.get("/layer/4", params={"page": 9}).text
    assert last.count('<details class="file"') == 1


def test_file_diff_unified_and_side_by_side(client):
    uni = client.get("/layer/2/diff", params={"path": "src/app.py"})
    assert uni.status_code == 200 and 'class="diff hl"' in uni.text and 'class="add"' in uni.text
    split = client.get("/layer/2/diff", params={"path": "src/app.py", "view": "split"})
    assert 'class="diff hl split"' in split.text and 'class="replace"' in split.text
    assert client.get("/layer/2/diff", params={"path": "big.txt"}).status_code == 404
    assert client.get("/layer/2/diff").status_code == 400


def test_tree_and_file_as_of_a_layer(client):
    tree1 = client.get("/tree/1").text
    assert "README.md" in tree1 and "big.txt" not in tree1
    tree3 = client.get("/tree/3").text
    assert "README.md" not in tree3 and "big.txt" in tree3
    f1 = client.get("/file/1", params={"path": "src/app.py"})
    assert f1.status_code == 200 and "hello " in f1.text and "Say hello" not in f1.text
    touched = f1.text.split("layers that touched this file")[1]
    assert re.findall(r'<li[^>]*><a href="/file/(\d+)\?path=src%2Fapp.py">', touched) == ["2", "1"]
    assert client.get("/file/3", params={"path": "README.md"}).status_code == 404
    assert client.get("/file/1", params={"path": "src"}, follow_redirects=False).status_code == 303
    assert client.get("/tree/1", params={"path": "src/app.py"}, follow_redirects=False).status_code == 303
    assert client.get("/tree/99").status_code == 404
    assert client.get("/layer/99").status_code == 404


def test_tree_listing_is_paginated(client):
    first = client.get("/tree/4", params={"path": "many"}).text
    assert first.count('href="/file/4?path=many%2Ff') == 200
    last = client.get("/tree/4", params={"path": "many", "page": 2}).text
    assert last.count('href="/file/4?path=many%2Ff') == 50


def test_a_script_in_a_file_name_is_shown_escaped(client):
    for page in ("/layer/1", "/tree/1", "/"):
        text = client.get(page, params={"path": SCRIPT_NAME} if page == "/" else None).text
        assert "<script>alert(1)</script>" not in text
        if page == "/layer/1":
            assert "&lt;script&gt;alert(1)&lt;/script&gt;.txt" in text
        if page == "/tree/1":
            assert "&lt;script&gt;alert(1)&lt;/</a>" in text
    f = client.get("/file/1", params={"path": SCRIPT_NAME})
    assert f.status_code == 200 and "<script>alert" not in f.text and "<b>not bold</b>" not in f.text
    assert "&lt;b&gt;" in f.text


@pytest.mark.parametrize("path", ["../secret.txt", "src/../../secret.txt", ".stepfs/store.db", ".stepfs",
                                  "src/../.stepfs/store.db", "outlink/x", "/etc/passwd"])
def test_paths_are_contained_as_in_the_cli(client, path):
    for route in ("/file/1", "/tree/1", "/raw/1", "/layer/1/diff", "/"):
        r = client.get(route, params={"path": path})
        assert r.status_code == 403, (route, r.status_code)
        assert "decoy" not in r.text and "SQLite" not in r.text
    assert client.get("/undo", params={"to": 1, "path": path}).status_code == 403


def test_live_page_and_event_stream(client):
    r = client.get("/live")
    assert r.status_code == 200 and "no mounts, nothing staged" in r.text
    assert "new EventSource(\"/events\")" in r.text
    with client.stream("GET", "/events") as s:
        assert s.headers["content-type"].startswith("text/event-stream")
        first = next(s.iter_lines())
        assert first == "retry: 2000"


# -- undo ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """A closed workspace the undo tests each get a copy of (building one
    takes seconds; copying it, with its store, a fraction of that)."""
    root = tmp_path_factory.mktemp("serve-template") / "ws"
    build(root).close()
    return root


@pytest.fixture
def own(template, tmp_path):
    shutil.copytree(template, tmp_path / "ws", symlinks=True)
    with client_for(tmp_path / "ws") as c:
        yield tmp_path / "ws", c


def _form(c, url_: str) -> dict:
    text = c.get(url_).text
    fields = dict(re.findall(r'<input type="hidden" name="(csrf|to|head)" value="([^"]*)">', text))
    fields["path"] = re.findall(r'<input type="hidden" name="path" value="([^"]*)">', text)
    return fields


def test_undo_preview_then_rollback_of_one_path_is_itself_undoable(own):
    root, c = own
    preview = c.get("/undo", params={"to": 1, "path": "src/app.py"})
    assert preview.status_code == 200 and "nothing has been changed yet" in preview.text
    assert (root / "src" / "app.py").read_text() == APP_PY_2  # a preview writes nothing
    form = _form(c, "/undo?to=1&path=src%2Fapp.py")
    assert form["head"] == "4" and form["path"] == ["src/app.py"]
    r = c.post("/undo", data=form, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/layer/5"
    assert (root / "src" / "app.py").read_text() == APP_PY_1
    card = c.get("/layer/5").text
    assert "undo this rollback" in card and "rollback to 1" in card
    again = _form(c, "/undo?to=4")
    assert c.post("/undo", data=again, follow_redirects=False).headers["location"] == "/layer/6"
    assert (root / "src" / "app.py").read_text() == APP_PY_2


def test_a_stale_preview_is_refused_with_a_fresh_one(own):
    root, c = own
    stale = _form(c, "/undo?to=1&path=src%2Fapp.py")
    other = _form(c, "/undo?to=3&path=many")
    assert c.post("/undo", data=other, follow_redirects=False).status_code == 303  # the head moves to 5
    r = c.post("/undo", data=stale)
    assert r.status_code == 409
    assert "moved from layer 4 to layer 5" in r.text and 'id="refused"' in r.text
    assert (root / "src" / "app.py").read_text() == APP_PY_2
    assert '<input type="hidden" name="head" value="5">' in r.text  # the fresh preview


def test_a_forged_form_is_refused(own):
    root, c = own
    form = _form(c, "/undo?to=1")
    for bad in ({**form, "csrf": "forged"}, {k: v for k, v in form.items() if k != "csrf"}):
        r = c.post("/undo", data=bad)
        assert r.status_code == 403 and "nothing was changed" in r.text
    r = c.post("/undo", data=form, headers={"origin": "http://evil.example"})
    assert r.status_code == 403
    assert c.get("/undo", params={"to": 1}).status_code == 200
    assert (root / "README.md").exists() is False and (root / "big.txt").exists()
    assert csrf_token(TOKEN) == form["csrf"]


def test_undo_errors_are_sentences_with_status_codes(own):
    _root, c = own
    assert c.get("/undo", params={"to": 4}).status_code == 409  # nothing to roll back
    assert c.get("/undo", params={"to": 77}).status_code == 404
    assert c.get("/undo", params={"to": "x"}).status_code == 400
    assert c.get("/undo").status_code == 400


def test_read_only_has_no_state_changing_route(shared):
    with client_for(shared, read_only=True) as c:
        assert c.get("/undo", params={"to": 1}).status_code == 404
        form = {"csrf": csrf_token(TOKEN), "to": "1", "head": "4"}
        assert c.post("/undo", data=form).status_code in (404, 405)
        assert "undo this" not in c.get("/layer/2").text
        assert "restore this file" not in c.get("/file/2", params={"path": "src/app.py"}).text
        assert "read-only" in c.get("/").text


def test_undo_commits_staged_changes_first_and_keeps_the_head_check(own):
    root, c = own
    form = _form(c, "/undo?to=1&path=src%2Fapp.py")
    ws = Workspace.open(str(root))
    try:
        st = Stager(ws)  # an open step with a change, as a mount whose daemon is gone leaves one
        st.file("notes.txt", b"staged\n")
    finally:
        ws.close()
    r = c.post("/undo", data=form, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/layer/6"
    assert (root / "notes.txt").read_bytes() == b"staged\n"  # committed as layer 5, never thrown away
    assert "staged changes, committed before rollback" in c.get("/layer/5").text
    assert (root / "src" / "app.py").read_text() == APP_PY_1


def _read_line(proc, prefix: str, timeout: float = 30.0) -> str:
    """The first line of ``proc``'s output starting with ``prefix`` (read in
    a thread: a buffered pipe and select do not mix)."""
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in iter(proc.stdout.readline, "")] + [lines.put("")],
                     daemon=True).start()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.2)
        except queue.Empty:
            continue
        if line.startswith(prefix):
            return line
        if not line:
            break
    raise AssertionError(f"stepfs serve printed no line starting with {prefix!r} within {timeout} s")


def test_the_stepfs_serve_command_prints_a_token_url_and_warns_off_loopback(shared):
    proc = subprocess.Popen([sys.executable, "-m", "stepfs.cli.main", "serve", str(shared), "--port", "0",
                             "--host", "0.0.0.0", "--read-only"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        url = _read_line(proc, "open ").split()[1]
        port = int(re.search(r":(\d+)/", url).group(1))
        token = url.split("token=")[1]
        with httpx.Client(base_url=f"http://127.0.0.1:{port}") as h:
            assert h.get("/").status_code == 403
            r = h.get(f"/?token={token}", follow_redirects=True)
            assert r.status_code == 200 and "read-only" in r.text
            assert h.get("/undo", params={"to": 1}).status_code == 404
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0
    assert "warning: listening on 0.0.0.0, which is not a local address" in proc.stderr.read()


def test_stepfs_serve_refuses_a_port_in_use_with_a_sentence(shared):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        r = stepfs("serve", str(shared), "--port", str(port))
    assert r.returncode == 13
    assert f"cannot listen on 127.0.0.1:{port}" in r.stderr.decode() and "--port" in r.stderr.decode()


def test_a_large_preview_shows_some_diffs_then_names(own, monkeypatch):
    from stepfs.cli.web import undo_pages

    _root, c = own
    monkeypatch.setattr(undo_pages, "PREVIEW_PATHS", 100)
    text = c.get("/undo", params={"to": 3}).text  # layer 4's 451 paths go away
    assert text.count('<details class="file"') == 50
    assert text.count('<li><span class="op op-deleted">') == 100
    assert "and 301 more path(s)" in text
    assert "roll back (451 path(s))" in text


def test_a_conflict_shows_the_losing_bytes_next_to_the_winner(own):
    from stepfs.overlayfs.client import manage

    root, c = own
    ws = Workspace.open(str(root))
    try:
        st = Stager(ws)
        st.file("src/app.py", b"def greet(name):\n    return 'the loser wrote this'\n")
    finally:
        ws.close()
    os.utime(root / "src" / "app.py", ns=(1_500_000_000_000_000_000,) * 2)  # touched meanwhile: the stage lost
    assert manage.discard(manage.Target(str(root)), ["src/app.py"]) == ["src/app.py"]  # lost: a conflict
    live = c.get("/live").text
    number = re.search(r'<a href="/conflict/(\d+)">src/app.py</a>', live).group(1)
    assert "discarded" in live
    page = c.get(f"/conflict/{number}")
    assert page.status_code == 200
    assert "the loser wrote this" in page.text and "Say hello." in page.text  # loser beside the winner
    assert 'class="diff hl split"' in page.text
    raw = c.get(f"/conflict/{number}/raw")
    assert raw.content == b"def greet(name):\n    return 'the loser wrote this'\n"
    assert raw.headers["content-security-policy"].startswith("sandbox")
    assert c.get("/conflict/999").status_code == 404
