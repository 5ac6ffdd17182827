"""A shared history's server that stops answering (SIGSTOP: the process
lives, its Unix socket accepts, nothing replies) fails a command with exit
code 19 within a bound instead of hanging it: the connect by its
``connect_timeout``, a statement on an open connection by the client's own
stall bound (``remote.STALL_TIMEOUT``; the server's timeouts cannot fire
while it is stopped).  Real PostgreSQL (tests/pgserver.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from contextlib import contextmanager

import pytest

from conftest import stepfs
from test_shared_cli import _ok, _stage, _workspace

from stepfs.store.errors import HistoryUnreachable
from stepfs.store.shared import remote as remote_mod
from stepfs.store.shared.remote import LayerRecord, Remote
from stepfs.store.shared.url import CONNECT_TIMEOUT, parse

#: Slack for a loaded machine (a CLI start-up, the server's own start of a session).
SLACK = 15


@contextmanager
def stopped(server):
    """Every process of the cluster SIGSTOPped; always continued after.
    The postmaster first, so it forks no child after the listing; a child
    that exits between the listing and its signal (a backend ending its
    session) needs no stopping."""
    with open(os.path.join(server.data, "postmaster.pid")) as f:
        postmaster = int(f.readline())
    pids = [postmaster]
    try:
        os.kill(postmaster, signal.SIGSTOP)
        children = subprocess.run(["pgrep", "-P", str(postmaster)], capture_output=True, text=True).stdout.split()
        for pid in map(int, children):
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:
                continue
            pids.append(pid)
        yield
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass


def test_commands_against_a_stopped_server_exit_19_within_the_connect_bound(pg_server, pg_url, tmp_path):
    ws = _workspace(tmp_path / "ws", {"a.txt": b"a\n"})
    _ok(stepfs("sync", ws, "--history", pg_url))
    _stage(ws, {"a.txt": b"staged\n"})
    with stopped(pg_server):
        for args in (("log", "--history", pg_url), ("step", ws, "-m", "x"), ("sync", ws)):
            t = time.monotonic()
            res = stepfs(*args, timeout=CONNECT_TIMEOUT + 60)
            took = time.monotonic() - t
            err = res.stderr.decode()
            assert res.returncode == 19, (args, err)
            assert "cannot be reached" in err and "timeout" in err and err.count("\n") == 1
            assert took < CONNECT_TIMEOUT + SLACK, (args, took)
    # Nothing was written; the step goes through once the server answers again.
    assert (ws / "a.txt").read_bytes() == b"a\n"
    res = _ok(stepfs("step", ws, "-m", "later", "--json"))
    assert res["published"][0]["shared"] == 1


def test_a_server_stopped_under_an_open_connection_is_cut_after_the_stall_bound(pg_server, pg_url, monkeypatch):
    monkeypatch.setattr(remote_mod, "STALL_TIMEOUT", 2)
    record = LayerRecord(0, "baseline", 1, "m", "", "", {}, "w" * 32, "/ws", "host", None)
    with Remote.open(parse(pg_url)) as remote:
        remote.create(record, [])
        with remote.lock():
            assert remote.head() == 0
            with stopped(pg_server):
                t = time.monotonic()
                with pytest.raises(HistoryUnreachable, match="did not answer for 2 s"):
                    remote.publish(0, record, [])
                assert time.monotonic() - t < 2 + SLACK
    with Remote.open(parse(pg_url)) as remote:
        assert remote.head() == 0 and [r.number for r in remote.layers()] == [0]  # nothing was published
