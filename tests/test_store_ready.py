"""Ready files (``store/ready.py``): a view writes a step's small new files
ahead of its commit, and the commit renames them into place instead of
writing and fsyncing them itself -- only when a ready file is exactly what
step 2 would have made, and unchanged since it was written."""

from __future__ import annotations

import os
import shutil
import stat

import pytest

from conftest import needs_multigrain
from crashkit import (  # noqa: F401  (fast_tmp is a fixture)
    MOUNTPOINT, Counter, KillAt, PowerLoss, check_recovered, copy_template, crash_commit, fast_tmp, make_template,
    recover_images,
)
from stepfs.store import durable, publish, ready, staging
from stepfs.store.ready import ReadyFiles
from stepfs.store.spares import Spares
from stepfs.store.workspace import Workspace
from viewkit import open_view, read_all, write_file


def _ready_of(view, path: bytes):
    """``(name in spare/, inode)`` of the ready file of ``path`` (waits
    for its write)."""
    name, ident = view.content.cas.ready._files[path].job.result()
    return name, ident[0]


def _commit_counting(view) -> tuple[int, Counter]:
    counter = Counter()
    with durable.installed(counter):
        number = view.commit(message="counted")
    return number, counter


def test_a_step_publishes_its_ready_files_without_writing_them_again(tmp_path):
    ws, view = open_view(tmp_path)
    try:
        (tmp_path / "ws" / "old.txt").write_bytes(b"old\n")
        ws.spares.fill(8)
        write_file(view, "/new.txt", b"new bytes\n", mode=0o640)
        write_file(view, "/old.txt", b"changed\n")
        view.utimens("/new.txt", (1_600_000_000_000_000_000, 1_600_000_000_123_456_789))
        write_file(view, "/sub.txt", b"s\n")
        inodes = {p: _ready_of(view, p)[1] for p in (b"new.txt", b"old.txt", b"sub.txt")}
        del inodes[b"new.txt"]  # its ready file no longer matches (below)
        before = {p: view.getattr(p) for p in ("/new.txt", "/old.txt", "/sub.txt")}
        number, counter = _commit_counting(view)
        cas = view.content.cas
        # new.txt's mtime changed after its close: its ready file no longer
        # matches, so the commit made that one itself.
        assert cas.ready.used == 2
        for path, ino in inodes.items():
            assert os.lstat(tmp_path / "ws" / os.fsdecode(path)).st_ino == ino
        assert (tmp_path / "ws" / "new.txt").read_bytes() == b"new bytes\n"
        assert (tmp_path / "ws" / "old.txt").read_bytes() == b"changed\n"
        assert (tmp_path / "ws" / "sub.txt").read_bytes() == b"s\n"
        for path, st in before.items():
            got = os.lstat(tmp_path / "ws" / path.lstrip("/"))
            assert stat.S_IMODE(got.st_mode) == stat.S_IMODE(st["st_mode"])
            assert got.st_mtime_ns == view.getattr(path)["st_mtime"]  # the view's own mtime, to the ns
        assert os.lstat(tmp_path / "ws" / "new.txt").st_mtime_ns == 1_600_000_000_123_456_789
        assert os.listdir(ws.tmp_dir) == []
        # The commit fsynced the one file it wrote, not the two it found ready.
        first = counter.by_op.get("fsync", 0)
        write_file(view, "/a.txt", b"a")
        write_file(view, "/b.txt", b"b")
        view.chmod("/a.txt", 0o600)
        view.chmod("/b.txt", 0o600)  # both readied, neither matches now
        for path in (b"a.txt", b"b.txt"):
            _ready_of(view, path)
        _, counter = _commit_counting(view)
        assert counter.by_op.get("fsync", 0) == first + 1
        assert number == 1 and read_all(view, "/old.txt") == b"changed\n"
    finally:
        view.close()
        ws.close()


def test_a_path_written_again_after_it_was_readied_gets_its_last_bytes(tmp_path):
    ws, view = open_view(tmp_path)
    try:
        ws.spares.fill(4)
        write_file(view, "/f.txt", b"first version\n")
        name, _ino = _ready_of(view, b"f.txt")
        write_file(view, "/f.txt", b"second\n")  # readied once per step: not again
        spares = ws.spares.available()
        view.commit(message="rewritten")
        assert (tmp_path / "ws" / "f.txt").read_bytes() == b"second\n"
        assert view.content.cas.ready.used == 0
        # The unused ready file is a spare again; the next taker empties it.
        assert ws.spares.available() == spares  # one taken for f.txt, one given back
        assert name in os.listdir(ws.spares.directory)
        write_file(view, "/g.txt", b"g")  # a new step readies again
        assert view.content.cas.ready.offer(b"h.txt", ready.key_of("x", 0o644, os.geteuid(), os.getegid(), None, None), b"") is True
        view.commit(message="next")
        assert (tmp_path / "ws" / "g.txt").read_bytes() == b"g"
        assert view.content.cas.ready.used == 1
    finally:
        view.close()
        ws.close()


@pytest.mark.parametrize("tamper", [
    pytest.param(b"THE AGENT'S BYTES\n", id="same-size", marks=needs_multigrain),  # only its ctime tells
    pytest.param(b"more bytes than the agent wrote\n", id="other-size"),
])
def test_a_ready_file_changed_in_the_spare_directory_is_never_published(tmp_path, tamper):
    ws, view = open_view(tmp_path)
    try:
        ws.spares.fill(4)
        write_file(view, "/f.txt", b"the agent's bytes\n")
        name, _ino = _ready_of(view, b"f.txt")
        spare = os.path.join(ws.spares.directory, name)
        with open(spare, "r+b") as f:
            f.write(tamper)
        view.commit(message="tampered")
        assert (tmp_path / "ws" / "f.txt").read_bytes() == b"the agent's bytes\n"
        assert view.content.cas.ready.used == 0
        assert name not in os.listdir(ws.spares.directory)  # deleted, not kept as a spare
    finally:
        view.close()
        ws.close()


def test_readying_is_bounded_and_needs_a_spare(tmp_path):
    ws, view = open_view(tmp_path)
    try:
        write_file(view, "/none.txt", b"no spare on hand")
        assert view.content.cas.ready._files == {}
        view.commit(message="no spares")
        assert (tmp_path / "ws" / "none.txt").read_bytes() == b"no spare on hand"
        ws.spares.fill(ready.READY_MAX + 8)
        write_file(view, "/big.bin", b"x" * (ready.READY_SIZE_MAX + 1))
        view.setxattr("/none.txt", "user.k", b"v")
        for i in range(ready.READY_MAX + 3):
            write_file(view, f"/f{i}", f"file {i}\n".encode())
        cas = view.content.cas
        assert b"big.bin" not in cas.ready._files and len(cas.ready._files) == ready.READY_MAX
        view.commit(message="many")
        assert cas.ready.used == ready.READY_MAX
        for i in range(ready.READY_MAX + 3):
            assert (tmp_path / "ws" / f"f{i}").read_bytes() == f"file {i}\n".encode()
        assert (tmp_path / "ws" / "big.bin").stat().st_size == ready.READY_SIZE_MAX + 1
        assert os.getxattr(tmp_path / "ws" / "none.txt", "user.k") == b"v"
    finally:
        view.close()
        ws.close()


def test_a_file_with_attributes_is_not_readied(tmp_path):
    """A ready file that outlived its daemon is a spare like any other: one
    with user.* attributes would pass them on to the next file made of it."""
    ws, view = open_view(tmp_path)
    try:
        ws.spares.fill(4)
        cas = view.content.cas
        key = ready.key_of("0" * 32, 0o644, os.geteuid(), os.getegid(), b"attrs", None)
        assert cas.ready.offer(b"a.txt", key, b"bytes") is False
        other = ready.key_of("0" * 32, 0o644, os.geteuid() + 1, 0, None, None)
        assert cas.ready.offer(b"b.txt", other, b"bytes") is False
        assert cas.ready._files == {}
    finally:
        view.close()
        ws.close()


def test_ready_files_a_dead_daemon_left_are_emptied_spares(tmp_path):
    ws, view = open_view(tmp_path)
    ws.spares.fill(4)
    write_file(view, "/f.txt", b"bytes of a step never committed\n")
    name, _ino = _ready_of(view, b"f.txt")
    # The daemon dies: nothing detached or given back.
    view.close()
    ws.close()
    ws, view = open_view(tmp_path, "mnt2")
    try:
        assert name in os.listdir(ws.spares.directory) and ws.spares.available() == 4
        for i in range(5):  # four readied (the old ready file among their spares), one not
            write_file(view, f"/n{i}", b"n")
        view.commit(message="after the crash")
        for i in range(5):
            assert (tmp_path / "ws" / f"n{i}").read_bytes() == b"n"
        assert name not in os.listdir(ws.spares.directory)
    finally:
        view.close()
        ws.close()


# -- crashes: a commit that publishes ready files ends in OLD or NEW ----------------


def _ready_for(ws: Workspace, t) -> ReadyFiles:
    """What a view would have readied for the template's step: every staged
    file's bytes and metadata, written before the commit (with a hook
    installed, at once, so the hook sees their fsyncs first)."""
    got = ReadyFiles(ws.spares)
    with ws.db.read() as conn:
        for row in staging.load(conn, t.step):
            if row.kind == "file" and row.oid is not None and row.link_group is None:
                data = ws.objects.read_all(conn, row.oid)
                got.offer(row.path, ready.key_of(row.oid, row.mode, row.uid, row.gid, row.xattrs,
                                                 row.mtime_ns), data)
    return got


def _commit_with_ready(ws: Workspace, t) -> int:
    readied = _ready_for(ws, t)
    number = publish.commit_step(ws, t.step, message="crash test", mount=MOUNTPOINT, overwrite=t.paths,
                                 ready=readied)
    assert readied.used > 0  # the template's changes include small new and rewritten files
    return number


@pytest.mark.timeout(300)
def test_kill_at_every_durability_call_of_a_commit_with_ready_files_ends_in_old_or_new(fast_tmp):
    t = make_template(fast_tmp, 8)
    Spares(os.path.join(t.ws, ".stepfs", "spare")).fill(32)
    probe = copy_template(t, fast_tmp / "count")
    counter = Counter()
    with Workspace.open(str(probe), recover=False) as ws, durable.installed(counter):
        _commit_with_ready(ws, t)
    shutil.rmtree(fast_tmp / "count")
    seen = {"OLD": 0, "NEW": 0}
    for k in range(1, counter.n + 2):
        run = fast_tmp / f"k{k}"
        if crash_commit(t, run, KillAt(k), _commit_with_ready) == "completed":
            assert k == counter.n + 1
            assert check_recovered(run / "ws", t) == "NEW"
            break
        try:
            seen[check_recovered(run / "ws", t)] += 1
        except AssertionError as exc:
            raise AssertionError(f"kill before durability call {k} ({counter.trace[k - 1]}): {exc}") from None
        shutil.rmtree(run)
    assert seen["OLD"] > 0 and seen["NEW"] > 0, seen


@pytest.mark.timeout(300)
def test_power_loss_at_every_durability_call_of_a_commit_with_ready_files_ends_in_old_or_new(fast_tmp):
    """The power-loss model keeps a file's bytes only once they were
    fsynced: a ready file published without its fsync would come back
    empty, which is neither OLD nor NEW."""
    t = make_template(fast_tmp, 8)
    Spares(os.path.join(t.ws, ".stepfs", "spare")).fill(32)
    ws_path = copy_template(t, fast_tmp / "run")
    with Workspace.open(str(ws_path), recover=False) as ws:
        model = PowerLoss(ws_path)
        with durable.installed(model):
            _commit_with_ready(ws, t)
        model.finish()
    shutil.rmtree(fast_tmp / "run")
    failures, seen = recover_images(model, t, fast_tmp)
    assert failures == []
    assert seen["OLD"] > 0 and seen["NEW"] > 0, seen
