"""Fixes the conformance suite (tests/conformance) found, pinned at the view
level (no kernel): one test per fix."""

from __future__ import annotations

import errno
import os

import pytest

from overlayfs.fuse_ops import errno_for
from viewkit import open_view


@pytest.fixture
def ws_view(tmp_path):
    (tmp_path / "ws" / "d").mkdir(parents=True)
    return open_view(tmp_path)


def errno_of(fn, *args) -> int:
    try:
        fn(*args)
    except Exception as exc:  # a view error maps to errno in fuse_ops
        return errno_for(exc) if not isinstance(exc, OSError) else exc.errno
    return 0


def test_lookup_of_an_overlong_name_is_enametoolong(ws_view):
    _ws, view = ws_view
    view.mkdir("/new", 0o755)  # opaque: lookups below it never reach the workspace
    for parent in ("", "/d", "/new"):
        assert errno_of(view.getattr, parent + "/" + "x" * 256) == errno.ENAMETOOLONG, parent
        assert errno_of(view.getattr, parent + "/" + "x" * 255) == errno.ENOENT, parent
