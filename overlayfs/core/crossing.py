"""A rename from a versioned path to an unversioned one (FUSE-free).

Tools make a tree in a temporary directory next to its place and rename it
in (pytest's ``.pytest_cache``: ``pytest-cache-files-XXXX`` renamed over;
installers' staging directories).  The temporary one is versioned (its
name matches no pattern), the place is not: the rename moves the tree out
of the open step into the workspace.  It is done as a copy and a removal,
which is what ``mv`` does across filesystems, but inside the daemon, so
that ``rename(2)`` succeeds:

1. every node below ``old`` is checked first (files, directories and
   symlinks only; anything else keeps the rename ``EXDEV``: nothing done);
2. the tree is copied, as the caller's agent sees it, into a hidden name
   next to ``new`` in the workspace (:data:`TMP_PREFIX`), then renamed over
   ``new`` (a directory there must be empty, as for ``rename(2)``);
3. ``old`` is removed through the view (a staged whiteout for what the
   workspace had, the staged rows dropped for what only the step had).

Not atomic as a whole: a daemon killed between 2 and 3 leaves the tree in
both places (nothing lost).  Cost O(bytes of the tree); the reverse
direction (unversioned to versioned) stays ``EXDEV``, for ``mv`` to copy.
"""

from __future__ import annotations

import errno
import os
import stat as stat_mod

#: The hidden name a moved tree is built under in the workspace.
TMP_PREFIX = ".stepfs-move-"
_COPY_CHUNK = 1 << 20


def _kids(view, path: str) -> list[str]:
    prefix = path if path != "/" else ""
    return [f"{prefix}/{name}" for name, _kind, _ino in view.readdir(path) if name not in (".", "..")]


def _plan(view, path: str, out: list[tuple[str, int]]) -> None:
    mode = view.getattr(path)["st_mode"]
    if not (stat_mod.S_ISREG(mode) or stat_mod.S_ISDIR(mode) or stat_mod.S_ISLNK(mode)):
        raise OSError(errno.EXDEV, "only files, directories and symlinks move out of versioning", path)
    out.append((path, mode))
    if stat_mod.S_ISDIR(mode):
        for kid in _kids(view, path):
            _plan(view, kid, out)


def move_to_unversioned(view, old: str, new: str, flags: int, agent: str) -> None:
    """Move the versioned tree ``old`` to the unversioned path ``new``."""
    pt = view.passthrough
    if flags & 2:  # RENAME_EXCHANGE: the unversioned side cannot enter the step this way
        raise OSError(errno.EXDEV, "an exchange between versioned and unversioned paths", new)
    target = pt.root.lstat_or_none(new.lstrip("/"))
    if target is not None and flags & 1:  # RENAME_NOREPLACE
        raise OSError(errno.EEXIST, "exists", new)
    plan: list[tuple[str, int]] = []
    _plan(view, old, plan)
    if target is not None:
        if stat_mod.S_ISDIR(target.st_mode) != stat_mod.S_ISDIR(plan[0][1]):
            raise OSError(errno.EISDIR if stat_mod.S_ISDIR(target.st_mode) else errno.ENOTDIR, "kind", new)
    head, _, name = new.rpartition("/")
    tmp = f"{head}/{TMP_PREFIX}{os.getpid()}-{name}"[:4000]
    try:
        for path, mode in plan:
            dest = tmp + path[len(old):]
            if stat_mod.S_ISDIR(mode):
                pt.mkdir(dest, stat_mod.S_IMODE(mode))
            elif stat_mod.S_ISLNK(mode):
                pt.symlink(dest, view.readlink(path))
            else:
                _copy_file(view, pt, path, dest, mode, agent)
        if target is not None and stat_mod.S_ISDIR(target.st_mode):
            pt.rmdir(new)  # ENOTEMPTY as rename(2) would say
        pt.rename(tmp, new)
    except BaseException:
        _remove_ws(pt, tmp)
        raise
    for path, mode in reversed(plan):
        if stat_mod.S_ISDIR(mode):
            view.changes.rmdir(path, agent)
        else:
            view.changes.unlink(path, agent)


def _copy_file(view, pt, src: str, dest: str, mode: int, agent: str) -> None:
    fh = view.content.open(src, os.O_RDONLY, agent)
    try:
        out = pt.create(dest, stat_mod.S_IMODE(mode), os.O_WRONLY | os.O_TRUNC)
        try:
            offset = 0
            while True:
                data = view.content.read(fh, _COPY_CHUNK, offset)
                if not data:
                    break
                pt.write(out, data, offset)
                offset += len(data)
        finally:
            pt.release(out)
    finally:
        view.content.release(fh)


def _remove_ws(pt, path: str) -> None:
    """Remove a partly built tree from the workspace (best effort)."""
    rel = path.lstrip("/")
    st = pt.root.lstat_or_none(rel)
    if st is None:
        return
    if stat_mod.S_ISDIR(st.st_mode):
        for name, _kind, _ino in pt.root.listdir(rel, decoded=True):
            _remove_ws(pt, f"{path}/{name}")
        pt.rmdir(path)
    else:
        pt.unlink(path)
