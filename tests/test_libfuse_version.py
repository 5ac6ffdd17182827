"""The libfuse version check (kernel-free): on a release whose private
layout is not verified, libfuse's internals are left alone with one log
line (overlayfs/daemon/libfuse/__init__.py)."""

from __future__ import annotations

import logging

import pytest

from stepfs.overlayfs.daemon import libfuse
from stepfs.overlayfs.daemon.libfuse.lowlevel import ListingCache


@pytest.mark.parametrize("running", [(3, 12, 0), (3, 16, 1), (3, 99, 0), (3, 14)])
def test_an_unverified_version_is_refused_with_one_log_line(monkeypatch, caplog, running):
    monkeypatch.delenv(libfuse.PRIVATE_ENV, raising=False)
    monkeypatch.setattr(libfuse, "version", lambda: running)
    with caplog.at_level(logging.INFO, logger="stepfs.fuse"):
        known = libfuse.private_layout_known()
    assert known is (running[:2] in libfuse.PRIVATE_LAYOUTS)
    said = [r.getMessage() for r in caplog.records]
    assert said == ([] if known else [f"libfuse {'.'.join(map(str, running))}: a version whose private layout "
                                      "stepfs has not verified; directory listings are not cached (the high-level "
                                      "path serves them)"])


def test_the_loaded_library_reports_its_version():
    running = libfuse.version()
    assert running[:2] == (libfuse.mfusepy.fuse_version_major, libfuse.mfusepy.fuse_version_minor)


def test_an_unverified_version_patches_nothing(monkeypatch):
    """install() returns before it reads any address: handed a null
    ``struct fuse *`` it would crash the process otherwise."""
    monkeypatch.setattr(libfuse, "version", lambda: (3, 99, 0))
    monkeypatch.delenv(libfuse.PRIVATE_ENV, raising=False)
    cache = ListingCache()
    assert cache.install(0) is False
    assert not cache.installed and not cache._slots and not cache._orig
