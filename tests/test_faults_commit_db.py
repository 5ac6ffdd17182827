"""A commit whose database COMMITs fail, one at a time (issue 18's fault
pass: the store's own writes, which ``test_faults.py`` leaves to a real full
tmpfs).  At each COMMIT a commit makes (the import of staged references,
the plan and intent, the 'committed' record, the delta pass) SQLite reports
an I/O error or a full disk: the commit fails with a clear error (or, at
the optional delta pass, not at all), and the next open leaves the
workspace exactly OLD (the step still staged) or NEW (the layer
committed, the step consumed), with ``verify`` clean.  Kernel-free."""

from __future__ import annotations

import sqlite3

import pytest
import sqlalchemy.exc

from crashkit import (  # noqa: F401  (fast_tmp is a fixture)
    check_recovered, commit, copy_template, fast_tmp, make_template,
)
from stepfs.store import durable, verify
from stepfs.store.errors import PublishFailed, StoreUnavailable
from stepfs.store.workspace import Workspace


class FailNthCommit:
    def __init__(self, n: int, code: int):
        self.n, self.code, self.seen = n, code, 0

    def before(self, op: str, args: tuple) -> None:
        if op == "commit":
            self.seen += 1
            if self.seen == self.n:
                orig = sqlite3.OperationalError("disk I/O error" if self.code == 10 else "database or disk is full")
                orig.sqlite_errorcode = self.code
                raise sqlalchemy.exc.OperationalError("COMMIT", {}, orig)

    def after(self, op: str, args: tuple) -> None:
        pass


@pytest.mark.parametrize("code", [10, 13], ids=["SQLITE_IOERR", "SQLITE_FULL"])
def test_each_database_commit_of_a_commit_failing_leaves_old_or_new(fast_tmp, code):
    t = make_template(fast_tmp, 8)
    counter = FailNthCommit(10 ** 9, code)
    with Workspace.open(str(copy_template(t, fast_tmp / "count")), recover=False) as ws, \
            durable.installed(counter):
        commit(ws, t)
    total = counter.seen
    assert total >= 3
    outcomes = {}
    for n in range(1, total + 1):
        ws_path = copy_template(t, fast_tmp / f"n{n}")
        with Workspace.open(str(ws_path), recover=False) as ws:
            try:
                with durable.installed(FailNthCommit(n, code)):
                    commit(ws, t)
                raised = None
            except (StoreUnavailable, PublishFailed) as exc:
                raised = type(exc).__name__
                assert ("full" if code == 13 else "cannot write") in str(exc), exc
        state = check_recovered(ws_path, t)
        outcomes[n] = (raised, state)
        if raised is None:
            assert state == "NEW", n  # a commit that reported success is on disk
        with Workspace.open(str(ws_path)) as ws:
            assert verify.verify(ws).ok
            if state == "OLD":
                assert commit(ws, t) == 1  # the step is intact: it commits once the fault is gone
    assert {r for r, _ in outcomes.values()} - {None}, outcomes  # some COMMITs did fail the commit
