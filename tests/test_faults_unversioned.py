"""Fault injection on the unversioned paths (issue 18's fault pass over
#19's passthrough, ``overlayfs/core/passthrough.py`` and ``crossing.py``).
Kernel-free, on a real small tmpfs so the disk really fills.

Documented outcome: an unversioned write fails with the filesystem's own
errno (as outside stepfs) and stages nothing; a move of a versioned tree
to an unversioned name that does not fit fails whole (``ENOSPC``), with
the tree still versioned, nothing staged for it, and no hidden partial copy
left in the workspace; it succeeds once there is room.
"""

from __future__ import annotations

import errno
import os
import threading

import pytest

from crashkit import tmpfs
from stepfs.store import staging, verify
from viewkit import open_view, read_all, write_file


def _staged(ws, view) -> list[str]:
    view.sync_rows()
    with ws.db.read() as conn:
        return sorted(os.fsdecode(r.path) for r in staging.load(conn, view.step))


def _ballast(ws_path, leave: int) -> None:
    st = os.statvfs(ws_path)
    with open(ws_path / "ballast.bin", "wb") as f:
        f.write(b"\xa5" * (st.f_bavail * st.f_frsize - leave))


@pytest.mark.timeout(60)
def test_a_move_out_of_versioning_that_does_not_fit_fails_whole(tmp_path):
    with tmpfs(tmp_path / "small", size="16m") as fs:
        ws, view = open_view(fs)
        ws_path = fs / "ws"
        try:
            big = os.urandom(3 << 20)
            view.mkdir("/pytest-cache-files-x", 0o755)
            view.mkdir("/pytest-cache-files-x/v", 0o755)
            write_file(view, "/pytest-cache-files-x/v/big.bin", big)
            write_file(view, "/pytest-cache-files-x/README.md", b"readme")
            before = _staged(ws, view)
            _ballast(ws_path, leave=1 << 20)  # room for the store's work, not for a 3 MiB copy
            with pytest.raises(OSError) as info:
                view.rename("/pytest-cache-files-x", "/.pytest_cache")
            assert info.value.errno == errno.ENOSPC
            assert not (ws_path / ".pytest_cache").exists()
            assert not [n for n in os.listdir(ws_path) if n.startswith(".stepfs-move-")]
            assert _staged(ws, view) == before
            assert read_all(view, "/pytest-cache-files-x/v/big.bin") == big
            assert view.readonly_reason is None  # the workspace was full, not the store's writes
            os.unlink(ws_path / "ballast.bin")
            view.rename("/pytest-cache-files-x", "/.pytest_cache")
            assert (ws_path / ".pytest_cache" / "v" / "big.bin").read_bytes() == big
            assert _staged(ws, view) == []
            assert verify.verify(ws).ok
        finally:
            view.close()
            ws.close()


@pytest.mark.timeout(60)
def test_an_unversioned_write_on_a_full_disk_fails_with_enospc_and_stages_nothing(tmp_path):
    with tmpfs(tmp_path / "small", size="16m") as fs:
        ws, view = open_view(fs)
        ws_path = fs / "ws"
        try:
            (ws_path / "node_modules").mkdir()
            write_file(view, "/app.py", b"print(1)\n")
            _ballast(ws_path, leave=64 << 10)
            fh = view.create("/node_modules/blob.bin", 0o644)
            with pytest.raises(OSError) as info:
                for i in range(64):
                    view.write(fh, b"\0" * (64 << 10), i * (64 << 10))
            assert info.value.errno == errno.ENOSPC
            view.release(fh)
            assert _staged(ws, view) == ["app.py"]
            assert view.readonly_reason is None
            os.unlink(ws_path / "ballast.bin")
            assert view.commit(message="after the full disk") == 1
            assert (ws_path / "app.py").read_bytes() == b"print(1)\n"
        finally:
            view.close()
            ws.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["fifo", "dir", "symlink"])
def test_a_stepfsignore_that_is_not_a_file_gives_no_patterns_and_never_blocks(tmp_path, kind):
    """A FIFO named .stepfsignore in the workspace hung the view at the
    first create (the rules opened it, under the view's lock, and the open
    of a FIFO waits for a writer)."""
    ws_dir = tmp_path / "ws"
    ws_dir.mkdir()
    target = ws_dir / ".stepfsignore"
    if kind == "fifo":
        os.mkfifo(target)
    elif kind == "dir":
        target.mkdir()
    else:
        (ws_dir / "real-ignore").write_text("build/\n")
        target.symlink_to("real-ignore")
    ws, view = open_view(tmp_path)
    done = threading.Event()

    def work():
        write_file(view, "/a.txt", b"x")
        view.mkdir("/build", 0o755)
        write_file(view, "/build/out.o", b"o")
        done.set()

    t = threading.Thread(target=work, daemon=True)
    t.start()
    t.join(15)
    try:
        assert done.is_set(), "the view blocked on .stepfsignore"
        assert view.unversioned_state()["stepfsignore"] == []
        assert _staged(ws, view) == ["a.txt", "build", "build/out.o"]  # no pattern: everything versioned
    finally:
        if done.is_set():
            view.close()
            ws.close()
