"""Spare inodes (``store.spares``): the pool itself, and commits that publish
their files through spares keep the protocol's guarantees (the crash and
power-loss checks of test_crash_points / test_power_loss, run with spares
on hand)."""

from __future__ import annotations

import os
import shutil
import stat

import pytest

from crashkit import (  # noqa: F401  (fast_tmp is a fixture)
    Counter, KillAt, PowerLoss, check_recovered, commit, copy_template, crash_commit, fast_tmp, make_template,
    recover_images,
)
from stepfs.store import durable, publish, staging
from stepfs.store.spares import Spares
from stepfs.store.workspace import Workspace
from viewkit import open_view, read_all, write_file


def spare_names(ws: Workspace) -> list[str]:
    try:
        return sorted(os.listdir(ws.spares.directory))
    except FileNotFoundError:
        return []


def test_fill_makes_empty_files_and_take_moves_one_into_place(tmp_path):
    spares = Spares(str(tmp_path / "spare"))
    assert spares.available() == 0
    assert spares.fill(3) == 3
    assert spares.fill(3) == 0  # already on hand
    names = sorted(os.listdir(tmp_path / "spare"))
    assert len(names) == 3
    for name in names:
        st = os.lstat(tmp_path / "spare" / name)
        assert stat.S_ISREG(st.st_mode) and st.st_size == 0 and stat.S_IMODE(st.st_mode) == 0o600
    (tmp_path / "dst").mkdir()
    dfd = os.open(tmp_path / "dst", os.O_PATH | os.O_DIRECTORY)
    try:
        fd = spares.take(b"t0", dfd)
        assert fd is not None
        os.write(fd, b"published")
        os.close(fd)
    finally:
        os.close(dfd)
    assert (tmp_path / "dst" / "t0").read_bytes() == b"published"
    assert len(os.listdir(tmp_path / "spare")) == 2 and spares.available() == 2


def test_take_skips_spares_gone_and_truncates_a_spare_with_bytes(tmp_path):
    spares = Spares(str(tmp_path / "spare"))
    spares.fill(2)
    first, second = sorted(os.listdir(tmp_path / "spare"), key=lambda n: int(n.rsplit("-", 1)[1]))
    os.unlink(tmp_path / "spare" / first)  # taken by another process meanwhile
    (tmp_path / "spare" / second).write_bytes(b"junk that must not be published")
    (tmp_path / "dst").mkdir()
    dfd = os.open(tmp_path / "dst", os.O_PATH | os.O_DIRECTORY)
    try:
        fd = spares.take(b"t", dfd)
        assert fd is not None and os.fstat(fd).st_size == 0
        os.close(fd)
        assert spares.take(b"u", dfd) is None  # none left: the caller creates its file
    finally:
        os.close(dfd)
    assert not (tmp_path / "dst" / "u").exists()


def test_a_new_process_adopts_the_spares_on_disk_and_clear_removes_them(tmp_path):
    Spares(str(tmp_path / "spare")).fill(4)
    other = Spares(str(tmp_path / "spare"))
    assert other.available() == 4
    assert other.fill(6) == 2  # tops up to its target, counting the adopted ones
    assert other.clear() == 6 and os.listdir(tmp_path / "spare") == []
    assert other.available() == 0


def test_the_background_filler_refills_after_takes_and_stops(tmp_path):
    spares = Spares(str(tmp_path / "spare"))
    spares.start_filling(5)
    try:
        assert spares.wait_filled(timeout=30)
        assert spares.available() == 5
        (tmp_path / "dst").mkdir()
        dfd = os.open(tmp_path / "dst", os.O_PATH | os.O_DIRECTORY)
        try:
            for i in range(3):
                os.close(spares.take(f"t{i}".encode(), dfd))
        finally:
            os.close(dfd)
        assert spares.available() == 2
        spares.refill()
        assert spares.wait_filled(timeout=30)
        assert spares.available() == 5 and len(os.listdir(tmp_path / "spare")) == 5
    finally:
        spares.stop()
    assert spares._thread is None


def test_a_commit_publishes_its_files_through_spares(tmp_path):
    ws, view = open_view(tmp_path)
    (tmp_path / "ws" / "old.txt").write_bytes(b"old\n")
    ws.spares.fill(8)
    write_file(view, "/new.txt", b"new bytes\n", mode=0o640)
    write_file(view, "/old.txt", b"changed\n")
    number = view.commit(message="with spares")
    assert (tmp_path / "ws" / "new.txt").read_bytes() == b"new bytes\n"
    assert stat.S_IMODE(os.stat(tmp_path / "ws" / "new.txt").st_mode) == 0o640
    assert (tmp_path / "ws" / "old.txt").read_bytes() == b"changed\n"
    assert len(spare_names(ws)) == 6  # one per published file
    assert os.listdir(ws.tmp_dir) == []
    assert read_all(view, "/new.txt") == b"new bytes\n"
    with ws.db.read() as conn:
        assert staging.load(conn, view.step) == []
    assert number == 1
    view.close()
    ws.close()


def test_a_commit_larger_than_the_pool_creates_the_rest(tmp_path):
    ws, view = open_view(tmp_path)
    ws.spares.fill(2)
    for i in range(5):
        write_file(view, f"/f{i}", f"file {i}\n".encode())
    view.commit(message="more files than spares")
    for i in range(5):
        assert (tmp_path / "ws" / f"f{i}").read_bytes() == f"file {i}\n".encode()
    assert spare_names(ws) == [] and os.listdir(ws.tmp_dir) == []
    view.close()
    ws.close()


def with_spares(t, n: int = 32) -> None:
    """Put spares into the template's store: every copy of it commits through them."""
    Spares(os.path.join(t.ws, ".stepfs", "spare")).fill(n)


@pytest.mark.timeout(300)
def test_kill_at_every_durability_call_with_spares_ends_in_old_or_new(fast_tmp):
    t = make_template(fast_tmp, 8)
    with_spares(t)
    probe = copy_template(t, fast_tmp / "count")
    counter = Counter()
    with Workspace.open(str(probe), recover=False) as ws, durable.installed(counter):
        commit(ws, t)
        assert len(spare_names(ws)) < 32  # the commit did take spares
    shutil.rmtree(fast_tmp / "count")
    seen = {"OLD": 0, "NEW": 0}
    for k in range(1, counter.n + 2):
        run = fast_tmp / f"k{k}"
        if crash_commit(t, run, KillAt(k)) == "completed":
            assert k == counter.n + 1
            assert check_recovered(run / "ws", t) == "NEW"
            break
        try:
            seen[check_recovered(run / "ws", t)] += 1
        except AssertionError as exc:
            raise AssertionError(f"kill before durability call {k} ({counter.trace[k - 1]}): {exc}") from None
        shutil.rmtree(run)
    assert seen["OLD"] > 0 and seen["NEW"] > 0, seen


def test_power_loss_at_every_durability_call_with_spares_ends_in_old_or_new(fast_tmp):
    t = make_template(fast_tmp, 8)
    with_spares(t)
    ws_path = copy_template(t, fast_tmp / "run")
    with Workspace.open(str(ws_path), recover=False) as ws:
        model = PowerLoss(ws_path)
        with durable.installed(model):
            commit(ws, t)
        model.finish()
        assert len(spare_names(ws)) < 32
    shutil.rmtree(fast_tmp / "run")
    failures, seen = recover_images(model, t, fast_tmp)
    assert failures == []
    assert seen["OLD"] > 0 and seen["NEW"] > 0, seen


def test_no_spare_is_made_while_a_commit_runs(tmp_path):
    import threading

    spares = Spares(str(tmp_path / "spare"))
    made = []
    with spares.pausing():
        filler = threading.Thread(target=lambda: made.append(spares.fill(3)))
        filler.start()
        filler.join(timeout=0.5)
        assert filler.is_alive()  # waiting for the commit to end
        assert os.listdir(tmp_path / "spare") == []
    filler.join(timeout=30)
    assert made == [3] and len(os.listdir(tmp_path / "spare")) == 3


def test_a_commit_wakes_the_filler_to_replace_what_it_took(tmp_path):
    ws, view = open_view(tmp_path)
    ws.spares.start_filling(4)
    try:
        assert ws.spares.wait_filled(timeout=30)
        for i in range(3):
            write_file(view, f"/f{i}", b"x\n")
        view.commit(message="takes three spares")
        assert ws.spares.wait_filled(timeout=30)
        assert ws.spares.available() == 4
    finally:
        view.close()
        ws.close()  # stops the filler
    assert ws.spares._thread is None


# -- retired inodes ---------------------------------------------------------------


def test_retire_keeps_a_replaced_inode_until_the_sweep(tmp_path):
    spares = Spares(str(tmp_path / "spare"), str(tmp_path / "retired"))
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_bytes(b"old bytes\n")
    (tmp_path / "new").write_bytes(b"new bytes\n")
    old = os.stat(tmp_path / "d" / "f")
    dfd = os.open(tmp_path / "d", os.O_PATH | os.O_DIRECTORY)
    try:
        spares.retire(b"f", dfd)
        spares.retire(b"absent", dfd)  # a new path: nothing to retire
        os.rename(tmp_path / "new", tmp_path / "d" / "f")
    finally:
        os.close(dfd)
    assert (tmp_path / "d" / "f").read_bytes() == b"new bytes\n"
    [name] = os.listdir(tmp_path / "retired")
    kept = os.stat(tmp_path / "retired" / name)
    assert (kept.st_ino, kept.st_nlink) == (old.st_ino, 1)  # the rename did not free it
    assert spares.retired() == 1
    assert spares.sweep() == 1
    assert os.listdir(tmp_path / "retired") == [] and spares.retired() == 0


def test_retire_leaves_hard_linked_files_and_directories_alone(tmp_path):
    spares = Spares(str(tmp_path / "spare"), str(tmp_path / "retired"))
    (tmp_path / "a").write_bytes(b"x")
    os.link(tmp_path / "a", tmp_path / "b")
    (tmp_path / "sub").mkdir()
    dfd = os.open(tmp_path, os.O_PATH | os.O_DIRECTORY)
    try:
        for name in (b"a", b"sub"):
            spares.retire(name, dfd)
    finally:
        os.close(dfd)
    # A second name in retired/ would show in b's link count after a is replaced.
    assert spares.retired() == 0 and os.stat(tmp_path / "b").st_nlink == 2


def test_a_sweep_deletes_what_a_dead_process_retired(tmp_path):
    (tmp_path / "retired").mkdir()
    for i in range(3):
        (tmp_path / "retired" / f"S1-dead-{i}").write_bytes(b"left by a crash")
    spares = Spares(str(tmp_path / "spare"), str(tmp_path / "retired"))
    assert spares.sweep() == 3 and os.listdir(tmp_path / "retired") == []


def test_a_commit_renames_over_retired_inodes_and_frees_them_after(tmp_path):
    """Each replaced or removed workspace file has a second name when the
    commit's rename or unlink runs (so the call does not free it); none is
    left once the commit returned (no filler thread: freed at once)."""
    ws, view = open_view(tmp_path)
    for name in ("a", "b", "gone"):
        (tmp_path / "ws" / name).write_bytes(f"old {name}\n".encode())
    write_file(view, "/a", b"new a\n")
    write_file(view, "/b", b"new b\n")
    write_file(view, "/c", b"new c\n")
    view.unlink("/gone")
    seen = {}

    class LinkCounts:
        def before(self, op, args):
            if op == "rename":
                name, dir_fd = args[1], args[3]
            elif op == "unlink":
                name, dir_fd = args
            else:
                return
            try:
                seen[name] = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_nlink
            except FileNotFoundError:
                seen[name] = 0

        def after(self, op, args):
            pass

    with durable.installed(LinkCounts()):
        view.commit(message="replace, add, remove")
    assert seen == {b"a": 2, b"b": 2, b"c": 0, b"gone": 2}
    assert os.listdir(os.path.join(ws.store_dir, "retired")) == [] and ws.spares.retired() == 0
    assert [(tmp_path / "ws" / n).read_bytes() for n in ("a", "b", "c")] == [b"new a\n", b"new b\n", b"new c\n"]
    assert not (tmp_path / "ws" / "gone").exists()
    view.close()
    ws.close()


def test_the_filler_thread_frees_retired_inodes_after_a_commit(tmp_path):
    ws, view = open_view(tmp_path)
    (tmp_path / "ws" / "f").write_bytes(b"old\n")
    ws.spares.start_filling(2)
    try:
        assert ws.spares.wait_filled(timeout=30)
        write_file(view, "/f", b"new\n")
        view.commit(message="replaces f")
        assert ws.spares.wait_filled(timeout=30)  # a round after the commit: swept, then filled
        assert os.listdir(os.path.join(ws.store_dir, "retired")) == [] and ws.spares.retired() == 0
    finally:
        view.close()
        ws.close()
