"""Crash atomicity of a step commit: SIGKILL at every durability call.

A forked child commits a staged step with a ``store.durable`` hook that
kills it just before the k-th durability call (fsync, rename, unlink, rmdir,
mkdir, symlink, database commit), for k = 1, 2, … until a run completes.
After each kill, opening the workspace runs recovery, and the workspace must
be exactly OLD or NEW with no temporary file left and a layer table (and open
step) that agrees with the tree.  Kernel-free: the step is staged through an
``Overlay`` without FUSE.
"""

from __future__ import annotations

import random
import shutil

import pytest

from crashkit import (  # noqa: F401  (fast_tmp is a fixture)
    Counter, KillAt, check_recovered, copy_template, crash_commit, crash_recovery, fast_tmp, make_template,
)
from stepfs.store import durable
from stepfs.store.workspace import Workspace


def count_calls(t, tmp_path) -> Counter:
    """The number of durability calls of one undisturbed commit."""
    ws_path = copy_template(t, tmp_path / "count")
    counter = Counter()
    with Workspace.open(str(ws_path), recover=False) as ws, durable.installed(counter):
        from crashkit import commit

        commit(ws, t)
    shutil.rmtree(tmp_path / "count")
    return counter


def crash_points(counter: Counter, n_paths: int) -> list[int]:
    """Every k (and k = total + 1, which completes) for the small steps.

    For the 200-path step (over 900 calls) a run costs a fork and a partial
    commit, so it takes every k in the first and last 10 calls and within 3
    of each database commit (the commit point and the completion), and every
    10th in between: the phases are long runs of the same call, and the full
    enumeration of the 8-path step (same kinds of change) covers every
    transition between phases."""
    total = counter.n
    if n_paths <= 8:
        return list(range(1, total + 2))
    commits = [i + 1 for i, op in enumerate(counter.trace) if op == "commit"]
    dense = set(range(1, 11)) | set(range(total - 9, total + 2))
    dense |= {k for c in commits for k in range(c - 3, c + 4)}
    return sorted(k for k in range(1, total + 2) if k in dense or k % 10 == 0)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n_paths", [1, 8, 200])
def test_kill_at_every_durability_call_ends_in_old_or_new(fast_tmp, n_paths):
    tmp_path = fast_tmp
    t = make_template(tmp_path, n_paths)
    counter = count_calls(t, tmp_path)
    total = counter.n
    # Two database commits: the intent (planned, before objects stored and
    # recorded in one transaction) and the completion.
    assert counter.by_op.get("fsync", 0) >= 2 and counter.by_op.get("commit", 0) >= 2, counter.by_op
    seen = {"OLD": 0, "NEW": 0}
    completed_at = None
    for k in crash_points(counter, n_paths):
        run = tmp_path / f"k{k}"
        outcome = crash_commit(t, run, KillAt(k))
        if outcome == "completed":
            completed_at = k
            assert check_recovered(run / "ws", t) == "NEW"
            break
        try:
            seen[check_recovered(run / "ws", t)] += 1
        except AssertionError as exc:
            raise AssertionError(f"kill before durability call {k} of {total} ({counter.trace[k - 1]}): {exc}") from None
        shutil.rmtree(run)
    # The run past the last call completes; crashes landed on both sides of
    # the commit point (otherwise this test could not tell anything apart).
    assert completed_at == total + 1
    assert seen["OLD"] > 0 and seen["NEW"] > 0, seen


@pytest.mark.timeout(200)
def test_kill_during_recovery_still_ends_in_old_or_new(fast_tmp):
    """Crash the commit at k1, then crash the recovery at k2 (sampled pairs),
    then recover for real: still exactly OLD or NEW."""
    tmp_path = fast_tmp
    t = make_template(tmp_path, 8)
    total = count_calls(t, tmp_path).n
    rng = random.Random(4)
    pairs = []
    for k1 in range(1, total + 1):
        for k2 in sorted(rng.sample(range(1, total + 1), 3)):
            pairs.append((k1, k2))
    rng.shuffle(pairs)
    recovery_crashed = 0
    for k1, k2 in pairs[:40]:
        run = tmp_path / f"p{k1}-{k2}"
        assert crash_commit(t, run, KillAt(k1)) == "killed"
        # A second crash, inside recovery (it may finish before k2).
        if crash_recovery(run / "ws", KillAt(k2)) == "killed":
            recovery_crashed += 1
            # ... and a third, at the first durability call of the next recovery.
            crash_recovery(run / "ws", KillAt(1))
        try:
            check_recovered(run / "ws", t)
        except AssertionError as exc:
            raise AssertionError(f"commit killed at {k1}, recovery at {k2}: {exc}") from None
        shutil.rmtree(run)
    assert recovery_crashed > 5  # the sample did hit recoveries in flight
