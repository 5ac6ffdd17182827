"""STEPFS_GUARD=0 (benchmark only) really turns the version-token checks off,
so the guard benchmark compares the guard against nothing else."""

from __future__ import annotations

import os

import pytest

from stepfs.overlayfs.core.errors import Stale
from stepfs.overlayfs.core.view import Overlay
from stepfs.store.workspace import Workspace


def _two_writers(view) -> None:
    a = view.open("/f", os.O_WRONLY, agent="a")
    b = view.open("/f", os.O_WRONLY, agent="b")
    view.write(a, b"from a", 0)
    view.write(b, b"from b", 0)
    view.flush(a)
    view.release(a)
    try:
        view.flush(b)
    finally:
        view.release(b)


@pytest.mark.parametrize("guard", ["1", "0"])
def test_guard_toggle(tmp_path, monkeypatch, guard):
    monkeypatch.setenv("STEPFS_GUARD", guard)
    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "f").write_bytes(b"old")
    ws = Workspace.open(str(tmp_path / "ws"), create=True)
    view = Overlay(ws, str(tmp_path / "mnt"))
    if guard == "1":
        with pytest.raises(Stale):
            _two_writers(view)
        expected = b"from a"
    else:
        _two_writers(view)  # last close wins, as on a plain directory
        expected = b"from b"
    fh = view.open("/f", os.O_RDONLY, agent="c")
    assert view.read(fh, 100, 0) == expected
    view.release(fh)
    ws.close()
