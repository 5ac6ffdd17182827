"""A mount daemon answers ``step`` once the layer is published (intent and
new files durable, every rename done), before the directory fsyncs and the
"committed" record have ended (between ``store.publish.Commit``'s
``publish`` and ``complete``).  Through the daemon's own control handler
(``overlayfs.daemon.handler``) on a real control socket, with a view that
is not mounted (kernel-free):

* while the completion waits for the disk, the caller has its answer, the
  view serves requests that write nothing, a close-write waits (its row
  would be consumed with a layer it is not part of) and is kept after;
* a failure after the answer is not silent: the layer stays pending, the
  mount turns read-only with the reason a failed commit gives, the
  daemon's ping and ``.stepfs/status`` show it, and the next step fails
  with it; recovery at the next open completes the layer.
"""

from __future__ import annotations

import errno
import logging
import os
import stat as stat_mod
import threading

import pytest

from stepfs.overlayfs.client import control
from stepfs.overlayfs.daemon.control import ControlServer
from stepfs.overlayfs.daemon import main as daemon
from stepfs.overlayfs.core.errors import ReadOnly
from stepfs.overlayfs.daemon.libfuse.notify import KernelCache
from stepfs.overlayfs.core.view import Overlay
from stepfs.store import durable, staging
from stepfs.store.errors import StoreUnavailable
from stepfs.store.workspace import Workspace
from viewkit import read_all, write_file


def _states(ws: Workspace) -> dict[int, str]:
    from sqlalchemy import select

    from stepfs.store import schema

    with ws.db.read() as conn:
        return dict(conn.execute(select(schema.layers.c.number, schema.layers.c.state)).all())


class DirFsyncs:
    """A ``store.durable`` hook that holds (``release``) or fails (``fail``)
    every fsync of a directory, the switch's last durability calls."""

    def __init__(self, fail: bool = False, hold: bool | None = None):
        self.fail = fail
        self.hold = not fail if hold is None else hold  # fail=True, hold=True: held, then failed
        self.entered = threading.Event()
        self.release = threading.Event()
        self.calls = 0

    def before(self, op: str, args: tuple) -> None:
        if op != "fsync" or not stat_mod.S_ISDIR(os.fstat(args[0]).st_mode):
            return
        self.calls += 1
        self.entered.set()
        if self.hold:
            assert self.release.wait(30), "the test never released the directory fsync"
        if self.fail:
            raise OSError(errno.EIO, "injected EIO on a directory fsync")

    def after(self, op: str, args: tuple) -> None:
        pass


@pytest.fixture
def served(tmp_path):
    """A workspace with one staged file, its view, and the daemon's control
    handler serving it on a real control socket."""
    ws_path = tmp_path / "ws"
    ws_path.mkdir()
    (ws_path / "old.txt").write_bytes(b"old\n")
    ws = Workspace.open(str(ws_path), create=True)
    mountpoint = str(tmp_path / "mnt")
    view = Overlay(ws, mountpoint)
    write_file(view, "/new.txt", b"new\n")
    server = ControlServer(mountpoint, daemon.handler(view, ws, KernelCache()))
    server.start()
    try:
        yield ws, view, mountpoint
    finally:
        server.stop()
        ws.close()


def _in_thread(fn) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as exc:  # handed to the test
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


@pytest.mark.timeout(60)
def test_the_answer_comes_before_the_directory_fsyncs_and_the_view_does_not_wait_for_them(served):
    ws, view, mountpoint = served
    hook = DirFsyncs()
    with durable.installed(hook):
        answer = control.request(mountpoint, {"op": "commit", "message": "early"}, timeout=30)
        assert answer == {"ok": True, "number": 1}
        assert hook.entered.wait(10)  # the completion waits for the disk (held here)
        # The layer is published but not yet committed: the disk holds it up.
        assert _states(ws)[1] == "pending"
        assert (ws.path and open(os.path.join(ws.path, "new.txt"), "rb").read()) == b"new\n"
        # Requests that write nothing are served meanwhile (the view's lock is free).
        reader, got = _in_thread(lambda: (read_all(view, "/new.txt"), view.getattr("/old.txt")["st_size"]))
        reader.join(10)
        assert got.get("value") == (b"new\n", 4), got
        # History through the mount waits to show the layer the caller was
        # told of (not the head before it).
        latest, head = _in_thread(lambda: view.readlink("/.stepfs/layers/latest"))
        latest.join(0.3)
        assert latest.is_alive() and "value" not in head, head
        # A close-write waits for the completion: its row must not be
        # consumed with layer 1.
        writer, wrote = _in_thread(lambda: write_file(view, "/later.txt", b"after the step\n"))
        writer.join(0.5)
        assert writer.is_alive(), "a close-write went to the store while layer 1 was completing"
        hook.release.set()
        writer.join(10)
        assert not writer.is_alive() and "error" not in wrote, wrote
        latest.join(10)
        assert head == {"value": "1"}
        # The next control request is served after the completion ended.
        assert control.request(mountpoint, {"op": "ping"}, timeout=30)["readonly"] is None
    assert _states(ws) == {0: "committed", 1: "committed"}
    with ws.db.read() as conn:
        assert [r.path for r in staging.load(conn, view.step)] == [b"later.txt"]
    assert view.commit("the later file") == 2
    assert open(os.path.join(ws.path, "later.txt"), "rb").read() == b"after the step\n"


@pytest.mark.timeout(60)
def test_a_failure_after_the_answer_leaves_the_layer_pending_and_the_mount_read_only(served, caplog):
    ws, view, mountpoint = served
    hook = DirFsyncs(fail=True)
    with caplog.at_level(logging.ERROR, logger="stepfs.control"), durable.installed(hook):
        assert control.request(mountpoint, {"op": "commit", "message": "fails late"}, timeout=30) == \
            {"ok": True, "number": 1}
        # Served after the commit's handling ended.
        reason = control.request(mountpoint, {"op": "ping"}, timeout=30)["readonly"]
        assert hook.calls == 1  # never retried
    assert reason is not None and reason.startswith("layer 1 could not be written into the workspace")
    assert "injected EIO" in reason and "stays pending" in reason
    assert f"read-only: {reason}" in view.status_text()
    assert read_all(view, "/.stepfs/status").decode() == view.status_text()
    assert any("failed after its answer was sent" in r.getMessage() and reason in r.getMessage()
               for r in caplog.records), caplog.text
    assert _states(ws)[1] == "pending"
    # The next step fails with that sentence; changes are refused, reads work.
    with pytest.raises(StoreUnavailable) as info:
        control.request(mountpoint, {"op": "commit", "message": "again"}, timeout=30)
    assert str(info.value) == (f"this mount is read-only ({reason}); "
                               f"unmount and mount again once the cause is fixed.")
    with pytest.raises(ReadOnly):
        write_file(view, "/refused.txt", b"x")
    assert read_all(view, "/new.txt") == b"new\n"
    # The next open recovers: the layer is rewritten, fsynced and committed.
    with Workspace.open(ws.path) as again:
        assert _states(again) == {0: "committed", 1: "committed"}
        with again.db.read() as conn:
            assert staging.load(conn, view.step) == []
    assert open(os.path.join(ws.path, "new.txt"), "rb").read() == b"new\n"


@pytest.mark.timeout(60)
def test_a_change_made_while_a_completion_fails_is_refused_not_dropped(served):
    """A namespace or metadata change made between the answer and a failed
    completion would be recorded in the step the pending layer consumes at
    recovery: it waits for the completion and is refused (EROFS) once the
    mount turned read-only, instead of succeeding and being lost."""
    ws, view, mountpoint = served
    mode = stat_mod.S_IMODE(view.getattr("/old.txt")["st_mode"])
    hook = DirFsyncs(fail=True, hold=True)
    with durable.installed(hook):
        assert control.request(mountpoint, {"op": "commit", "message": "fails late"}, timeout=30) == \
            {"ok": True, "number": 1}
        assert hook.entered.wait(10)  # the completion is waiting for the disk
        changer, changed = _in_thread(lambda: view.chmod("/old.txt", 0o600))
        maker, made = _in_thread(lambda: view.mkdir("/made", 0o755))
        changer.join(0.5)
        assert changer.is_alive(), f"a chmod went through while layer 1 was completing: {changed}"
        hook.release.set()
        changer.join(10)
        maker.join(10)
        assert not changer.is_alive() and not maker.is_alive()
    assert isinstance(changed.get("error"), ReadOnly), changed
    assert isinstance(made.get("error"), ReadOnly), made
    # Nothing the view shows was lost by the store: the old mode, no directory.
    assert stat_mod.S_IMODE(view.getattr("/old.txt")["st_mode"]) == mode
    assert "made" not in [name for name, *_ in view.readdir("/")[2:]]
    with Workspace.open(ws.path) as again:
        assert _states(again) == {0: "committed", 1: "committed"}
    assert stat_mod.S_IMODE(os.stat(os.path.join(ws.path, "old.txt")).st_mode) == mode
