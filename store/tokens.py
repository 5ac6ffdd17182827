"""Version tokens of workspace paths (store side, no FUSE).

A token is an opaque string that changes whenever a path's content or
identity changes; tokens are only ever compared for equality.

* absent path:  ``absent``
* directory:    ``dir:<mode>`` (a directory's own mtime moves with every
  child and says nothing about the directory as a staged object)
* symlink:      ``link:<target hex>``
* file:         ``<dev>:<ino>:<size>:<mtime_ns>:<ctime_ns>`` from one stat.

``ctime_ns`` cannot be set from user space, so a rewrite whose mtime was put
back with ``utime`` still changes the token; ``ino`` catches save-by-rename.
The remaining hole (a same-size rewrite within one clock tick of the stat)
is the "racy git" case; the version-token work closes it with a content hash
for stats taken inside the racy window.
"""

from __future__ import annotations

import os
import stat as stat_mod

ABSENT = "absent"


def from_stat(st: os.stat_result | None, target: bytes | None = None) -> str:
    if st is None:
        return ABSENT
    mode = st.st_mode
    if stat_mod.S_ISDIR(mode):
        return f"dir:{stat_mod.S_IMODE(mode):o}"
    if stat_mod.S_ISLNK(mode):
        return f"link:{(target or b'').hex()}"
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


def of_path(st: os.stat_result | None, readlink) -> str:
    """The token of a path whose ``lstat`` is ``st``; ``readlink()`` gives
    its target, asked only for a symlink."""
    return from_stat(st, readlink() if st is not None and stat_mod.S_ISLNK(st.st_mode) else None)


#: A stat taken less than this after the file's last change may not see a
#: rewrite of the same size within the same timestamp tick ("racy git");
#: tokens taken inside the window carry a content hash as well.
RACY_WINDOW_NS = 2_000_000_000
HASH_SEP = "#"


def is_racy(st: os.stat_result, now_ns: int) -> bool:
    return stat_mod.S_ISREG(st.st_mode) and now_ns - max(st.st_ctime_ns, st.st_mtime_ns) < RACY_WINDOW_NS


def with_hash(token: str, digest: str) -> str:
    return f"{token}{HASH_SEP}{digest}"


def same(recorded: str, current: str, current_digest) -> bool:
    """Whether a path still has the version ``recorded``.

    ``current`` is the path's token now *without* a hash; ``current_digest``
    computes the content hash on demand.  A recorded token without a hash was
    taken outside the racy window, so any later change moved its ctime and
    plain equality decides; one with a hash needs equal stat fields *and*
    equal content.
    """
    rec_stat, sep, rec_digest = recorded.partition(HASH_SEP)
    cur_stat = current.partition(HASH_SEP)[0]
    if rec_stat != cur_stat:
        return False
    return not sep or current_digest() == rec_digest


def of_workspace(ws, path: bytes) -> str:
    """The token workspace path ``path`` has now (no hash), read inside the
    workspace's contained root (``ws``: a ``store.workspace.Workspace``)."""
    st = ws.root.lstat_or_none(path)
    if st is None:
        return ABSENT
    return from_stat(st, ws.root.readlink(path) if stat_mod.S_ISLNK(st.st_mode) else None)
