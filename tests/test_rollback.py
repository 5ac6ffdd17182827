"""Rollback without a kernel: the store API and the overlay core.

The property test drives random agent steps through ``Overlay`` and checks
that a rollback to any layer reproduces that layer's snapshot exactly, that
rolling back to the pre-rollback head undoes it, and that the layer's
``.stepfs/layers`` tree (served by the view's MetaTree) equals the snapshot.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import manifest
from history_helpers import layer_tree, open_ws, read, write
from stepfs.overlayfs.core.errors import ViewError
from stepfs.store import publish, rollback
from stepfs.store.errors import CommitConflict, NoSuchLayer, NothingToCommit, NothingToRollBack
from stepfs.store.layers import head


def commit(view, message="") -> int:
    return view.commit(message=message)


# -- basic semantics -----------------------------------------------------------------


def test_rollback_restores_and_is_undoable(workspace):
    (workspace / "keep.txt").write_text("untouched\n")
    ws, view = open_ws(workspace)
    write(view, "/a.txt", b"one\n")
    view.mkdir("/d", 0o755)
    write(view, "/d/x", b"x\n", mode=0o600)
    n1 = commit(view)
    snap1 = manifest(workspace)
    write(view, "/a.txt", b"two\n")
    view.rename("/d", "/e")
    view.symlink("/link", "a.txt")
    view.chmod("/e/x", 0o755)
    n2 = commit(view)
    snap2 = manifest(workspace)

    res = rollback.rollback(ws, n1)
    assert res.layer == n2 + 1 and res.head == n2
    assert manifest(workspace) == snap1
    assert res.card["message"] == f"rollback to {n1}" and res.card["kind"] == "rollback"

    undo = rollback.rollback(ws, n2)
    assert manifest(workspace) == snap2
    assert undo.layer == res.layer + 1
    ws.close()


def test_rollback_errors(workspace):
    ws, view = open_ws(workspace)
    write(view, "/a", b"1")
    n = commit(view)
    with pytest.raises(NothingToRollBack, match="head already"):
        rollback.rollback(ws, n)
    with pytest.raises(NoSuchLayer):
        rollback.rollback(ws, n + 5)
    write(view, "/a", b"2")
    commit(view)
    write(view, "/a", b"1")
    commit(view)  # back to the content of layer n
    with pytest.raises(NothingToRollBack, match="already holds"):
        rollback.rollback(ws, n)
    ws.close()


def test_cas_conflict_keeps_outside_change(workspace):
    ws, view = open_ws(workspace)
    write(view, "/a", b"v1\n")
    write(view, "/b", b"b1\n")
    n1 = commit(view)
    write(view, "/a", b"v2\n")
    write(view, "/b", b"b2\n")
    commit(view)
    (workspace / "a").write_bytes(b"edited outside\n")  # after the last layer, not through stepfs

    with pytest.raises(CommitConflict) as err:
        rollback.rollback(ws, n1)
    assert err.value.paths == ["a"]
    assert (workspace / "a").read_bytes() == b"edited outside\n"
    assert (workspace / "b").read_bytes() == b"b2\n"  # refused as a whole

    dry = rollback.rollback(ws, n1, dry_run=True, skip_conflicts=True)
    assert [f["path"] for f in dry.card["files"]] == ["b"] and dry.layer is None
    assert (workspace / "b").read_bytes() == b"b2\n"

    res = rollback.rollback(ws, n1, skip_conflicts=True)
    assert [c.path for c in res.skipped] == [b"a"]
    assert (workspace / "a").read_bytes() == b"edited outside\n"
    assert (workspace / "b").read_bytes() == b"b1\n"
    ws.close()


def test_outside_file_in_directory_to_remove_is_a_conflict(workspace):
    ws, view = open_ws(workspace)
    n0 = commit_empty(ws)
    view.mkdir("/new", 0o755)
    write(view, "/new/f", b"f")
    commit(view)
    (workspace / "new" / "outside").write_text("keep me")
    with pytest.raises(CommitConflict) as err:
        rollback.rollback(ws, n0)
    assert "new" in err.value.paths
    assert (workspace / "new" / "outside").read_text() == "keep me"
    assert (workspace / "new" / "f").exists()
    ws.close()


def commit_empty(ws) -> int:
    with ws.commit_lock():
        return publish.write_layer(ws, [], kind="step", message="", agent="", mount="", meta=None, consume_step=None)


def test_untouched_and_unchanged_files_keep_mtime_and_inode(workspace):
    (workspace / "old.txt").write_text("old\n")
    os.utime(workspace / "old.txt", ns=(10**18, 10**18))
    ws, view = open_ws(workspace)
    write(view, "/same.txt", b"same\n")
    write(view, "/other.txt", b"1\n")
    n1 = commit(view)
    os.utime(workspace / "same.txt", ns=(2 * 10**18, 2 * 10**18))  # not a content change
    read(view, "/same.txt")  # the outside utime changed its version token: observe it again
    write(view, "/same.txt", b"changed\n")
    write(view, "/other.txt", b"2\n")
    commit(view)
    write(view, "/same.txt", b"same\n")  # back to what layer n1 had
    commit(view)
    before = {name: os.lstat(workspace / name) for name in ("old.txt", "same.txt")}

    res = rollback.rollback(ws, n1)
    assert [f["path"] for f in res.card["files"]] == ["other.txt"]
    for name, old in before.items():
        now = os.lstat(workspace / name)
        assert (now.st_mtime_ns, now.st_ino) == (old.st_mtime_ns, old.st_ino), name
    assert (workspace / "other.txt").read_bytes() == b"1\n"
    ws.close()


def test_rollback_of_one_path_brings_back_its_directory(workspace):
    ws, view = open_ws(workspace)
    view.mkdir("/src", 0o750)
    write(view, "/src/app.py", b"print(1)\n")
    write(view, "/top", b"t1")
    n1 = commit(view)
    view.unlink("/src/app.py")
    view.rmdir("/src")
    write(view, "/top", b"t2")
    commit(view)
    res = rollback.rollback(ws, n1, [b"src/app.py"])
    assert sorted(f["path"] for f in res.card["files"]) == ["src", "src/app.py"]
    assert (workspace / "src" / "app.py").read_bytes() == b"print(1)\n"
    assert (workspace / "src").stat().st_mode & 0o777 == 0o750
    assert (workspace / "top").read_bytes() == b"t2"  # not asked for
    ws.close()


def test_view_forgets_clean_copies_after_a_rollback(workspace):
    ws, view = open_ws(workspace)
    write(view, "/f", b"one")
    n1 = commit(view)
    write(view, "/f", b"two")
    commit(view)
    fh = view.open("/f", os.O_RDWR)  # a clean copy-up held open across the rollback
    res = rollback.rollback(ws, n1)
    # A new open never gets an outdated clean copy (its version token moved on)...
    assert read(view, "/f") == b"one"
    view.forget(["/" + os.fsdecode(p) for p in res.paths])  # ...and the daemon drops such copies
    assert read(view, "/f") == b"one"
    assert view.read(fh, 10, 0) == b"two"  # an open descriptor keeps its file, as after a rename over it
    view.release(fh)
    assert read(view, "/f") == b"one"
    ws.close()


def test_pending_rollback_layer_is_rolled_forward(workspace, monkeypatch):
    ws, view = open_ws(workspace)
    write(view, "/a", b"1")
    view.mkdir("/d", 0o755)
    write(view, "/d/f", b"f1")
    n1 = commit(view)
    snap1 = manifest(workspace)
    write(view, "/a", b"2")
    view.unlink("/d/f")
    view.rmdir("/d")
    write(view, "/b", b"new")
    commit(view)

    real_switch = publish._switch

    class Crash(Exception):
        pass

    def crash_after_first(ws_, number, entries, **_options):
        real_switch(ws_, number, entries[:1])  # part of the layer is on disk, then "power loss"
        raise Crash()

    monkeypatch.setattr(publish, "_switch", crash_after_first)
    with pytest.raises(Crash):
        rollback.rollback(ws, n1)
    monkeypatch.undo()
    with ws.db.read() as conn:
        assert head(conn) == n1 + 1  # the rollback layer is pending, not the head
    assert publish.recover(ws) == [n1 + 2]
    assert manifest(workspace) == snap1
    ws.close()


def test_crash_before_intent_leaves_the_old_state(workspace, monkeypatch):
    ws, view = open_ws(workspace)
    write(view, "/a", b"1")
    n1 = commit(view)
    write(view, "/a", b"2")
    commit(view)
    snap = manifest(workspace)

    def crash(*_a, **_k):
        raise OSError("disk gone")

    monkeypatch.setattr(publish, "write_layer", crash)
    with pytest.raises(OSError):
        rollback.rollback(ws, n1)
    monkeypatch.undo()
    assert publish.recover(ws) == []
    assert manifest(workspace) == snap
    ws.close()


# -- the property ------------------------------------------------------------------------

NAMES = ["a", "b", "c", "dd"]
OPS = ["create", "write", "append", "truncate", "rename_file", "rename_dir", "delete", "mkdir", "rmdir",
       "symlink", "chmod", "link"]

op_strategy = st.tuples(
    st.sampled_from(OPS), st.integers(0, 10**6), st.integers(0, 10**6),
    st.one_of(st.binary(max_size=40), st.text("ab\n", max_size=40).map(str.encode)),
)
steps_strategy = st.lists(st.lists(op_strategy, min_size=1, max_size=3), min_size=1, max_size=50)


def _walk(view) -> tuple[list[str], list[str], list[str]]:
    files, dirs, links = [], ["/"], []
    todo = ["/"]
    while todo:
        d = todo.pop()
        for name, _k, _i in view.readdir(d)[2:]:
            p = (d if d != "/" else "") + "/" + name
            kind = view.getattr(p)["st_mode"] & 0o170000
            if kind == 0o040000:
                dirs.append(p)
                todo.append(p)
            elif kind == 0o120000:
                links.append(p)
            else:
                files.append(p)
    return sorted(files), sorted(dirs), sorted(links)


def _apply(view, op: str, i: int, j: int, data: bytes) -> None:
    files, dirs, links = _walk(view)

    def pick(items):
        return items[i % len(items)] if items else None

    def new_name(k: int) -> str:
        d = dirs[k % len(dirs)]
        return (d if d != "/" else "") + "/" + NAMES[(k // 7) % len(NAMES)]

    try:
        if op == "create":
            write(view, new_name(i), data, mode=0o644 if j % 2 else 0o600)
        elif op == "write" and files:
            write(view, pick(files), data)
        elif op == "append" and files:
            write(view, pick(files), data, append=True)
        elif op == "truncate" and files:
            view.truncate(pick(files), j % 50)
        elif op == "rename_file" and (files or links):
            view.rename(pick(files + links), new_name(j))
        elif op == "rename_dir" and len(dirs) > 1:
            view.rename(pick(dirs[1:]), new_name(j))
        elif op == "delete" and (files or links):
            view.unlink(pick(files + links))
        elif op == "mkdir":
            view.mkdir(new_name(i), 0o755 if j % 2 else 0o700)
        elif op == "rmdir" and len(dirs) > 1:
            view.rmdir(pick(dirs[1:]))
        elif op == "symlink":
            view.symlink(new_name(i), ["a", "../x", "/etc/passwd", "dd/a"][j % 4])
        elif op == "chmod" and (files or len(dirs) > 1):
            view.chmod(pick(files + dirs[1:]), [0o600, 0o644, 0o755, 0o700][j % 4])
        elif op == "link" and files:
            view.link(new_name(j), pick(files))  # hard links: where supported
    except ViewError:
        pass  # exists, not empty, into itself, unsupported: the agent's command failed


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=steps_strategy, pick=st.integers(0, 10**6), data=st.binary(max_size=20))
def test_rollback_to_any_layer_property(steps, pick, data):
    tmp = Path(tempfile.mkdtemp(prefix="stepfs-prop-"))
    try:
        ws_path = tmp / "ws"
        ws_path.mkdir()
        (ws_path / "pre").mkdir()
        (ws_path / "pre" / "old.txt").write_bytes(b"from before the first mount\n" + data)
        (ws_path / "a").write_bytes(b"top\n")
        ws, view = open_ws(ws_path)
        snapshots = {0: manifest(ws_path)}
        for ops in steps:
            for op in ops:
                _apply(view, *op)
            try:
                number = commit(view)
            except NothingToCommit:
                continue
            snapshots[number] = manifest(ws_path)
        head = max(snapshots)
        k = sorted(snapshots)[pick % len(snapshots)]

        assert layer_tree(view, k) == snapshots[k]
        try:
            res = rollback.rollback(ws, k)
        except NothingToRollBack:
            assert snapshots[k] == snapshots[head]
            return
        assert manifest(ws_path) == snapshots[k]
        assert layer_tree(view, res.layer) == snapshots[k]
        assert layer_tree(view, k) == snapshots[k]

        undo = rollback.rollback(ws, head)
        assert manifest(ws_path) == snapshots[head]
        assert layer_tree(view, undo.layer) == snapshots[head]
        ws.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_rollback_restores_hard_links_as_links(workspace):
    ws, view = open_ws(workspace)
    write(view, "/a", b"shared\n")
    view.link("/b", "/a")
    view.mkdir("/d", 0o755)
    view.link("/d/c", "/a")
    n1 = commit(view)
    assert os.stat(workspace / "a").st_nlink == 3
    view.unlink("/a")
    view.unlink("/b")
    write(view, "/d/c", b"changed\n")
    commit(view)
    rollback.rollback(ws, n1)
    st = [os.stat(workspace / p) for p in ("a", "b", "d/c")]
    assert {s.st_ino for s in st} == {st[0].st_ino} and st[0].st_nlink == 3
    assert (workspace / "b").read_bytes() == b"shared\n"
    ws.close()
