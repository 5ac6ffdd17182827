"""Sequences of step / rollback / prune / gc against a model (hypothesis,
kernel-free): every kept layer reads as the model says, pruned ones answer
LayerPruned, the workspace is the head, and the store verifies after every
operation."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

import pytest

from stepfs.store import gc, history, prune, publish, rollback, verify
from stepfs.store.errors import LayerPruned, NothingToRollBack
from store_kit import Stager, open_workspace

PATHS = ["a.txt", "b.txt", "c.bin"]


def text(seed: int, edit: int) -> bytes:
    lines = [b"seed %d line %d of some text\n" % (seed, k) for k in range(1500)]
    lines[edit % 1500] = b"edited %d\n" % edit
    return b"".join(lines)


contents = st.one_of(st.builds(text, st.integers(0, 2), st.integers(0, 3000)),
                     st.sampled_from([b"", b"small\n", b"x" * 70_000]))


class Retention(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="stepfs-model-"))
        self.ws = open_workspace(self.dir / "ws", {"a.txt": ("file", 0o644, text(0, 0))})
        self.model: dict[int, dict[str, bytes]] = {0: {"a.txt": text(0, 0)}}
        self.head = 0
        self.oldest = 0

    def teardown(self):
        self.ws.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _tree(self, number: int) -> dict[str, bytes]:
        out = {}
        with self.ws.db.read() as conn:
            for p in PATHS:
                state = history.state_at(conn, p.encode(), number)
                if state is None:
                    disk = self.dir / "ws" / p
                    if disk.exists():
                        out[p] = disk.read_bytes()
                elif state.kind == "file":
                    out[p] = self.ws.objects.read_all(conn, state.oid)
        return out

    @rule(writes=st.dictionaries(st.sampled_from(PATHS), st.one_of(st.none(), contents), min_size=1, max_size=3),
          temp=contents)
    def step(self, writes, temp):
        current = dict(self.model[self.head])
        s = Stager(self.ws)
        s.file("tmp.scratch", temp)  # created and deleted in the step: never in a layer
        s.whiteout("tmp.scratch")
        for p, data in writes.items():
            if data is None:
                if p in current:
                    s.whiteout(p)
                    del current[p]
            else:
                s.file(p, data)
                current[p] = data
        if current == self.model[self.head]:
            return
        n = publish.commit_step(self.ws, s.step, overwrite={r.path for r in s.rows()})
        self.head = n
        self.model[n] = current

    @rule(data=st.data())
    def roll_back(self, data):
        target = data.draw(st.sampled_from(sorted(self.model)))
        if target < self.oldest:
            with pytest.raises(LayerPruned):
                rollback.rollback(self.ws, target)
            return
        try:
            result = rollback.rollback(self.ws, target)
        except NothingToRollBack:
            assert self.model[target] == self.model[self.head]
            return
        self.head = result.layer
        self.model[self.head] = dict(self.model[target])

    @rule(keep=st.integers(1, 4))
    def prune(self, keep):
        result = prune.prune(self.ws, keep_last=keep)
        if result.keep_from is not None:
            self.oldest = result.keep_from

    @rule()
    def collect(self):
        gc.collect(self.ws)

    @invariant()
    def matches_the_model(self):
        report = verify.verify(self.ws)
        assert report.ok, report.problems
        disk = {p: (self.dir / "ws" / p).read_bytes() for p in PATHS if (self.dir / "ws" / p).exists()}
        assert disk == self.model[self.head]
        for n, tree in self.model.items():
            if n >= self.oldest:
                assert self._tree(n) == tree, n
            else:
                with self.ws.db.read() as conn, pytest.raises(LayerPruned):
                    history.require_layer(conn, n)


TestRetention = Retention.TestCase
TestRetention.settings = settings(max_examples=12, stateful_step_count=10, deadline=None,
                                  suppress_health_check=[HealthCheck.too_slow])
