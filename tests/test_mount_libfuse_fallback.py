"""A libfuse whose private layout stepfs has not verified: nothing of
libfuse's internals is patched, and the mount works as before, only
without kernel-cached directory listings (libfuse/__init__.py).

test_libfuse_version.py forces the "unknown version" branch by the version
the check reads; here the daemon is forced into the same fallback through
``STEPFS_LIBFUSE_PRIVATE=off`` (it cannot be handed another libfuse
version), and runs the listing and outside-edit tests of
test_mount_listings.py and test_mount_watch.py against that mount.

Not run here: the two tests of a name removed outside while it is being
recreated through the mount (test_mount_watch.py).  Without the lookup
hook a LOOKUP cannot be told from a GETATTR, and that race can fail the
``open(O_CREAT)`` once with ENOENT (libfuse/notify.py, KernelCache)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from conftest import sh
from stepfs.overlayfs.client import control
from stepfs.overlayfs.daemon import libfuse
from stepfs.overlayfs.daemon.protocol import log_path
# Collected here again, each run against a mount in the fallback (the autouse fixture below).
from test_mount_listings import (  # noqa: F401
    ls, test_changes_through_the_mount_show_in_cached_listings, test_layers_listing_is_never_cached,
    test_outside_edits_show_in_cached_listings, test_rollback_shows_the_old_listings,
    test_step_and_discard_keep_cached_listings_true)
from test_mount_readdirplus import test_listed_entries_have_the_attributes_getattr_gives  # noqa: F401
from test_mount_watch import (  # noqa: F401
    test_a_directory_moved_outside, test_outside_edits_are_seen_before_the_timeout,
    test_save_by_rename_and_kind_changes_outside)


pytestmark = pytest.mark.mount


@pytest.fixture(autouse=True)
def unverified_libfuse(monkeypatch):
    monkeypatch.setenv(libfuse.PRIVATE_ENV, "off")  # inherited by every daemon this test starts


def test_the_mount_caches_no_listing_and_says_why(workspace, mount):
    (workspace / "a").write_text("a\n")
    m = mount(workspace)
    assert control.request(str(m.mountpoint), {"op": "ping"})["listings_cached"] is False
    said = Path(log_path(str(workspace), str(m.mountpoint))).read_text()
    assert said.count("directory listings are not cached") == 1, said
    assert f"{libfuse.PRIVATE_ENV}=off" in said
    assert ls(m.mountpoint) == ["a"] and ls(m.mountpoint) == ["a"]
    (workspace / "b").write_text("b\n")
    assert ls(m.mountpoint) == ["a", "b"]  # the very next listing: nothing was cached
    sh("echo c > c && mkdir d && mv c d/", m.mountpoint)
    assert ls(m.mountpoint) == ["a", "b", "d"] and os.listdir(m.path("d")) == ["c"]
