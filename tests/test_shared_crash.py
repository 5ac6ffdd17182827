"""A step on an attached workspace killed (SIGKILL) at each point of the
shared protocol: pull applied or not, local commit done or not, before the
publish's round trip, inside the head's transaction, once the publish
answered but before its COMMIT (nothing published), after it.  After each kill the
next ``sync`` leaves the workspace and the history agreeing: the step's
change is in the history exactly once and a clone equals the workspace."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest

from conftest import manifest
from pglock import head_row_locked, waiting_publisher
from store_kit import Stager
from stepfs.overlayfs.client import manage
from stepfs.overlayfs.client import shared as client
from stepfs.store import publish
from stepfs.store.shared import sync
from stepfs.store.shared.remote import Remote
from stepfs.store.shared.url import parse
from stepfs.store.shared.verifying import verify as verify_history
from stepfs.store.workspace import Workspace


def _kill_self(*_a, **_k):
    os.kill(os.getpid(), signal.SIGKILL)


def _before(obj, name):
    real = getattr(obj, name)

    def wrapper(*a, **k):
        _kill_self()
        return real(*a, **k)
    return wrapper


def _inside(url):
    """Killed while the publish waits on the server inside its
    transaction, the uploads sent in its round trip committed ahead of it
    (tests/pglock.py holds the history's row)."""
    def wrap(obj, name):
        real = getattr(obj, name)

        def wrapper(*a, **k):
            if not any("UPDATE stepfs_histories" in sql for sql, _params in a[1]):
                return real(*a, **k)  # the lock's round trip
            held = head_row_locked(url)
            held.__enter__()  # kept (referenced below) until the kill drops the connection
            threading.Thread(target=lambda: (waiting_publisher(url), _kill_self()), daemon=True).start()
            try:
                return real(*a, **k)
            finally:
                held.__exit__(None, None, None)  # not reached: the kill comes first
        return wrapper
    return wrap


def _after(obj, name):
    real = getattr(obj, name)

    def wrapper(*a, **k):
        out = real(*a, **k)
        _kill_self()
        return out
    return wrapper


def _after_publish_statement(obj, name):
    """Killed once the publish answered, its transaction open, COMMIT not sent."""
    real = getattr(obj, name)

    def wrapper(*a, **k):
        out = real(*a, **k)
        if any("UPDATE stepfs_histories" in sql for sql, _params in a[1]):
            _kill_self()
        return out
    return wrapper


#: point -> (object, attribute, wrap): where the child kills itself.
POINTS = {
    "before the pull's local layer": (publish, "write_layer", _before),
    "after the pull's local layer": (publish, "write_layer", _after),
    "before the local commit": (manage, "step", _before),
    "after the local commit": (manage, "step", _after),
    "before the publish's round trip (uploads held back)": (Remote, "publish", _before),
    "inside the head's transaction": (Remote, "_pipeline", _inside),
    "after the publish answered, before its COMMIT": (Remote, "_pipeline", _after_publish_statement),
    "after the head's transaction": (Remote, "publish", _after),
}


def _ws(root: Path, files: dict[str, bytes]) -> Path:
    root.mkdir()
    for rel, data in files.items():
        (root / rel).write_bytes(data)
    Workspace.open(str(root), create=True).close()
    return root


def _stage(ws_path: Path, files: dict[str, bytes]) -> None:
    with Workspace.open(str(ws_path)) as ws:
        st = Stager(ws)
        for rel, data in files.items():
            st.file(rel, data)


@pytest.mark.parametrize("point", sorted(POINTS))
def test_step_killed_at_each_point_recovers(point, pg_url, tmp_path):
    a = _ws(tmp_path / "a", {"mine.txt": b"0\n"})
    client.attach(str(a), pg_url)
    b = Path(sync.clone(parse(pg_url), str(tmp_path / "b"))[0])
    _stage(b, {"theirs.txt": b"from b\n"})
    client.step(manage.Target(str(b)), message="b")  # a is one layer behind: its step pulls first
    _stage(a, {"mine.txt": b"1\n"})
    obj, name, wrap = POINTS[point]
    if wrap is _inside:
        wrap = _inside(pg_url)
    pid = os.fork()
    if pid == 0:  # the child: the step, killed at the point
        try:
            setattr(obj, name, wrap(obj, name))
            client.step(manage.Target(str(a)), message="a")
        finally:
            os._exit(3)  # not reached when the point is on the path
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (point, status)
    if point == "after the publish answered, before its COMMIT":
        with Remote.open(parse(pg_url)) as r:
            assert r.head() == 1  # b's layer only: a transaction never committed publishes nothing
    # Recovery: the next sync, then a step for what is still staged.
    client.sync_workspace(manage.Target(str(a)))
    try:
        client.step(manage.Target(str(a)), message="a again")
    except Exception as exc:  # nothing left staged when the kill came after the local commit
        assert "nothing to commit" in str(exc), (point, exc)
    with Remote.open(parse(pg_url)) as r:
        head = r.head()
        changed = [n for n in range(1, head + 1) for e in r.entries(n) if e["path"] == b"mine.txt"]
        assert verify_history(r)[1] == []
    assert len(changed) == 1, (point, changed)  # published exactly once
    assert (a / "mine.txt").read_bytes() == b"1\n" and (a / "theirs.txt").read_bytes() == b"from b\n"
    c = Path(sync.clone(parse(pg_url), str(tmp_path / "c"))[0])
    assert manifest(c) == manifest(a), point
