"""Browsing history without a kernel: log, show, diff, cat (the CLI end to
end), the ``.stepfs/layers`` tree through the overlay core, containment of
path arguments, and rollback refusals through the CLI."""

from __future__ import annotations

import json
import os

import pytest

from conftest import stepfs
from history_helpers import layer_tree, open_ws, read, write
from stepfs.overlayfs.core.errors import NotFound, ReadOnly
from stepfs.store import history, snapshot
from stepfs.store.errors import ContainmentError

CONTAINMENT, NO_SUCH_LAYER, NOTHING, CONFLICT, NO_SUCH_PATH = 10, 11, 6, 7, 14


@pytest.fixture
def history_ws(workspace):
    """A workspace with three layers: 1 adds, 2 edits/renames/binary, 3 deletes."""
    (workspace / "README").write_text("hello\n")
    ws, view = open_ws(workspace)
    view.mkdir("/src", 0o755)
    write(view, "/src/app.py", b"def f():\n    return 1\n")
    write(view, "/src/util.py", b"X = 1\n")
    write(view, "/blob.bin", b"\0\1\2")
    view.commit(message="add app", meta={"tool_call": "7"})
    write(view, "/src/app.py", b"def f():\n    return 2\n\ndef g():\n    pass\n")
    view.rename("/src/util.py", "/src/helpers.py")
    write(view, "/blob.bin", b"\0\1\2\3")
    view.chmod("/README", 0o600)
    view.commit(message="edit")
    view.unlink("/blob.bin")
    view.commit(message="drop blob")
    ws.close()
    return workspace


# -- log / show / diff / cat ----------------------------------------------------------------


def test_log_shows_lines_and_metadata(history_ws):
    r = stepfs("log", history_ws, "--json")
    assert r.returncode == 0, r.stderr
    layers = {x["number"]: x for x in json.loads(r.stdout)["layers"]}
    assert sorted(layers) == [0, 1, 2, 3]
    assert layers[1]["meta"] == {"tool_call": "7"} and layers[1]["message"] == "add app"
    assert (layers[1]["lines_added"], layers[1]["lines_removed"], layers[1]["added"]) == (3, 0, 4)
    assert (layers[2]["lines_added"], layers[2]["lines_removed"]) == (4, 1)
    assert layers[2]["renamed"] == 1 and layers[3]["deleted"] == 1
    text = stepfs("log", history_ws).stdout.decode()
    assert "tool_call=7" in text and "lines +4 -1" in text


def test_show_card_and_patch(history_ws):
    r = stepfs("show", history_ws, "2", "--json", "--patch")
    assert r.returncode == 0, r.stderr
    card = json.loads(r.stdout)
    files = {f["path"]: f for f in card["files"]}
    assert files["src/helpers.py"]["op"] == "renamed" and files["src/helpers.py"]["from"] == "src/util.py"
    assert files["blob.bin"]["binary"] is True and files["blob.bin"]["bytes_after"] == 4
    assert files["README"]["op"] == "mode" and files["README"]["after"]["mode"] == 0o600
    assert files["src/app.py"]["lines_added"] == 4 and files["src/app.py"]["lines_removed"] == 1
    patch = card["patch"]
    assert "-    return 1\n+    return 2\n" in patch
    assert "rename from src/util.py\nrename to src/helpers.py\n" in patch
    assert "Binary files a/blob.bin and b/blob.bin differ" in patch
    assert "old mode 100644\nnew mode 100600\n" in patch
    text = stepfs("show", history_ws, "2", "--patch").stdout.decode()
    assert "renamed   src/util.py -> src/helpers.py" in text and "@@" in text


def test_diff_between_layers_with_paths(history_ws):
    r = stepfs("diff", history_ws, "3", "0")
    assert r.returncode == 0, r.stderr
    out = r.stdout.decode()
    assert "new file mode 100644\n--- /dev/null\n+++ b/src/helpers.py" in out  # 0 -> 3: util.py never existed at 0
    assert "blob.bin" not in out  # added in 1, deleted in 3: no difference
    only = stepfs("diff", history_ws, "2", "--", "src/app.py").stdout.decode()
    assert "src/app.py" in only and "helpers" not in only and "README" not in only
    rev = json.loads(stepfs("diff", history_ws, "1", "2", "--json").stdout)
    ops = {c["path"]: c["op"] for c in rev["changes"]}
    assert ops["src/util.py"] == "renamed" and rev["old"] == 2 and rev["new"] == 1
    assert stepfs("diff", history_ws, "9").returncode == NO_SUCH_LAYER
    assert stepfs("diff", history_ws, "2", "--", "../etc").returncode == CONTAINMENT


def test_cat_reads_every_layer(history_ws):
    assert stepfs("cat", history_ws, "1", "src/app.py").stdout == b"def f():\n    return 1\n"
    assert stepfs("cat", history_ws, "2", "src/helpers.py").stdout == b"X = 1\n"
    assert stepfs("cat", history_ws, "0", "README").stdout == b"hello\n"  # never committed by a layer's after
    assert stepfs("cat", history_ws, "2", str(history_ws / "blob.bin")).stdout == b"\0\1\2\3"
    gone = stepfs("cat", history_ws, "3", "blob.bin")
    assert gone.returncode == NO_SUCH_PATH and b"did not exist as of layer 3" in gone.stderr
    assert stepfs("cat", history_ws, "1", "src").returncode == NO_SUCH_PATH
    missing = stepfs("cat", history_ws, "12", "README")
    assert missing.returncode == NO_SUCH_LAYER and missing.stderr.count(b"\n") == 1


# -- containment ----------------------------------------------------------------------------


def test_path_arguments_stay_in_the_workspace(history_ws, tmp_path):
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret").write_text("secret")
    os.symlink(str(tmp_path / "outside"), history_ws / "out")
    os.symlink("../outside", history_ws / "rel_out")
    os.symlink(".stepfs", history_ws / "store_link")
    os.symlink("src", history_ws / "src_link")
    cases = {
        str(tmp_path / "outside" / "secret"): "outside the workspace",
        "../outside/secret": "leaves the workspace",
        "src/../../outside/secret": "leaves the workspace",
        "out/secret": "points outside",
        "rel_out/secret": "points outside",
        "README/x": "is a file and not a directory",
        ".stepfs/store.db": "inside the stepfs store",
        "./.stepfs/store.db": "inside the stepfs store",
        "store_link/store.db": "inside the stepfs store",
    }
    commands = [lambda p: ["cat", history_ws, "1", p], lambda p: ["diff", history_ws, "2", "--", p],
                lambda p: ["rollback", history_ws, "1", "--path", p]]
    for i, (path, words) in enumerate(cases.items()):
        # Each command resolves paths with the same library call (checked
        # for every case below); the CLI round trip takes turns.
        argv = commands[i % len(commands)](path)
        r = stepfs(*argv)
        err = r.stderr.decode()
        assert r.returncode == CONTAINMENT, (argv, err)
        assert words in err and err.count("\n") == 1, (argv, err)
    from stepfs.store.workspace import Workspace

    with Workspace.open(str(history_ws)) as ws:
        for path, words in cases.items():
            for allow_root in (False, True):
                with pytest.raises(ContainmentError, match=words):
                    history.user_path(ws, path, allow_root=allow_root)
    # A symlink that stays inside is followed.
    assert stepfs("cat", history_ws, "1", "src_link/app.py").stdout == b"def f():\n    return 1\n"


def test_user_path_library(history_ws):
    from stepfs.store.workspace import Workspace

    with Workspace.open(str(history_ws)) as ws:
        assert history.user_path(ws, "src//./app.py") == b"src/app.py"
        assert history.user_path(ws, str(history_ws) + "/src/app.py") == b"src/app.py"
        assert history.user_path(ws, "/mnt/agent/src", mountpoint="/mnt/agent") == b"src"
        assert history.user_path(ws, "gone/dir/file") == b"gone/dir/file"  # only in history: literal
        assert history.user_path(ws, ".", allow_root=True) == b"."
        with pytest.raises(ContainmentError):
            history.user_path(ws, ".")


def test_rollback_refusals_through_the_cli(history_ws):
    head = stepfs("rollback", history_ws, "3")
    assert head.returncode == NOTHING and b"head already" in head.stderr
    assert stepfs("rollback", history_ws, "42").returncode == NO_SUCH_LAYER
    assert stepfs("rollback", history_ws, "x").returncode == NO_SUCH_LAYER
    (history_ws / "src" / "app.py").write_text("changed outside\n")
    r = stepfs("rollback", history_ws, "1", "--json")
    assert r.returncode == CONFLICT, r.stderr
    assert "src/app.py" in r.stderr.decode() and "--skip-conflicts" in r.stderr.decode()
    assert (history_ws / "src" / "app.py").read_text() == "changed outside\n"
    dry = stepfs("rollback", history_ws, "1", "--dry-run", "--skip-conflicts", "--json")
    assert dry.returncode == 0, dry.stderr
    res = json.loads(dry.stdout)
    assert res["layer"] is None and res["skipped"] == [{"path": "src/app.py", "reason": res["skipped"][0]["reason"]}]
    files = {f["path"]: f for f in res["card"]["files"]}
    assert files["src/util.py"]["op"] == "renamed" and files["src/util.py"]["from"] == "src/helpers.py"
    assert files["blob.bin"]["op"] == "added"
    assert not (history_ws / "blob.bin").exists()  # dry run changed nothing
    done = stepfs("rollback", history_ws, "1", "--skip-conflicts")
    assert done.returncode == 0, done.stderr
    assert (history_ws / "blob.bin").read_bytes() == b"\0\1\2"
    assert (history_ws / "src" / "app.py").read_text() == "changed outside\n"
    assert b"rolled back to layer 1 as layer 4" in done.stdout


def test_rollback_commits_staged_changes_first(history_ws):
    from stepfs.store.workspace import Workspace

    ws, view = open_ws(history_ws)
    write(view, "/staged.txt", b"not committed yet\n")
    ws.close()
    r = stepfs("rollback", history_ws, "3", "--json")  # 3 is the head, but the staged file is not in it
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["committed_first"] == [4] and res["layer"] == 5
    assert not (history_ws / "staged.txt").exists()
    with Workspace.open(str(history_ws)) as ws:
        assert history.file_bytes(ws, 4, "staged.txt") == b"not committed yet\n"  # kept in history


# -- the layers tree (kernel-free, through the view) -------------------------------------------------


def test_layers_tree_is_read_only_and_complete(history_ws):
    ws, view = open_ws(history_ws)
    names = [n for n, _k, _i in view.readdir("/.stepfs/layers")[2:]]
    assert names == ["0", "1", "2", "3", "latest"]
    assert view.readlink("/.stepfs/layers/latest") == "3"
    t1 = layer_tree(view, 1)
    assert t1[b"src/util.py"] == ("file", 0o644, b"X = 1\n") and t1[b"README"] == ("file", 0o644, b"hello\n")
    assert t1[b"blob.bin"][2] == b"\0\1\2"
    t3 = layer_tree(view, 3)
    assert b"blob.bin" not in t3 and t3[b"README"][1] == 0o600 and b"src/helpers.py" in t3
    assert read(view, "/.stepfs/layers/0/README") == b"hello\n"
    for bad in ("/.stepfs/layers/9", "/.stepfs/layers/01", "/.stepfs/layers/1/nope", "/.stepfs/layers/x"):
        with pytest.raises(NotFound):
            view.getattr(bad)
    f = "/.stepfs/layers/1/src/app.py"
    for change in (lambda: view.open(f, os.O_WRONLY), lambda: view.open(f, os.O_RDWR),
                   lambda: view.create("/.stepfs/layers/1/new", 0o644), lambda: view.unlink(f),
                   lambda: view.mkdir("/.stepfs/layers/1/d", 0o755), lambda: view.rmdir("/.stepfs/layers/1/src"),
                   lambda: view.rename(f, "/x"), lambda: view.rename("/README", "/.stepfs/layers/1/R"),
                   lambda: view.chmod(f, 0o777), lambda: view.truncate(f, 0), lambda: view.link("/l", f),
                   lambda: view.symlink("/.stepfs/layers/1/s", "x"), lambda: view.utimens(f, None)):
        with pytest.raises(ReadOnly):
            change()
    ws.close()


def test_listing_a_layer_directory_reads_only_that_directory(workspace, monkeypatch):
    (workspace / "big").mkdir()
    for i in range(50):
        (workspace / "big" / f"f{i}").write_text("x")
    ws, view = open_ws(workspace)
    view.mkdir("/small", 0o755)
    write(view, "/small/a", b"a")
    for i in range(5):
        write(view, f"/big/f{i}", b"changed")
    view.commit()
    write(view, "/small/b", b"b")
    view.unlink("/small/a")
    view.commit()

    listed, rows_read = [], []
    real_listdir, real_rows = ws.root.listdir, snapshot.rows_under
    monkeypatch.setattr(ws.root, "listdir", lambda p: listed.append(p) or real_listdir(p))
    monkeypatch.setattr(snapshot, "rows_under",
                        lambda conn, path: rows_read.extend(real_rows(conn, path)) or real_rows(conn, path))
    names = [n for n, _k, _i in view.readdir("/.stepfs/layers/1/small")[2:]]
    assert names == ["a"]
    assert b"big" not in listed and all(p.startswith(b"small") for p in listed)
    assert rows_read and all(bytes(r.path).startswith(b"small") for r in rows_read)
    ws.close()
