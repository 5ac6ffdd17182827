"""Fault injection on the shared history's pull (issue 18's fault pass over
#22's ``store/shared/sync.py``), on both backends.  Kernel-free.

* An edit made outside stepfs between the pull's check of the disk and its
  switch is not overwritten: it is left and recorded as an
  ``outside-change`` conflict, as a commit and a rollback do.
* A pull failing while it writes its second layer (ENOSPC on a new file,
  EIO on a directory fsync past the commit point) leaves the first layer
  applied, nothing half-written, and the next sync finishes the job: the
  workspace then equals a clone of the history.
"""

from __future__ import annotations

import errno
import sqlite3
from pathlib import Path

import pytest
import sqlalchemy.exc
from sqlalchemy import select

from conftest import manifest
from store_kit import Stager
from stepfs.overlayfs.client import manage
from stepfs.overlayfs.client import shared as client
from stepfs.store import durable, schema, verify
from stepfs.store.errors import PublishFailed, StoreFull
from stepfs.store.publish import OUTSIDE_CHANGE
from stepfs.store.shared import sync
from stepfs.store.shared.url import parse
from stepfs.store.workspace import Workspace
from test_commit_outside_changes import EditAtIntent


def _ws(root: Path, files: dict[str, bytes]) -> Path:
    root.mkdir(parents=True)
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    Workspace.open(str(root), create=True).close()
    return root


def _stage(ws_path: Path, files: dict[str, bytes]) -> None:
    with Workspace.open(str(ws_path)) as ws:
        st = Stager(ws, "/test/mnt")
        for rel, data in files.items():
            st.file(rel, data)


def _step(ws_path: Path, message: str) -> dict:
    return client.step(manage.Target(str(ws_path)), None, message=message)


def _sync(ws_path: Path) -> dict:
    return client.sync_workspace(manage.Target(str(ws_path)))


def _conflicts(ws_path: Path) -> list[tuple[bytes, str]]:
    with Workspace.open(str(ws_path)) as ws, ws.db.read() as conn:
        return sorted((r.path, r.reason) for r in conn.execute(select(schema.conflicts)))


def _pair(history_url, tmp_path) -> tuple[Path, Path]:
    a = _ws(tmp_path / "a", {"f.txt": b"f base\n", "g.txt": b"g base\n", "d/h.txt": b"h base\n"})
    client.attach(str(a), history_url)
    b, _, _ = sync.clone(parse(history_url), str(tmp_path / "b"))
    return a, Path(b)


def test_an_edit_made_outside_during_a_pull_is_not_overwritten(history_url, tmp_path):
    a, b = _pair(history_url, tmp_path)
    _stage(a, {"f.txt": b"f from a\n", "g.txt": b"g from a\n"})
    assert _step(a, "a1")["published"][0]["shared"] == 1

    hook = EditAtIntent(lambda: (b / "f.txt").write_bytes(b"f edited outside in b, longer\n"))
    with durable.installed(hook):
        out = _sync(b)
    assert hook.done
    assert [p["shared"] for p in out["pulled"]] == [1]
    assert (b / "f.txt").read_bytes() == b"f edited outside in b, longer\n"
    assert (b / "g.txt").read_bytes() == b"g from a\n"
    assert _conflicts(b) == [(b"f.txt", OUTSIDE_CHANGE)]


@pytest.mark.parametrize("fault", ["ENOSPC-write", "EIO-fsync"])
def test_a_pull_failing_in_its_second_layer_is_finished_by_the_next_sync(history_url, tmp_path, fault):
    a, b = _pair(history_url, tmp_path)
    _stage(a, {"f.txt": b"f one\n", "new1.txt": b"new one\n"})
    assert _step(a, "a1")["published"][0]["shared"] == 1
    _stage(a, {"g.txt": b"g two\n", "d/new2.txt": b"new two\n"})
    assert _step(a, "a2")["published"][0]["shared"] == 2
    # The pull writes layer 1 then layer 2.  Fail layer 2 before its
    # commit point (ENOSPC writing its first new file) or after it (EIO at
    # the first directory fsync after its renames).
    hook = FailLayerTwo(fault)
    with durable.installed(hook):
        with pytest.raises(PublishFailed) as info:
            _sync(b)
    assert hook.failed
    assert info.value.errno == (errno.ENOSPC if fault == "ENOSPC-write" else errno.EIO)
    if fault == "ENOSPC-write":
        assert info.value.pending is None  # before layer 2's commit point: as if never tried
    else:
        assert info.value.pending is not None  # past it: pending, finished by recovery
    # Layer 1 is in b whole; of layer 2 nothing or all (a pending layer recovered).
    assert (b / "f.txt").read_bytes() == b"f one\n" and (b / "new1.txt").read_bytes() == b"new one\n"
    out = _sync(b)
    assert out["published"] == []
    c, number, _ = sync.clone(parse(history_url), str(tmp_path / "c"))
    assert number == 2
    assert _tree(b) == _tree(Path(c))
    assert _sync(b)["pulled"] == []


class FailLayerTwo:
    """Fails the pull's second layer: its first ``write`` (ENOSPC), or the
    first ``fsync`` after it renamed ``new2.txt`` into place (EIO)."""

    def __init__(self, fault: str):
        self.fault, self.renamed, self.writes, self.failed = fault, 0, 0, False

    def before(self, op: str, args: tuple) -> None:
        if self.failed:
            return
        if op == "rename" and args[1] in (b"new1.txt", b"new2.txt"):
            self.renamed += 1
        if self.fault == "ENOSPC-write" and op == "write" and self.renamed == 1:
            self.failed = True
            raise OSError(errno.ENOSPC, "injected ENOSPC")
        if self.fault == "EIO-fsync" and op == "fsync" and self.renamed == 2:
            self.failed = True
            raise OSError(errno.EIO, "injected EIO")

    def after(self, op: str, args: tuple) -> None:
        pass


def _tree(p: Path) -> dict:
    return {k: v for k, v in manifest(p).items() if not k.startswith(b".stepfs")}


class FailNthCommit:
    """The ``n``-th database COMMIT fails as SQLite reports a full disk."""

    def __init__(self, n: int):
        self.n, self.seen = n, 0

    def before(self, op: str, args: tuple) -> None:
        if op == "commit":
            self.seen += 1
            if self.seen == self.n:
                orig = sqlite3.OperationalError("database or disk is full")
                orig.sqlite_errorcode = 13  # SQLITE_FULL
                raise sqlalchemy.exc.OperationalError("COMMIT", {}, orig)

    def after(self, op: str, args: tuple) -> None:
        pass


def _two_pending_layers(tmp_path, url: str) -> Path:
    a, b = _pair(url, tmp_path)
    _stage(a, {"f.txt": b"f one\n", "new1.txt": b"new one\n"})
    _step(a, "a1")
    _stage(a, {"g.txt": b"g two\n", "d/new2.txt": b"new two\n"})
    _step(a, "a2")
    return b


def test_a_full_store_at_each_commit_of_a_pull_fails_clearly_and_the_next_sync_finishes(tmp_path):
    """SQLITE_FULL at every database COMMIT a pull of two layers makes
    (downloads, intents, 'committed' records, delta passes): the sync fails
    with a clear error or, where only an optional delta pass failed,
    succeeds; either way the next sync leaves the workspace equal to a
    clone of the history."""
    url = f"sqlite:///{tmp_path}/history.db?name=proj"
    counter = FailNthCommit(10 ** 9)
    with durable.installed(counter):
        _sync(_two_pending_layers(tmp_path / "count", url))
    total = counter.seen
    assert total >= 4
    clone, number, _ = sync.clone(parse(url), str(tmp_path / "clone"))
    assert number == 2
    outcomes = set()
    for n in range(1, total + 1):
        b = _two_pending_layers(tmp_path / f"n{n}", f"sqlite:///{tmp_path}/h{n}.db?name=proj")
        try:
            with durable.installed(FailNthCommit(n)):
                _sync(b)
            outcomes.add("ok")
        except (StoreFull, PublishFailed) as exc:
            outcomes.add(type(exc).__name__)
            assert "full" in str(exc) or "space" in str(exc), exc
        _sync(b)
        assert _tree(b) == _tree(Path(clone)), n
        assert _sync(b)["pulled"] == []
        with Workspace.open(str(b)) as ws:
            assert verify.verify(ws).ok
    assert "StoreFull" in outcomes or "PublishFailed" in outcomes, outcomes
