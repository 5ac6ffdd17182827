"""The control channel's answers (overlayfs/daemon/control.py and client/control.py), without a mount:
a handler may answer early and go on working; what fails after its answer
went out is logged, never sent."""

from __future__ import annotations

import logging
import threading

import pytest

from stepfs.overlayfs.client import control
from stepfs.overlayfs.daemon.control import ControlServer
from stepfs.store.errors import CommitConflict, DaemonError


@pytest.fixture
def server(tmp_path):
    servers = []

    def make(handler):
        srv = ControlServer(str(tmp_path / "mnt"), handler)
        srv.start()
        servers.append(srv)
        return str(tmp_path / "mnt")

    yield make
    for srv in servers:
        srv.stop()


def test_a_handler_that_answers_early_is_answered_once_and_finishes_its_work(server):
    finished = threading.Event()
    release = threading.Event()

    def handler(req, reply):
        reply({"number": 7})
        release.wait(10)  # the caller has its answer while we still work
        finished.set()
        return None

    mp = server(handler)
    assert control.request(mp, {"op": "commit"}, timeout=10) == {"ok": True, "number": 7}
    assert not finished.is_set()
    release.set()
    assert finished.wait(10)


def test_a_failure_after_the_early_answer_is_logged_not_sent(server, caplog):
    done = threading.Event()

    def handler(req, reply):
        try:
            reply({"number": 3})
            raise RuntimeError("bookkeeping broke")
        finally:
            done.set()

    mp = server(handler)
    with caplog.at_level(logging.ERROR, logger="stepfs.control"):
        assert control.request(mp, {"op": "commit"}, timeout=10)["number"] == 3
        assert done.wait(10)
        control.request(mp, {"op": "ping"}, timeout=10)  # the server handled the rest of that request first
    assert any("bookkeeping broke" in r.getMessage() or "bookkeeping broke" in str(r.exc_info)
               for r in caplog.records)


def test_a_plain_answer_and_a_domain_error_still_travel(server):
    def handler(req, reply):
        if req["op"] == "commit":
            raise CommitConflict("1 path(s) changed", ["a"])
        if req["op"] == "boom":
            raise ValueError("bad")
        return {"pong": True}

    mp = server(handler)
    assert control.request(mp, {"op": "ping"}, timeout=10) == {"ok": True, "pong": True}
    with pytest.raises(CommitConflict) as info:
        control.request(mp, {"op": "commit"}, timeout=10)
    assert info.value.paths == ["a"]
    with pytest.raises(DaemonError):
        control.request(mp, {"op": "boom"}, timeout=10)
