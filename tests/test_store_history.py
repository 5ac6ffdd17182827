"""History: a path's state as of a layer, user path containment, file bytes
as of a layer (kernel-free tier)."""

from __future__ import annotations

import os
import stat as stat_mod

import pytest

from stepfs.store import entrytable, history, publish, schema
from stepfs.store.errors import ContainmentError, NoSuchLayer, NoSuchPath
from stepfs.store.layers import Entry, State
from stepfs.store.workspace import Workspace
from store_kit import Stager, open_workspace, plain


def build(root) -> Workspace:
    """Layers: 1 edits a; 2 edits a again and adds b; 3 deletes b.
    c is never touched; d is a directory layer 1 gives a new mode."""
    w = open_workspace(root, {
        "a": ("file", 0o644, b"a0\n"),
        "c": ("file", 0o644, b"c now\n"),
        "d": ("dir", 0o755),
        "plain": ("dir", 0o755),
        "ln": ("symlink", "c"),
    })
    for stage in (
        lambda st: (st.file("a", b"a1\n"), st.dir("d", 0o700)),
        lambda st: (st.file("a", b"a2\n"), st.file("b", b"b2\n")),
        lambda st: st.whiteout("b"),
    ):
        st = Stager(w)
        stage(st)
        publish.commit_step(w, st.step)
    return w


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """Shared by the tests that only read it."""
    w = build(tmp_path_factory.mktemp("history") / "ws")
    yield w
    w.close()


@pytest.fixture
def own_ws(tmp_path):
    """For the tests that change the workspace or its store."""
    w = build(tmp_path / "ws")
    yield w
    w.close()


def oid(ws, data: bytes) -> str:
    with ws.db.write() as conn:
        return ws.objects.put_bytes(conn, data)


def test_file_bytes_of_an_untouched_fifo_neither_hangs_nor_crashes(own_ws):
    os.mkfifo(os.path.join(own_ws.path, "pipe"))
    with pytest.raises(NoSuchPath, match="special file"):
        history.file_bytes(own_ws, 1, "pipe")


@pytest.mark.parametrize("fmt", [stat_mod.S_IFCHR, stat_mod.S_IFSOCK], ids=["chardev", "socket"])
def test_file_bytes_of_an_untouched_device_or_socket_never_opens_it(own_ws, fmt):
    os.mknod(os.path.join(own_ws.path, "node"), fmt | 0o600, os.makedev(1, 3))
    with pytest.raises(NoSuchPath, match="special file"):
        history.file_bytes(own_ws, 1, "node")


def test_state_at_touched_paths(ws):
    a = {n: State("file", 0o644, oid(ws, b"a%d\n" % n)) for n in range(3)}
    absent = State(None)
    b2 = State("file", 0o644, oid(ws, b"b2\n"))
    with ws.db.read() as conn:
        # a: the baseline comes from layer 1's before state
        assert [plain(history.state_at(conn, b"a", n)) for n in range(5)] == [a[0], a[1], a[2], a[2], a[2]]
        # b: absent until layer 2, gone again in layer 3
        assert [plain(history.state_at(conn, b"b", n)) for n in range(5)] == [absent, absent, b2, absent, absent]
        assert plain(history.state_at(conn, b"d", 0)) == State("dir", 0o755)
        assert plain(history.state_at(conn, b"d", 3)) == State("dir", 0o700)


def test_state_at_untouched_path_is_none(ws):
    with ws.db.read() as conn:
        for n in range(5):
            assert history.state_at(conn, b"c", n) is None
            assert history.state_at(conn, b"never", n) is None


def test_state_at_ignores_layers_that_are_not_committed(own_ws):
    with own_ws.db.write() as conn:
        for number, state in ((4, "void"), (5, "pending")):
            conn.execute(schema.layers.insert().values(
                number=number, state=state, kind="step", created_ns=0, message="", agent="", mount="",
                meta="{}", intent_sum="x"))
            entrytable.insert(conn, number, [Entry(b"c", State("file", 0o644), State(None)),
                                             Entry(b"a", State(None), State(None))])
    a2 = State("file", 0o644, oid(own_ws, b"a2\n"))
    with own_ws.db.read() as conn:
        assert history.state_at(conn, b"c", 1) is None
        assert history.state_at(conn, b"c", 9) is None
        assert plain(history.state_at(conn, b"a", 9)) == a2


def test_file_bytes_as_of_each_layer(ws):
    assert [history.file_bytes(ws, n, "a") for n in range(4)] == [b"a0\n", b"a1\n", b"a2\n", b"a2\n"]
    assert history.file_bytes(ws, 2, "b") == b"b2\n"
    assert history.file_bytes(ws, 1, "c") == b"c now\n"  # untouched: the workspace
    assert history.file_bytes(ws, 2, os.path.join(ws.path, "a")) == b"a2\n"


@pytest.mark.parametrize("number,path,message", [
    (1, "b", "did not exist as of layer 1"),
    (3, "b", "did not exist as of layer 3"),
    (2, "nope", "did not exist"),
    (1, "d", "was a dir as of layer 1"),
    (1, "plain", "not a file"),  # untouched directory, read from the workspace
    (1, "ln", "symlink"),  # untouched symlink: never followed
])
def test_file_bytes_refuses_what_is_not_a_file(ws, number, path, message):
    with pytest.raises(NoSuchPath, match=message):
        history.file_bytes(ws, number, path)


@pytest.mark.parametrize("number", [-1, 4, 99])
def test_file_bytes_of_a_missing_layer(ws, number):
    with pytest.raises(NoSuchLayer):
        history.file_bytes(ws, number, "a")


def test_user_path_accepts_paths_inside(ws):
    assert history.user_path(ws, "a") == b"a"
    assert history.user_path(ws, "./x/../a") == b"a"
    assert history.user_path(ws, "src//pkg/") == b"src/pkg"
    assert history.user_path(ws, os.path.join(ws.path, "src", "a.py")) == b"src/a.py"
    assert history.user_path(ws, "caf\udce9") == b"caf\xe9"  # not UTF-8: kept as bytes


@pytest.mark.parametrize("path", [
    "..", "../a", "a/../../a", "x/../../ws/a",
    "/etc/passwd", "/",
    ".stepfs", ".stepfs/store.db", "./.stepfs/tmp", "a/../.stepfs",
    "", ".", "a/..",
])
def test_user_path_refuses_escapes_the_store_and_the_root(ws, path):
    with pytest.raises(ContainmentError):
        history.user_path(ws, path)


def test_user_path_refuses_absolute_paths_outside_or_into_the_store(ws):
    for path in (
        ws.path + "2/a",  # a sibling whose name starts with the workspace's
        os.path.dirname(ws.path),
        os.path.join(ws.path, ".stepfs", "store.db"),
        os.path.join(ws.path, "..", "elsewhere"),
    ):
        with pytest.raises(ContainmentError):
            history.user_path(ws, path)


def test_user_path_names_the_workspace_itself_clearly(ws):
    for path in (ws.path, ws.path + "/"):
        with pytest.raises(ContainmentError, match="names the workspace itself"):
            history.user_path(ws, path)
