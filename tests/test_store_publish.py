"""Commit protocol: plan, intent, apply, recovery (kernel-free tier).

Open steps are built by hand with ``store.staging`` and the object store,
exactly as the overlay writes them, then committed with
``publish.commit_step`` into a real workspace directory under tmp_path.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
from sqlalchemy import select, update

from conftest import manifest
from stepfs.store import entrylist, layers, publish, schema
from stepfs.store.errors import CommitConflict, NothingToCommit
from stepfs.store.layers import State
from store_kit import Stager, build_tree, expected_manifest, open_workspace, plain, rewrite_layer

BEFORE = {
    "README": ("file", 0o644, b"hello\n"),
    "src": ("dir", 0o755),
    "src/a.py": ("file", 0o644, b"print(1)\n"),
    "src/b.py": ("file", 0o644, b"print(2)\n"),
    "src/pkg": ("dir", 0o755),
    "src/pkg/c.py": ("file", 0o644, b"print(3)\n"),
    "link": ("symlink", "README"),
    "modedir": ("dir", 0o755),
    "modedir/kept": ("file", 0o600, b"kept\n"),
    "old": ("dir", 0o755),
    "old/x": ("file", 0o644, b"x\n"),
    "old/sub": ("dir", 0o700),
    "old/sub/y": ("file", 0o644, b"y\n"),
    "old/sub/ln": ("symlink", "../x"),
    "opq": ("dir", 0o755),
    "opq/hidden": ("file", 0o644, b"hidden\n"),
    "opq/deeper": ("dir", 0o755),
    "opq/deeper/z": ("file", 0o644, b"z\n"),
    "kind_f": ("file", 0o644, b"becomes a dir\n"),
    "kind_d": ("dir", 0o755),
    "kind_d/inner": ("file", 0o644, b"inner\n"),
    "kind_d/innerdir": ("dir", 0o755),
    "kind_d/innerdir/leaf": ("file", 0o644, b"leaf\n"),
    "untouched": ("file", 0o644, b"same\n"),
}

AFTER = {
    "README": ("file", 0o644, b"hello, world\n"),  # modified
    "new.txt": ("file", 0o640, b"brand new\n"),  # added
    "src": ("dir", 0o700),  # directory mode change
    "src/a.py": ("file", 0o644, b"print('one')\n"),  # modified
    "src/b.py": ("file", 0o755, b"print(2)\n"),  # mode change only
    "src/pkg": ("dir", 0o755),  # c.py deleted inside it
    "link": ("symlink", "src"),  # retargeted
    "ln2": ("symlink", "does/not/exist"),  # new dangling symlink
    "modedir": ("dir", 0o711),  # only its mode changes
    "modedir/kept": ("file", 0o600, b"kept\n"),
    "newdir": ("dir", 0o750),  # mkdir
    "newdir/f": ("file", 0o644, b"in a new dir\n"),
    "newdir/nested": ("dir", 0o755),
    "emptydir": ("dir", 0o755),  # empty directory
    # old/ deleted as a whole by one whiteout row
    "opq": ("dir", 0o755),  # opaque: replaces the workspace directory
    "opq/new": ("file", 0o644, b"only this\n"),
    "kind_f": ("dir", 0o755),  # file -> dir
    "kind_f/child": ("file", 0o644, b"child\n"),
    "kind_d": ("file", 0o644, b"was a dir\n"),  # dir -> file
    "untouched": ("file", 0o644, b"same\n"),
}


def stage_after(st: Stager) -> None:
    st.file("README", b"hello, world\n")
    st.file("new.txt", b"brand new\n", mode=0o640)
    st.dir("src", 0o700)
    st.file("src/a.py", b"print('one')\n")
    st.file("src/b.py", b"print(2)\n", mode=0o755)
    st.whiteout("src/pkg/c.py")
    st.symlink("link", "src")
    st.symlink("ln2", "does/not/exist")
    st.dir("modedir", 0o711)
    st.dir("newdir", 0o750, opaque=True)
    st.file("newdir/f", b"in a new dir\n")
    st.dir("newdir/nested", 0o755, opaque=True)
    st.dir("emptydir", 0o755, opaque=True)
    st.whiteout("old")
    st.dir("opq", 0o755, opaque=True)
    st.file("opq/new", b"only this\n")
    st.dir("kind_f", 0o755, opaque=True)
    st.file("kind_f/child", b"child\n")
    st.file("kind_d", b"was a dir\n")


@pytest.fixture
def ws(tmp_path):
    w = open_workspace(tmp_path / "ws", BEFORE)
    yield w
    w.close()


def tmp_files(ws) -> list[str]:
    return os.listdir(ws.tmp_dir)


def layer_rows(ws) -> list[tuple[int, str]]:
    with ws.db.read() as conn:
        return [tuple(r) for r in conn.execute(
            select(schema.layers.c.number, schema.layers.c.state).order_by(schema.layers.c.number))]


def oid_of(ws, data: bytes) -> str:
    with ws.db.write() as conn:
        return ws.objects.put_bytes(conn, data)


# -- the whole protocol ----------------------------------------------------------


def test_commit_publishes_every_kind_of_change(ws):
    st = Stager(ws)
    stage_after(st)
    number = publish.commit_step(ws, st.step, message="many things", agent="tester", mount="/m")
    assert number == 1
    assert manifest(ws.path) == expected_manifest(AFTER)
    assert layer_rows(ws) == [(0, "committed"), (1, "committed")]
    assert st.rows() == []
    assert tmp_files(ws) == []


def test_layer_entries_record_before_and_after(ws):
    st = Stager(ws)
    stage_after(st)
    number = publish.commit_step(ws, st.step)
    with ws.db.read() as conn:
        got = {e.path.decode(): e for e in layers.entries(conn, number)}
    deleted_by_whiteout = {"old", "old/x", "old/sub", "old/sub/y", "old/sub/ln"}
    hidden_by_opaque = {"opq/hidden", "opq/deeper", "opq/deeper/z"}
    below_kind_d = {"kind_d/inner", "kind_d/innerdir", "kind_d/innerdir/leaf"}
    changed = {
        "README", "new.txt", "src", "src/a.py", "src/b.py", "src/pkg/c.py", "link", "ln2", "modedir",
        "newdir", "newdir/f", "newdir/nested", "emptydir", "opq/new", "kind_f", "kind_f/child", "kind_d",
    }
    # "opq" keeps its kind and mode (only its content is replaced); nothing
    # untouched appears.
    assert set(got) == changed | deleted_by_whiteout | hidden_by_opaque | below_kind_d

    def file(data, mode=0o644):
        return State("file", mode, oid_of(ws, data))

    absent = State(None)
    expect = {
        "README": (file(b"hello\n"), file(b"hello, world\n")),
        "new.txt": (absent, file(b"brand new\n", 0o640)),
        "src": (State("dir", 0o755), State("dir", 0o700)),
        "src/b.py": (file(b"print(2)\n"), file(b"print(2)\n", 0o755)),
        "src/pkg/c.py": (file(b"print(3)\n"), absent),
        "link": (State("symlink", None, None, b"README"), State("symlink", None, None, b"src")),
        "ln2": (absent, State("symlink", None, None, b"does/not/exist")),
        "modedir": (State("dir", 0o755), State("dir", 0o711)),
        "emptydir": (absent, State("dir", 0o755)),
        "old": (State("dir", 0o755), absent),
        "old/sub": (State("dir", 0o700), absent),
        "old/sub/y": (file(b"y\n"), absent),
        "old/sub/ln": (State("symlink", None, None, b"../x"), absent),
        "opq/hidden": (file(b"hidden\n"), absent),
        "opq/deeper": (State("dir", 0o755), absent),
        "kind_f": (file(b"becomes a dir\n"), State("dir", 0o755)),
        "kind_d": (State("dir", 0o755), file(b"was a dir\n")),
        "kind_d/innerdir/leaf": (file(b"leaf\n"), absent),
    }
    for path, (before, after) in expect.items():
        assert (plain(got[path].before), plain(got[path].after)) == (before, after), path
    ops = {p: e.op for p, e in got.items()}
    assert ops["README"] == "modified" and ops["new.txt"] == "added" and ops["old/x"] == "deleted"
    assert ops["src/b.py"] == "mode" and ops["kind_d"] == "replaced"
    # Files get the staged mtime; directories and deletions record none.
    assert got["new.txt"].after_mtime_ns == 1_600_000_000_123_456_789
    assert os.stat(os.path.join(ws.path, "new.txt")).st_mtime_ns == 1_600_000_000_123_456_789
    assert got["old"].after_mtime_ns is None


def test_committed_layer_can_be_read_back_as_the_same_objects(ws):
    """Before-objects captured from disk read back as the old bytes."""
    st = Stager(ws)
    st.file("README", b"replaced\n")
    number = publish.commit_step(ws, st.step)
    with ws.db.read() as conn:
        (entry,) = layers.entries(conn, number)
        assert ws.objects.read_all(conn, entry.before.oid) == b"hello\n"
        assert ws.objects.read_all(conn, entry.after.oid) == b"replaced\n"


def test_only_the_staged_step_is_consumed(ws):
    mine, other = Stager(ws, "/m/one"), Stager(ws, "/m/two")
    mine.file("a-new-file", b"1")
    other.file("another-file", b"2")
    publish.commit_step(ws, mine.step)
    assert mine.rows() == []
    assert [r.path for r in other.rows()] == [b"another-file"]
    assert not os.path.exists(os.path.join(ws.path, "another-file"))


# -- conflicts and no-ops ----------------------------------------------------------


def test_changed_workspace_path_is_a_conflict_and_nothing_is_written(ws):
    st = Stager(ws)
    stage_after(st)
    before_rows = st.rows()
    # Someone outside the mount edits two staged paths after they were staged.
    with open(os.path.join(ws.path, "src", "a.py"), "ab") as f:
        f.write(b"# edited outside\n")
    with open(os.path.join(ws.path, "new.txt"), "wb") as f:
        f.write(b"created outside\n")
    disk = manifest(ws.path)
    with pytest.raises(CommitConflict) as info:
        publish.commit_step(ws, st.step)
    assert sorted(info.value.paths) == ["new.txt", "src/a.py"]
    assert "nothing was written" in str(info.value)
    assert manifest(ws.path) == disk
    assert st.rows() == before_rows  # the step is still open, intact
    assert layer_rows(ws) == [(0, "committed")]
    assert tmp_files(ws) == []

    number = publish.commit_step(ws, st.step, overwrite={b"src/a.py", b"new.txt"})
    assert number == 1
    assert manifest(ws.path) == expected_manifest(AFTER)
    with ws.db.read() as conn:
        got = {e.path: e for e in layers.entries(conn, number)}
    # The overwritten bytes are kept as the layer's before state.
    assert plain(got[b"new.txt"].before) == State("file", 0o644, oid_of(ws, b"created outside\n"))


def test_replaced_by_rename_is_a_conflict(ws):
    st = Stager(ws)
    st.file("README", b"mine\n")
    # Same size, new inode: an editor saving by rename.
    tmp = os.path.join(ws.path, "README.tmp")
    with open(tmp, "wb") as f:
        f.write(b"HELLO\n")
    os.rename(tmp, os.path.join(ws.path, "README"))
    with pytest.raises(CommitConflict) as info:
        publish.commit_step(ws, st.step)
    assert info.value.paths == ["README"]
    with open(os.path.join(ws.path, "README"), "rb") as f:
        assert f.read() == b"HELLO\n"


def test_deleted_staged_directory_is_a_conflict(ws):
    st = Stager(ws)
    st.dir("modedir", 0o700)
    os.unlink(os.path.join(ws.path, "modedir", "kept"))
    os.rmdir(os.path.join(ws.path, "modedir"))
    with pytest.raises(CommitConflict):
        publish.commit_step(ws, st.step)
    assert not os.path.exists(os.path.join(ws.path, "modedir"))


def test_rows_equal_to_the_workspace_are_nothing_to_commit(ws):
    st = Stager(ws)
    st.file("untouched", b"same\n")
    st.dir("src", 0o755)
    st.symlink("link", "README")
    st.whiteout("never-existed")
    disk = manifest(ws.path)
    with pytest.raises(NothingToCommit):
        publish.commit_step(ws, st.step)
    assert st.rows() == []  # no-op rows are dropped
    assert manifest(ws.path) == disk
    assert layer_rows(ws) == [(0, "committed")]
    # An empty step is nothing to commit too, unless asked for.
    with pytest.raises(NothingToCommit):
        publish.commit_step(ws, st.step)
    assert publish.commit_step(ws, st.step, allow_empty=True, message="marker") == 1
    assert layer_rows(ws) == [(0, "committed"), (1, "committed")]


def test_noop_rows_beside_real_changes_are_consumed_not_recorded(ws):
    st = Stager(ws)
    st.file("untouched", b"same\n")
    st.file("README", b"changed\n")
    number = publish.commit_step(ws, st.step)
    with ws.db.read() as conn:
        assert [e.path for e in layers.entries(conn, number)] == [b"README"]
    assert st.rows() == []


# -- crashes and recovery -----------------------------------------------------------


class Crash(Exception):
    """Stands for the process dying at this point."""


def crash_on_nth_file_write(monkeypatch, ws, n: int) -> None:
    real = ws.objects.write_to_fd
    calls = []

    def write_to_fd(conn, oid, fd):
        calls.append(oid)
        if len(calls) == n:
            raise Crash(f"killed while writing file {n}")
        return real(conn, oid, fd)

    monkeypatch.setattr(ws.objects, "write_to_fd", write_to_fd)


def crash_on_nth_rename(monkeypatch, n: int) -> None:
    """Die before the n-th temporary file is renamed into the workspace
    (past the commit point: the intent is recorded)."""
    real = publish.durable.rename
    calls = []

    def rename(*args, **kwargs):
        calls.append(args)
        if len(calls) == n:
            raise Crash(f"killed before rename {n}")
        return real(*args, **kwargs)

    monkeypatch.setattr(publish.durable, "rename", rename)


@pytest.mark.parametrize("n", [1, 3, 6])
def test_a_crash_while_writing_the_new_files_leaves_everything_as_it_was(ws, monkeypatch, n):
    st = Stager(ws)
    stage_after(st)
    rows, disk = st.rows(), manifest(ws.path)
    with monkeypatch.context() as m:
        crash_on_nth_file_write(m, ws, n)
        with pytest.raises(Crash):
            publish.commit_step(ws, st.step)
    # New files are written before the commit point: no layer, the step
    # intact, the workspace untouched; only temporary files are left.
    assert layer_rows(ws) == [(0, "committed")]
    assert st.rows() == rows
    assert manifest(ws.path) == disk
    assert publish.recover(ws) == []
    assert tmp_files(ws) == []
    assert publish.commit_step(ws, st.step) == 1
    assert manifest(ws.path) == expected_manifest(AFTER)


def crash_mid_publish(ws, monkeypatch, n: int) -> Stager:
    """Stage AFTER and kill the commit at its ``n``-th rename (after the
    intent: the layer is left pending); returns the stager."""
    st = Stager(ws)
    stage_after(st)
    with monkeypatch.context() as m:
        crash_on_nth_rename(m, n)
        with pytest.raises(Crash):
            publish.commit_step(ws, st.step)
    return st


@pytest.mark.parametrize("n", [1, 3, 6])
def test_recover_rolls_forward_a_layer_interrupted_mid_publish(ws, monkeypatch, n):
    st = crash_mid_publish(ws, monkeypatch, n)
    # The intent was recorded: the layer is pending, the workspace a mix of
    # old and new, temporary files left over; the step's rows are consumed
    # only when the layer is marked committed.
    assert layer_rows(ws) == [(0, "committed"), (1, "pending")]
    assert st.rows() != []
    assert manifest(ws.path) != expected_manifest(AFTER)
    assert tmp_files(ws) != []
    assert publish.recover(ws) == [1]
    assert manifest(ws.path) == expected_manifest(AFTER)
    assert layer_rows(ws) == [(0, "committed"), (1, "committed")]
    assert st.rows() == []
    assert tmp_files(ws) == []
    assert publish.recover(ws) == []  # nothing left to do


def test_empty_layer_finishes_a_pending_layer_first(ws, monkeypatch):
    """An empty step recorded while another commit's intent is pending
    rolls that commit forward first, so the empty layer comes after it."""
    crash_mid_publish(ws, monkeypatch, 1)
    assert layer_rows(ws)[-1] == (1, "pending")
    assert publish.record_empty(ws, message="marker") == 2
    assert layer_rows(ws) == [(0, "committed"), (1, "committed"), (2, "committed")]
    assert manifest(ws.path) == expected_manifest(AFTER)
    assert tmp_files(ws) == []


def test_a_commit_finishes_a_pending_layer_before_it_reads_its_rows(ws, monkeypatch):
    """The commit's first read sees the pending layer: recovery rolls it
    forward (consuming this very step's rows) before the rows are read, so
    the step has nothing left to commit."""
    st = crash_mid_publish(ws, monkeypatch, 3)
    with pytest.raises(NothingToCommit):
        publish.commit_step(ws, st.step)
    assert layer_rows(ws) == [(0, "committed"), (1, "committed")]
    assert manifest(ws.path) == expected_manifest(AFTER)
    assert st.rows() == [] and tmp_files(ws) == []


def test_a_commit_removes_the_temp_files_a_killed_commit_left(ws):
    junk = os.path.join(ws.tmp_dir, "L7-3")
    with open(junk, "wb") as f:
        f.write(b"half a file")
    st = Stager(ws)
    stage_after(st)
    assert publish.commit_step(ws, st.step) == 1
    assert tmp_files(ws) == [] and manifest(ws.path) == expected_manifest(AFTER)


def die_before_completion(*args, **kwargs):
    raise Crash("killed before the layer was marked committed")


def test_recover_after_publish_finished_but_before_marked_committed(ws, monkeypatch):
    st = Stager(ws)
    stage_after(st)
    with monkeypatch.context() as m:
        m.setattr(publish, "_complete", die_before_completion)
        with pytest.raises(Crash):
            publish.commit_step(ws, st.step)
    assert manifest(ws.path) == expected_manifest(AFTER)
    assert layer_rows(ws)[-1] == (1, "pending")
    assert publish.recover(ws) == [1]
    assert manifest(ws.path) == expected_manifest(AFTER)  # re-publishing is idempotent
    assert layer_rows(ws)[-1] == (1, "committed")


def test_crash_inside_the_intent_transaction_leaves_everything_as_it_was(ws, monkeypatch):
    st = Stager(ws)
    stage_after(st)
    rows, disk = st.rows(), manifest(ws.path)

    def die(*args):
        raise Crash("killed while writing the intent")

    with monkeypatch.context() as m:
        m.setattr(entrylist, "encode", die)
        with pytest.raises(Crash):
            publish.commit_step(ws, st.step)
    assert layer_rows(ws) == [(0, "committed")]
    assert st.rows() == rows
    assert manifest(ws.path) == disk
    assert publish.recover(ws) == []
    assert publish.commit_step(ws, st.step) == 1
    assert manifest(ws.path) == expected_manifest(AFTER)


def test_recover_voids_a_pending_layer_whose_intent_does_not_verify(ws, monkeypatch):
    st = Stager(ws)
    stage_after(st)
    rows = st.rows()
    with monkeypatch.context() as m:
        crash_on_nth_rename(m, 2)
        with pytest.raises(Crash):
            publish.commit_step(ws, st.step)
    half = manifest(ws.path)
    # Damage the recorded intent: one entry no longer matches the checksum.
    with ws.db.write() as conn:
        rewrite_layer(conn, 1, lambda es: [replace(e, after=replace(e.after, mode=0o777)) if e.path == b"README"
                                           else e for e in es])
    assert publish.recover(ws) == []
    assert layer_rows(ws) == [(0, "committed"), (1, "void")]
    assert manifest(ws.path) == half  # a void layer is never published further
    assert tmp_files(ws) == []
    assert st.rows() == rows  # never consumed: the open step lost nothing
    with ws.db.read() as conn:
        assert [layer.number for layer in layers.list_layers(conn)] == [0]
        # The next layer does not reuse the void number.
        assert layers.next_number(conn) == 2


def test_workspace_open_runs_recovery(ws, monkeypatch):
    from stepfs.store.workspace import Workspace

    crash_mid_publish(ws, monkeypatch, 2)
    with Workspace.open(ws.path) as again:
        assert layer_rows(again)[-1] == (1, "committed")
    assert manifest(ws.path) == expected_manifest(AFTER)


def test_recovery_makes_every_touched_directory_durable_again(ws, monkeypatch):
    """A crash can come after a removal or chmod reached the page cache but
    before its directory was fsynced; the re-run finds nothing to redo for
    that path, yet must still fsync it before the layer counts as committed."""
    st = Stager(ws)
    stage_after(st)
    with monkeypatch.context() as m:
        m.setattr(publish, "_complete", die_before_completion)
        with pytest.raises(Crash):
            publish.commit_step(ws, st.step)
    synced: set[tuple[int, int]] = set()
    real_fsync = os.fsync

    def recording_fsync(fd):
        st_ = os.fstat(fd)
        synced.add((st_.st_dev, st_.st_ino))
        return real_fsync(fd)

    monkeypatch.setattr(publish.os, "fsync", recording_fsync)
    assert publish.recover(ws) == [1]

    def ident(rel: str) -> tuple[int, int]:
        st_ = os.stat(os.path.join(ws.path, rel))
        return st_.st_dev, st_.st_ino

    # parents of removals (src/pkg/c.py, old), directories whose mode changed
    for rel in ("src/pkg", ".", "modedir", "src", "emptydir", "newdir/nested"):
        assert ident(rel) in synced, rel


def test_temp_files_of_a_dead_commit_are_removed_by_recover(ws):
    junk = os.path.join(ws.tmp_dir, "L7-3")
    with open(junk, "wb") as f:
        f.write(b"half a file")
    publish.recover(ws)
    assert tmp_files(ws) == []


# -- symlinks are never followed ------------------------------------------------------


def test_workspace_symlinks_are_retargeted_replaced_and_deleted_not_followed(tmp_path):
    tree = {
        "d": ("dir", 0o755),
        "d/keep": ("file", 0o644, b"keep\n"),
        "retarget": ("symlink", "d"),
        "delete": ("symlink", "d"),
        "to_file": ("symlink", "d"),
        "to_dir": ("symlink", "d"),
        "dangling": ("symlink", "missing"),
    }
    ws = open_workspace(tmp_path / "ws", tree)
    try:
        st = Stager(ws)
        st.symlink("retarget", "d/keep")
        st.whiteout("delete")
        st.file("to_file", b"now a file\n")
        st.dir("to_dir", 0o700, opaque=True)
        st.whiteout("dangling")
        publish.commit_step(ws, st.step)
        assert manifest(ws.path) == expected_manifest({
            "d": ("dir", 0o755),
            "d/keep": ("file", 0o644, b"keep\n"),  # reached through no symlink
            "retarget": ("symlink", "d/keep"),
            "to_file": ("file", 0o644, b"now a file\n"),
            "to_dir": ("dir", 0o700),
        })
        with ws.db.read() as conn:
            assert sorted(e.path for e in layers.entries(conn, 1)) == [
                b"dangling", b"delete", b"retarget", b"to_dir", b"to_file"]
    finally:
        ws.close()


def test_build_tree_helper_round_trips(tmp_path):
    build_tree(tmp_path / "t", BEFORE)
    assert manifest(tmp_path / "t") == expected_manifest(BEFORE)


def test_a_directory_replacing_a_workspace_symlink_gets_its_children(tmp_path):
    """In the mount: rm ln; mkdir ln; echo > ln/f.  In the workspace ln/f is
    reached through a symlink while planning and while removing: it is
    absent there, never followed into the symlink's target."""
    ws = open_workspace(tmp_path / "ws", {
        "d": ("dir", 0o755),
        "d/f": ("file", 0o644, b"the target's own f\n"),
        "ln": ("symlink", "d"),
    })
    try:
        st = Stager(ws)
        st.dir("ln", 0o755, opaque=True)
        st.file("ln/f", b"new f\n")
        assert [r.base for r in st.rows()] == ["link:" + b"d".hex(), "absent"]
        publish.commit_step(ws, st.step)
        assert manifest(ws.path) == expected_manifest({
            "d": ("dir", 0o755),
            "d/f": ("file", 0o644, b"the target's own f\n"),
            "ln": ("dir", 0o755),
            "ln/f": ("file", 0o644, b"new f\n"),
        })
        with ws.db.read() as conn:
            got = {e.path: (e.before.kind, e.after.kind) for e in layers.entries(conn, 1)}
        assert got == {b"ln": ("symlink", "dir"), b"ln/f": (None, "file")}
    finally:
        ws.close()
