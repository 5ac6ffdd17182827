"""Faults fail loudly and lose nothing (kernel-free).

* ``fsync`` failing with EIO at the n-th call, once or from then on: the
  commit fails, and the layer is never marked committed except by a recovery
  that rewrites and fsyncs everything again (the fsyncgate rule).
* ENOSPC / EDQUOT / EIO on write or rename at the n-th call: the commit fails
  with that errno and the store stays consistent.
* A real, small tmpfs as the workspace filling up: a commit that does not fit
  fails with nothing changed and succeeds once space is freed; a full store
  (SQLITE_FULL) gives ENOSPC to the writer and turns the view read-only.
"""

from __future__ import annotations

import errno
import os

import pytest
from sqlalchemy import select

from conftest import manifest
from crashkit import (  # noqa: F401  (fast_tmp is a fixture)
    Counter, FailAt, check_recovered, commit, copy_template, fast_tmp, make_template, staged_rows, tmpfs,
)
from stepfs.overlayfs.core.errors import ReadOnly
from stepfs.overlayfs.core.view import Overlay
from stepfs.store import durable, publish, schema, verify
from stepfs.store.errors import PublishFailed, StoreFull, StoreUnavailable
from stepfs.store.workspace import Workspace


def layer_states(ws: Workspace) -> dict[int, str]:
    with ws.db.read() as conn:
        return dict(conn.execute(select(schema.layers.c.number, schema.layers.c.state)).all())


def calls_of(t, base) -> Counter:
    counter = Counter()
    ws_path = copy_template(t, base / "count")
    with Workspace.open(str(ws_path), recover=False) as ws, durable.installed(counter):
        commit(ws, t)
    return counter


def assert_untouched(ws: Workspace, ws_path, t) -> None:
    """Nothing happened: OLD on disk, no layer, the step still staged, no temporary file."""
    assert manifest(ws_path) == t.old
    assert layer_states(ws) == {0: "committed"}
    assert staged_rows(ws, t.step) == t.staged
    assert os.listdir(ws.tmp_dir) == []


@pytest.mark.parametrize("persistent", [False, True], ids=["once", "persistent"])
def test_fsync_eio_fails_the_commit_and_is_never_retried_into_success(fast_tmp, persistent):
    t = make_template(fast_tmp, 8)
    fsyncs = calls_of(t, fast_tmp).by_op["fsync"]
    outcomes = set()
    for n in range(1, fsyncs + 1):
        ws_path = copy_template(t, fast_tmp / f"n{n}")
        with Workspace.open(str(ws_path), recover=False) as ws:
            with durable.installed(FailAt("fsync", n, errno.EIO, persistent)):
                with pytest.raises(PublishFailed) as info:
                    commit(ws, t)
                assert info.value.errno == errno.EIO
                assert "Input/output error" in str(info.value)
                assert layer_states(ws).get(1) != "committed"
                if persistent:
                    # Asking again, in this process or through a new open,
                    # fails again; nothing reports success on a failing disk.
                    for attempt in (lambda: commit(ws, t), lambda: publish.recover(ws),
                                    lambda: Workspace.open(str(ws_path)).close()):
                        try:
                            attempt()
                        except PublishFailed as exc:
                            assert exc.errno == errno.EIO
                        else:
                            assert info.value.pending is None, "a pending layer was finished on a failing disk"
                    assert layer_states(ws).get(1) != "committed"
            pending = info.value.pending
            outcomes.add(pending)
            if pending is None and not persistent:
                assert_untouched(ws, ws_path, t)
            if pending is not None:
                assert layer_states(ws)[1] == "pending"
        # The disk is healthy again.  A pending layer becomes committed only by
        # a recovery that rewrites every new file and fsyncs every file and
        # directory again, never by marking it done.
        redo = Counter()
        with Workspace.open(str(ws_path), recover=False) as ws, durable.installed(redo):
            publish.recover(ws)
        if pending is not None:
            assert redo.by_op["fsync"] == fsyncs
        expected = "OLD" if pending is None else "NEW"
        assert check_recovered(ws_path, t) == expected
    # Failures landed both before the commit point (files) and after it (directories).
    assert None in outcomes and 1 in outcomes


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EIO], ids=["ENOSPC", "EDQUOT", "EIO"])
@pytest.mark.parametrize("op", ["write", "rename"])
def test_write_and_rename_errors_fail_with_their_errno_and_keep_the_store_consistent(fast_tmp, op, code):
    t = make_template(fast_tmp, 8)
    total = calls_of(t, fast_tmp).by_op[op]
    for n in sorted({1, total // 2, total}):
        ws_path = copy_template(t, fast_tmp / f"n{n}")
        with Workspace.open(str(ws_path), recover=False) as ws:
            with durable.installed(FailAt(op, n, code)):
                with pytest.raises(PublishFailed) as info:
                    commit(ws, t)
            assert info.value.errno == code
            assert os.strerror(code) in str(info.value)
            with ws.db.read() as conn:
                assert conn.exec_driver_sql("PRAGMA integrity_check").scalar() == "ok"
            if op == "write":
                # New files are written before the commit point.
                assert info.value.pending is None
                assert_untouched(ws, ws_path, t)
                assert verify.verify(ws).ok
                assert commit(ws, t) == 1  # the step is intact: it commits once the fault is gone
            else:
                assert info.value.pending == 1 and layer_states(ws)[1] == "pending"
        assert check_recovered(ws_path, t) == "NEW"
        with Workspace.open(str(ws_path)) as ws:
            assert verify.verify(ws).ok


def _write(view: Overlay, path: str, data: bytes) -> None:
    fh = view.create(path, 0o644)
    try:
        view.write(fh, data, 0)
        view.flush(fh)
    finally:
        view.release(fh)


def _free(path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _ballast(ws_path, leave: int) -> None:
    """Fill the filesystem so that about ``leave`` bytes stay free."""
    size = _free(ws_path) - leave
    with open(ws_path / "ballast.bin", "wb") as f:
        f.write(b"\xa5" * size)


@pytest.mark.timeout(60)
def test_a_commit_that_does_not_fit_on_a_full_tmpfs_changes_nothing_and_fits_later(tmp_path):
    with tmpfs(tmp_path / "small", size="2m") as fs:
        ws_path = fs / "ws"
        ws_path.mkdir()
        (ws_path / "keep.txt").write_bytes(b"keep\n")
        with Workspace.open(str(ws_path), create=True) as ws:
            view = Overlay(ws, "/faults/mnt")
            _write(view, "/big.bin", os.urandom(400_000))
            _write(view, "/small.txt", b"small\n")
            _ballast(ws_path, leave=150_000)  # less than the new file needs in .stepfs/tmp
            old = manifest(ws_path)
            with pytest.raises(PublishFailed) as info:
                view.commit("does not fit")
            assert info.value.errno == errno.ENOSPC and info.value.pending is None
            assert manifest(ws_path) == old  # nothing changed
            assert os.listdir(ws.tmp_dir) == []
            assert view.readonly_reason is None  # a clean failure: the step stays open
            assert {p for _op, p in view.staged_paths()} == {"/big.bin", "/small.txt"}
            with ws.db.read() as conn:
                assert conn.exec_driver_sql("PRAGMA integrity_check").scalar() == "ok"
            os.unlink(ws_path / "ballast.bin")  # free space
            assert view.commit("fits now") == 1
            tree = manifest(ws_path)
            assert len(tree[b"big.bin"][2]) == 400_000 and tree[b"small.txt"][2] == b"small\n"
            assert verify.verify(ws).ok


@pytest.mark.timeout(60)
def test_a_full_store_gives_enospc_to_the_writer_and_the_view_goes_read_only(tmp_path):
    with tmpfs(tmp_path / "small", size="2m") as fs:
        ws_path = fs / "ws"
        ws_path.mkdir()
        (ws_path / "readme.txt").write_bytes(b"still readable\n")
        with Workspace.open(str(ws_path), create=True) as ws:
            view = Overlay(ws, "/faults/mnt")
            _write(view, "/staged.txt", b"staged before the disk filled\n")
            # Room for the scratch copy of the new file, not for its object in the store too.
            _ballast(ws_path, leave=700_000)
            fh = view.create("/huge.bin", 0o644)
            view.write(fh, os.urandom(450_000), 0)
            with pytest.raises(StoreFull):  # the FUSE adapter maps it to ENOSPC
                view.flush(fh)
            try:
                view.release(fh)  # tries to stage once more; FUSE drops release errors
            except StoreFull:
                pass
            assert "full" in view.readonly_reason
            with pytest.raises(ReadOnly):
                _write(view, "/more.txt", b"x")
            with pytest.raises(ReadOnly):
                view.mkdir("/d", 0o755)
            with pytest.raises(StoreUnavailable):
                view.commit("read-only")
            assert "read-only: the store" in view.status_text()
            # Reads keep working: a workspace file and a staged file.
            fh = view.open("/readme.txt", os.O_RDONLY)
            assert view.read(fh, 100, 0) == b"still readable\n"
            view.release(fh)
            fh = view.open("/staged.txt", os.O_RDONLY)
            assert view.read(fh, 100, 0) == b"staged before the disk filled\n"
            view.release(fh)
            with ws.db.read() as conn:
                assert conn.exec_driver_sql("PRAGMA integrity_check").scalar() == "ok"
            assert verify.verify(ws).ok
        # A new view (the next mount) starts writable with what was staged.
        os.unlink(ws_path / "ballast.bin")
        with Workspace.open(str(ws_path)) as ws:
            view = Overlay(ws, "/faults/mnt")
            assert view.readonly_reason is None
            assert {p for _op, p in view.staged_paths()} == {"/staged.txt"}
            assert view.commit("after the disk was freed") == 1


def test_a_commit_failing_past_its_commit_point_turns_the_view_read_only_until_recovery(tmp_path):
    ws_path = tmp_path / "ws"
    ws_path.mkdir()
    (ws_path / "old.txt").write_bytes(b"old\n")
    with Workspace.open(str(ws_path), create=True) as ws:
        view = Overlay(ws, "/faults/mnt")
        _write(view, "/new.txt", b"new\n")
        # The 2nd fsync is the workspace directory's: after the intent.
        with durable.installed(FailAt("fsync", 2, errno.EIO)):
            with pytest.raises(PublishFailed) as info:
                view.commit("fails late")
        assert info.value.pending == 1
        assert "layer 1" in view.readonly_reason and "Input/output error" in view.readonly_reason
        with pytest.raises(ReadOnly):
            _write(view, "/later.txt", b"refused\n")
        with pytest.raises(StoreUnavailable):  # no retry from this view: it stays failed
            view.commit("again")
        assert layer_states(ws)[1] == "pending"
        fh = view.open("/new.txt", os.O_RDONLY)  # reads keep working
        assert view.read(fh, 10, 0) == b"new\n"
        view.release(fh)
    # The next open recovers: the layer is rewritten, fsynced and committed,
    # and the step it consumed is empty.
    with Workspace.open(str(ws_path)) as ws:
        assert layer_states(ws) == {0: "committed", 1: "committed"}
        assert (ws_path / "new.txt").read_bytes() == b"new\n"
        view = Overlay(ws, "/faults/mnt")
        assert view.readonly_reason is None and view.staged_paths() == []


# -- the concurrent path (no hook installed: fsyncs run on the pool) ----------------


def _failing_fsync(monkeypatch, where: str):
    """Make the real ``os.fsync`` fail with EIO for descriptors whose path
    contains ``where`` (no hook is installed, so ``store.durable`` runs its
    batches concurrently on its pool, as in production)."""
    real = os.fsync
    failed: list[str] = []

    def fsync(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        if where in path:
            failed.append(path)
            raise OSError(errno.EIO, "injected")
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return failed


@pytest.mark.parametrize("n_new", [0, 5], ids=["one-file", "six-files"])
def test_a_new_file_failing_its_concurrent_fsync_withdraws_the_intent(tmp_path, monkeypatch, n_new):
    ws_path = tmp_path / "ws"
    ws_path.mkdir()
    (ws_path / "old.txt").write_bytes(b"old\n")
    with Workspace.open(str(ws_path), create=True) as ws:
        old = manifest(ws_path)
        view = Overlay(ws, "/faults/mnt")
        for i in range(n_new):
            _write(view, f"/new{i}.txt", b"new %d\n" % i)
        _write(view, "/old.txt", b"changed\n")
        # one file: fsynced at once in the caller; six: on the pool
        failed = _failing_fsync(monkeypatch, "/.stepfs/tmp/L1-" + ("3" if n_new else "0"))
        with pytest.raises(PublishFailed) as info:
            view.commit("fails while the intent is recorded")
        assert failed, "the injected fsync failure was never reached"
        assert info.value.errno == errno.EIO and info.value.pending is None
        # As if the intent was never recorded: nothing changed, the step is open.
        assert manifest(ws_path) == old
        assert layer_states(ws) == {0: "committed"}
        assert os.listdir(ws.tmp_dir) == []
        assert view.readonly_reason is None
        assert len(view.staged_paths()) == n_new + 1
        monkeypatch.undo()
        assert view.commit("the disk is healthy again") == 1
        assert (ws_path / "old.txt").read_bytes() == b"changed\n"
        if n_new:
            assert (ws_path / "new3.txt").read_bytes() == b"new 3\n"


def test_a_directory_failing_its_concurrent_fsync_leaves_the_layer_pending(tmp_path, monkeypatch):
    ws_path = tmp_path / "ws"
    for d in ("a", "b", "c"):
        (ws_path / d).mkdir(parents=True)
    with Workspace.open(str(ws_path), create=True) as ws:
        view = Overlay(ws, "/faults/mnt")
        for d in ("a", "b", "c"):
            _write(view, f"/{d}/f.txt", d.encode())
        failed = _failing_fsync(monkeypatch, f"{ws_path}/b")
        with pytest.raises(PublishFailed) as info:
            view.commit("a directory fsync fails")
        assert failed == [f"{ws_path}/b"]  # never retried
        assert info.value.pending == 1 and layer_states(ws)[1] == "pending"
        monkeypatch.undo()
    with Workspace.open(str(ws_path)) as ws:  # recovery rewrites and commits it
        assert layer_states(ws) == {0: "committed", 1: "committed"}
        assert (ws_path / "b" / "f.txt").read_bytes() == b"b"


def test_fsync_all_reports_the_first_error_after_every_call_ended(tmp_path):
    paths = [tmp_path / f"f{i}" for i in range(6)]
    fds = [os.open(p, os.O_WRONLY | os.O_CREAT, 0o600) for p in paths]
    r, w = os.pipe()  # fsync of a pipe fails with EINVAL
    try:
        durable.fsync_all(fds)
        with pytest.raises(OSError) as info:
            durable.fsync_all(fds[:3] + [r] + fds[3:])
        assert info.value.errno == errno.EINVAL
        syncing = durable.start_fsync_all(fds)
        syncing.wait()
        # A forked child gets a pool of its own (the parent's threads do not exist there).
        pid = os.fork()
        if pid == 0:
            try:
                durable.fsync_all(fds)
                os._exit(0)
            except BaseException:
                os._exit(1)
        assert os.waitpid(pid, 0)[1] == 0
    finally:
        for fd in fds + [r, w]:
            os.close(fd)
