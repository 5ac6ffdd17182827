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
for stats taken inside the racy window, except on a device proven to have
no such tick (:data:`FINE_CTIME_DEVICES`).
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

#: Devices (``st_dev``) where every change made after a stat moves the
#: file's ctime to a new value, so no stat taken there is racy and a token
#: needs no hash however fresh the file.  Linux 6.13 and later stamp such a
#: change from the fine clock once ctime has been read ("multigrain
#: timestamps": ext4, xfs, btrfs, tmpfs).  Only :func:`learn_fine_ctime`
#: adds a device, after proving it there; every other keeps the window.
FINE_CTIME_DEVICES: set[int] = set()

#: File systems whose timestamps this kernel sets itself (no server or
#: daemon in between whose clock or cache could differ): the only ones probed.
LOCAL_TIMESTAMPS = frozenset({"ext4", "xfs", "btrfs", "tmpfs"})

#: Changes the probe makes, each right after a stat: with timestamps from a
#: coarse clock (a tick is 1 to 10 ms, these take microseconds) most of
#: them would keep the ctime the stat saw.
PROBE_CHANGES = 64


def is_racy(st: os.stat_result, now_ns: int) -> bool:
    return (stat_mod.S_ISREG(st.st_mode) and st.st_dev not in FINE_CTIME_DEVICES
            and now_ns - max(st.st_ctime_ns, st.st_mtime_ns) < RACY_WINDOW_NS)


def learn_fine_ctime(dir_path: str) -> bool:
    """Whether the device of directory ``dir_path`` moves ctime on every
    change after a stat; if so it joins :data:`FINE_CTIME_DEVICES`.  Proven
    on an unnamed file made in ``dir_path`` (``O_TMPFILE``: nothing is left
    behind, even by a crash): :data:`PROBE_CHANGES` times a stat, a write,
    a stat, and never the same ctime twice.  A file system not in
    :data:`LOCAL_TIMESTAMPS`, or one that cannot make the file, keeps the
    racy window."""
    dev = os.stat(dir_path).st_dev
    if dev in FINE_CTIME_DEVICES:
        return True
    if fs_type(dev) not in LOCAL_TIMESTAMPS:
        return False
    try:
        fd = os.open(dir_path, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    except OSError:
        return False
    try:
        for i in range(PROBE_CHANGES):
            seen = os.fstat(fd).st_ctime_ns
            os.pwrite(fd, bytes((i,)), 0)
            if os.fstat(fd).st_ctime_ns == seen:
                return False
    except OSError:
        return False  # a full disk, say: not proven, and no reason to stop a mount
    finally:
        os.close(fd)
    FINE_CTIME_DEVICES.add(dev)
    return True


def fs_type(dev: int) -> str | None:
    """The type of the file system mounted from device ``dev``, as this
    process's mount table (``/proc/self/mountinfo``) names it; None if no
    mount there has that device."""
    want = f"{os.major(dev)}:{os.minor(dev)}"
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 2 and fields[2] == want and "-" in fields:
                    return fields[fields.index("-") + 1]
    except OSError:
        pass
    return None


def with_hash(token: str, digest: str) -> str:
    return f"{token}{HASH_SEP}{digest}"


def same(recorded: str, current: str, current_digest) -> bool:
    """Whether a path still has the version ``recorded``.

    ``current`` is the path's token now *without* a hash; ``current_digest``
    computes the content hash on demand.  A recorded token without a hash was
    taken outside the racy window (or on a device without one), so any later
    change moved its ctime and plain equality decides; one with a hash needs
    equal stat fields *and* equal content.
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
