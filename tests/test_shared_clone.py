"""``stepfs clone`` (store/shared/cloning.py, stateread.py) on a real server
(tests/pgserver.py) and on an SQLite history file: the tree is built in a
sibling directory and published by one rename, so a clone stopped or
killed at any point leaves no workspace, a finished one a workspace whose
store verifies and holds the bytes its files hold, a path of the history
never leaves the tree, and a target written meanwhile is never touched."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from conftest import manifest
from stepfs.store import durable, verify
from stepfs.store.errors import CorruptObject, HistoryError, WorkspaceError
from stepfs.store.layers import entries as load_entries
from stepfs.store.shared import cloning, sync, tables as T
from stepfs.store.shared.remote import Remote
from stepfs.store.shared.url import parse
from stepfs.store.workspace import Workspace
from test_shared_history import _entry, _record, _ws
from stepfs.overlayfs.client import shared as client


def _rich(root: Path) -> Path:
    """A tree with what a clone must carry over: modes, an executable, an
    empty file, a symlink, a nested and a read-only directory."""
    a = _ws(root, {"README": b"hello\n", "src/main.py": b"print(1)\n", "src/deep/x/y.txt": b"y" * 5000,
                   "empty": b"", "ro/inside.txt": b"kept\n"})
    os.chmod(a / "src/main.py", 0o755)
    os.chmod(a / "README", 0o444)
    os.chmod(a / "empty", 0o666)  # more than the umask lets a new file have
    os.symlink("src/main.py", a / "link")
    os.chmod(a / "ro", 0o555)
    return a


def _siblings(parent: Path) -> list[str]:
    return sorted(n for n in os.listdir(parent) if ".stepfs-clone-" in n)


def test_clone_equals_the_workspace_and_its_store_verifies(history_url, tmp_path):
    a = _rich(tmp_path / "a")
    client.attach(str(a), history_url)
    os.mkdir(tmp_path / "empty-target", 0o750)
    for target in (tmp_path / "new", tmp_path / "empty-target", tmp_path / "up" / "down" / ("n" * 240)):
        path, number, local = sync.clone(parse(history_url), str(target))
        assert path == str(target) and number == 0
        assert manifest(target) == manifest(a)
        with Workspace.open(str(target)) as ws:
            report = verify.verify(ws)
            assert report.ok, report
            with ws.db.read() as conn:
                got = {e.path: e.after for e in load_entries(conn, local)}
                # the store holds what each file holds
                assert ws.objects.read_all(conn, got[b"src/deep/x/y.txt"].oid) == b"y" * 5000
                assert got[b"link"].kind == "symlink" and got[b"ro"].mode == 0o555
    assert oct(os.stat(tmp_path / "empty-target").st_mode & 0o777) == oct(0o750)  # the target's own mode kept
    os.mkdir(tmp_path / "real")
    os.symlink(tmp_path / "real", tmp_path / "via-link")
    path, _, _ = sync.clone(parse(history_url), str(tmp_path / "via-link"))
    assert path == str(tmp_path / "real") and os.path.islink(tmp_path / "via-link")
    assert manifest(tmp_path / "via-link") == manifest(a)
    assert _siblings(tmp_path) == [] and _siblings(tmp_path / "up" / "down") == []
    assert os.umask(0o022) == 0o022  # the clone left the process's umask as it was


def test_a_clone_never_sets_the_process_umask_and_keeps_modes_under_a_strict_one(history_url, tmp_path,
                                                                                 monkeypatch):
    """A harness calling ``sync.clone`` while its other threads make files
    must not see their umask change; the clone's files keep their modes
    whatever the umask."""
    a = _rich(tmp_path / "a")
    client.attach(str(a), history_url)

    def no_umask(mask):
        raise AssertionError("the clone set the process umask")

    old = os.umask(0o077)
    try:
        monkeypatch.setattr(os, "umask", no_umask)
        sync.clone(parse(history_url), str(tmp_path / "new"))
    finally:
        monkeypatch.undo()
        os.umask(old)
    assert manifest(tmp_path / "new") == manifest(a)  # 0o666, 0o755 and 0o444 files, a 0o555 directory


def test_a_sparse_file_stays_sparse_in_the_clone(history_url, tmp_path):
    """An all-zero stretch of a file comes out as a hole, not as written
    zeros (a clone of a workspace with a sparse image must not fill the
    disk), and the bytes are the same."""
    a = _ws(tmp_path / "a", {"README": b"hi\n"})
    with open(a / "image", "wb") as f:
        f.truncate(8 << 20)
        f.seek(3 << 20)
        f.write(b"data in the middle")
    with open(a / "ends-in-zeros", "wb") as f:
        f.write(b"head")
        f.truncate(1 << 20)
    client.attach(str(a), history_url)
    sync.clone(parse(history_url), str(tmp_path / "new"))
    assert manifest(tmp_path / "new") == manifest(a)
    for name, size in (("image", 8 << 20), ("ends-in-zeros", 1 << 20)):
        st = os.stat(tmp_path / "new" / name)
        assert st.st_size == size
        assert st.st_blocks * 512 <= 256 * 1024, (name, st.st_blocks)  # written zeros would be the whole size


def test_a_clone_cut_before_its_rename_leaves_no_workspace(history_url, tmp_path):
    a = _rich(tmp_path / "a")
    client.attach(str(a), history_url)

    class Fail:
        def before(self, op, args):
            if op == "syncfs":
                raise OSError(5, "Input/output error")

        def after(self, op, args):
            pass

    os.mkdir(tmp_path / "t")
    with durable.installed(Fail()), pytest.raises(OSError):
        sync.clone(parse(history_url), str(tmp_path / "t"))
    assert os.listdir(tmp_path / "t") == [] and _siblings(tmp_path) == []
    with durable.installed(Fail()), pytest.raises(OSError):
        sync.clone(parse(history_url), str(tmp_path / "u"))
    assert not os.path.lexists(tmp_path / "u")
    sync.clone(parse(history_url), str(tmp_path / "t"))  # then it works
    assert manifest(tmp_path / "t") == manifest(a)


def test_a_clone_killed_at_its_rename_leaves_no_workspace_and_can_be_run_again(pg_url, tmp_path):
    a = _rich(tmp_path / "a")
    client.attach(str(a), pg_url)

    class Kill:
        def before(self, op, args):
            if op == "rename":
                os.kill(os.getpid(), signal.SIGKILL)

        def after(self, op, args):
            pass

    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child dies at the hook)
        try:
            with durable.installed(Kill()):
                sync.clone(parse(pg_url), str(tmp_path / "t"))
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    assert not os.path.lexists(tmp_path / "t")
    left = _siblings(tmp_path)
    assert len(left) == 1 and manifest(tmp_path / left[0]) == manifest(a)  # whole, but not a workspace anyone sees
    path, _, _ = sync.clone(parse(pg_url), str(tmp_path / "t"))
    assert manifest(Path(path)) == manifest(a)
    assert _siblings(tmp_path) == []  # the dead clone's sibling, removed by the next clone into t


def test_a_clone_in_progress_keeps_its_sibling_from_another_clone_s_sweep(history_url, tmp_path):
    a = _rich(tmp_path / "a")
    client.attach(str(a), history_url)
    seen = {}

    class Meanwhile:
        def before(self, op, args):
            if op == "syncfs" and not seen:
                seen["siblings"] = _siblings(tmp_path)
                sync.clone(parse(history_url), str(tmp_path / "t"))  # a second clone into t, which sweeps
                seen["kept"] = set(seen["siblings"]) <= set(_siblings(tmp_path))

        def after(self, op, args):
            pass

    with durable.installed(Meanwhile()), pytest.raises(WorkspaceError, match="not an empty directory any more"):
        sync.clone(parse(history_url), str(tmp_path / "t"))
    assert len(seen["siblings"]) == 1 and seen["kept"]  # the first clone's sibling survived the second's sweep
    assert manifest(tmp_path / "t") == manifest(a) and _siblings(tmp_path) == []
    with Workspace.open(str(tmp_path / "t")) as ws:
        assert verify.verify(ws).ok


def test_a_target_written_meanwhile_is_left_alone_and_the_clone_fails_clearly(history_url, tmp_path):
    a = _rich(tmp_path / "a")
    client.attach(str(a), history_url)
    target = tmp_path / "t"
    os.mkdir(target)

    class Race:
        def before(self, op, args):
            if op == "syncfs":
                (target / "theirs.txt").write_bytes(b"another clone's\n")

        def after(self, op, args):
            pass

    with durable.installed(Race()), pytest.raises(WorkspaceError, match="not an empty directory any more"):
        sync.clone(parse(history_url), str(target))
    assert os.listdir(target) == ["theirs.txt"] and _siblings(tmp_path) == []
    with pytest.raises(WorkspaceError, match="not an empty directory"):
        sync.clone(parse(history_url), str(target))  # a second clone into it: refused up front


@pytest.mark.parametrize("bad", [b"../escape", b"ok/../../escape", b".stepfs/x", b"a//b", b"/abs"])
def test_a_path_of_the_history_never_leaves_the_tree(pg_url, tmp_path, bad):
    with Remote.open(parse(pg_url)) as r:
        link = {"after_kind": "symlink", "after_mode": 0o777, "after_target": b"t"}
        r.create(_record(0, "baseline"), [_entry(b"fine") | link, _entry(bad) | link])
    os.mkdir(tmp_path / "in")
    with pytest.raises(HistoryError, match="not a path inside a workspace"):
        sync.clone(parse(pg_url), str(tmp_path / "in" / "t"))
    assert os.listdir(tmp_path / "in") == [] and os.listdir(tmp_path) == ["in"]


def test_a_symlink_of_the_history_is_never_followed_by_the_paths_below_it(pg_url, tmp_path):
    decoy = tmp_path / "decoy"
    decoy.mkdir()
    with Remote.open(parse(pg_url)) as r:
        r.create(_record(0, "baseline"), [
            _entry(b"a") | {"after_kind": "symlink", "after_mode": 0o777, "after_target": os.fsencode(decoy)},
            _entry(b"a/f") | {"after_kind": "symlink", "after_mode": 0o777, "after_target": b"planted"}])
    with pytest.raises(HistoryError, match="not a directory"):
        sync.clone(parse(pg_url), str(tmp_path / "t"))
    assert os.listdir(decoy) == [] and not os.path.lexists(tmp_path / "t") and _siblings(tmp_path) == []


def test_a_damaged_chunk_fails_the_clone_with_nothing_made(pg_url, tmp_path):
    a = _rich(tmp_path / "a")
    client.attach(str(a), pg_url)
    with Remote.open(parse(pg_url)) as r, r.tx() as conn:
        conn.execute(T.chunks.update().values(data=b"damaged"))
    with pytest.raises(CorruptObject):
        sync.clone(parse(pg_url), str(tmp_path / "t"))
    assert not os.path.lexists(tmp_path / "t") and _siblings(tmp_path) == []


def test_where_no_sibling_can_be_made_the_clone_is_written_in_place(history_url, tmp_path, monkeypatch):
    a = _rich(tmp_path / "a")
    client.attach(str(a), history_url)
    monkeypatch.setattr(cloning, "_make_staging", lambda directory: None)
    path, _, local = sync.clone(parse(history_url), str(tmp_path / "t"))
    assert manifest(Path(path)) == manifest(a)
    with Workspace.open(path) as ws:
        assert verify.verify(ws).ok


def test_a_clone_into_the_current_directory_fills_it_in_place(history_url, tmp_path, monkeypatch):
    # 'mkdir proj && cd proj && stepfs clone URL .': replacing the directory
    # by a rename would leave the caller's shell in the empty one it replaced.
    a = _rich(tmp_path / "a")
    client.attach(str(a), history_url)
    here = tmp_path / "proj"
    here.mkdir()
    before = os.stat(here).st_ino
    monkeypatch.chdir(here)
    path, _, _ = sync.clone(parse(history_url), ".")
    assert path == str(here) and os.stat(".").st_ino == before == os.stat(here).st_ino
    assert manifest(Path(".")) == manifest(a)
    with Workspace.open(path) as ws:
        assert verify.verify(ws).ok
