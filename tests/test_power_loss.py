"""Power loss at every durability call of a commit, in a model with teeth.

``crashkit.PowerLoss`` watches every call through ``store.durable`` and
keeps what a power cut would leave: file bytes only once fsynced, directory
entries and modes only once the directory is fsynced, the database as of its
last durable commit.  Each such image is written out and recovered; the
workspace must be exactly OLD or NEW and agree with the layer table.

The mutation check proves the model can fail: treating any one fsync site of
the protocol (or the durable commit of the intent) as never having happened
must produce an image that does not recover to OLD or NEW.
"""

from __future__ import annotations

import shutil

import pytest

from crashkit import (  # noqa: F401  (fast_tmp is a fixture)
    PowerLoss, ProcessCrash, check_recovered, commit, copy_template, fast_tmp, make_template, materialize,
    recover_images,
)
from stepfs.store import durable, publish
from stepfs.store.workspace import Workspace


def run_model(t, base, ignore=frozenset()) -> PowerLoss:
    ws_path = copy_template(t, base / "run")
    with Workspace.open(str(ws_path), recover=False) as ws:
        model = PowerLoss(ws_path, ignore)
        with durable.installed(model):
            commit(ws, t)
        model.finish()
    shutil.rmtree(base / "run")
    return model


@pytest.mark.parametrize("n_paths", [1, 8])
def test_power_loss_at_every_durability_call_ends_in_old_or_new(fast_tmp, n_paths):
    t = make_template(fast_tmp, n_paths)
    model = run_model(t, fast_tmp)
    failures, seen = recover_images(model, t, fast_tmp)
    assert failures == []
    assert seen["OLD"] > 0 and seen["NEW"] > 0, seen


@pytest.mark.timeout(180)
def test_removing_any_one_fsync_makes_the_model_fail(fast_tmp):
    t = make_template(fast_tmp, 8)
    sites = run_model(t, fast_tmp).sites
    fsyncs = sorted(s for s, op in sites.items() if op == "fsync")
    commits = sorted(s for s, op in sites.items() if op == "commit")
    # The protocol's own fsync sites: directories (begun by the switch,
    # waited for by the completion before its COMMIT) and new files
    # (fsynced by _write_intent while it records the intent).
    assert [s.split(":")[1] for s in fsyncs] == ["_complete", "_write_intent"], fsyncs
    # Durable commits: the intent (the commit point) and the completion.
    assert sorted(s.split(":")[1] for s in commits) == ["_complete", "_write_intent"], commits
    intent = next(s for s in commits if ":_write_intent:" in s)
    for site in fsyncs + [intent]:
        failures, _ = recover_images(run_model(t, fast_tmp, frozenset({site})), t, fast_tmp)
        assert failures, f"the power-loss model still passes without the fsync at {site}: it has no teeth there"
    # The completion's durability only spares recovery a redo: without it a
    # power cut leaves the layer pending and recovery publishes it again.
    completion = next(s for s in commits if ":_complete:" in s)
    failures, _ = recover_images(run_model(t, fast_tmp, frozenset({completion})), t, fast_tmp)
    assert failures == []


def test_power_loss_after_a_recovery_that_finished_a_killed_commit(fast_tmp):
    """The process dies at call k, recovery finishes the commit, then the
    power fails: whatever the killed run had changed but not yet synced must
    have been synced by the recovery before it marked the layer committed."""
    t = make_template(fast_tmp, 8)
    total = len(run_model(t, fast_tmp).images) - 1
    failures, seen = [], {"OLD": 0, "NEW": 0}
    for k in range(1, total + 1):
        ws_path = copy_template(t, fast_tmp / "run")
        with Workspace.open(str(ws_path), recover=False) as ws:
            model = PowerLoss(ws_path, crash_at=k)
            with durable.installed(model):
                with pytest.raises(ProcessCrash):
                    commit(ws, t)
        with Workspace.open(str(ws_path), recover=False) as ws, durable.installed(model):
            publish.recover(ws)
        model.finish()
        shutil.rmtree(fast_tmp / "run")
        label, tree, db = model.images[-1]
        image = fast_tmp / "image" / "ws"
        materialize(tree, db, image)
        try:
            seen[check_recovered(image, t)] += 1
        except AssertionError as exc:
            failures.append(f"killed at {k}, recovered, then power loss: {exc}")
        shutil.rmtree(image.parent)
    assert failures == []
    assert seen["OLD"] > 0 and seen["NEW"] > 0, seen
