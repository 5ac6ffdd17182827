"""Files staged by reference, store side (no kernel): the import into the
object store is one transaction, and a process killed anywhere in a commit
of such a step (inside the import, or at any durability call after it)
recovers to OLD or NEW with nothing staged lost."""

from __future__ import annotations

import os
import shutil
import signal

import pytest

from conftest import manifest
from crashkit import (  # noqa: F401  (fast_tmp is a fixture)
    Counter, KillAt, commit, copy_template, crash_commit, fast_tmp, fork_run, make_template,
)
from stepfs.store import durable, publish, refs, staging
from stepfs.store.errors import MissingStagedContent
from stepfs.store.workspace import Workspace


@pytest.fixture
def by_ref_template(fast_tmp, monkeypatch):
    """The crash kit's 8-path step with every written file staged by reference."""
    monkeypatch.setattr(refs, "MIN_SIZE", 1)
    t = make_template(fast_tmp, 8)
    with Workspace.open(str(t.ws), recover=False) as ws, ws.db.read() as conn:
        rows = staging.load(conn, t.step)
    assert sum(r.scratch is not None for r in rows) >= 3, rows
    return t


def ref_rows(ws_path, step: int) -> dict[bytes, str | None]:
    with Workspace.open(str(ws_path), recover=False) as ws, ws.db.read() as conn:
        return {r.path: r.scratch for r in staging.load(conn, step) if r.kind == "file"}


def test_the_import_is_one_transaction(by_ref_template, fast_tmp):
    t = by_ref_template
    ws_path = copy_template(t, fast_tmp / "run")
    before = ref_rows(ws_path, t.step)
    names = sorted(n for n in before.values() if n is not None)
    os.unlink(os.path.join(refs.scratch_dir(str(ws_path / ".stepfs"), t.step), names[-1]))
    with Workspace.open(str(ws_path)) as ws:
        with pytest.raises(MissingStagedContent, match="is missing"):
            publish.import_refs(ws, t.step)
    assert ref_rows(ws_path, t.step) == before  # the files imported before the missing one are not either


def test_a_kill_inside_the_import_keeps_every_reference(by_ref_template, fast_tmp):
    t = by_ref_template
    ws_path = copy_template(t, fast_tmp / "run")
    before = ref_rows(ws_path, t.step)

    def body() -> None:
        ws = Workspace.open(str(ws_path), recover=False)
        real, calls = ws.objects.put_fd, []

        def put_then_die(conn, fd):
            calls.append(real(conn, fd))
            if len(calls) == 2:
                os.kill(os.getpid(), signal.SIGKILL)  # objects put, rows half rewritten
            return calls[-1]

        ws.objects.put_fd = put_then_die
        commit(ws, t)

    assert fork_run(body) == "killed"
    assert ref_rows(ws_path, t.step) == before
    with Workspace.open(str(ws_path)) as ws:
        commit(ws, t)
    assert manifest(ws_path) == t.new


@pytest.mark.timeout(300)
def test_kill_at_every_durability_call_of_a_by_reference_commit(by_ref_template, fast_tmp):
    t = by_ref_template
    counter = Counter()
    with Workspace.open(str(copy_template(t, fast_tmp / "count")), recover=False) as ws, durable.installed(counter):
        commit(ws, t)
    seen = {"OLD": 0, "NEW": 0}
    for k in range(1, counter.n + 2):
        run = fast_tmp / f"k{k}"
        outcome = crash_commit(t, run, KillAt(k))
        with Workspace.open(str(run / "ws")) as ws:  # recovery
            tree = manifest(run / "ws")
            if tree == t.old:
                seen["OLD"] += 1
                commit(ws, t)  # nothing staged was lost: the step still commits to NEW
                assert manifest(run / "ws") == t.new, f"kill before durability call {k}"
            else:
                assert tree == t.new, f"kill before durability call {k}: neither OLD nor NEW"
                seen["NEW"] += 1
        shutil.rmtree(run)
        if outcome == "completed":
            break
    assert seen["OLD"] > 0 and seen["NEW"] > 0, seen
