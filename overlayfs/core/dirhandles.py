"""Descriptors of workspace directories kept between lookups (FUSE-free).

Looking up a workspace name costs ``Root.lstat``: an ``openat2`` of the
whole path beneath the root, an ``fstat`` and a ``close``.  With a
descriptor of the name's directory at hand it is one ``fstatat`` of one
name relative to it, a third of the time.  Lookups come in runs per
directory (``git status`` asks for each tracked file, a build for each
header), so :class:`DirHandles` keeps the descriptors of the directories
recently looked in.

Containment: a kept descriptor is opened by ``Root.open`` (beneath the
root, no symlink in any component, ``O_NOFOLLOW``), and the name stat'ed
relative to it is one component, never ``..``, never followed: nothing
outside that directory is reached.  A name at the root is stat'ed through
the root's own descriptor.  A name starting with a dot (``..``, the
store's ``.stepfs``) always takes ``Root.lstat``, whose checks decide.

What keeps a descriptor true: it names the directory that was at its path
when it was opened, and it goes wrong only when that directory, or one
above it, is removed, renamed or replaced.  So descriptors are kept only
for directories the mount's watcher watches (``keep``), which sees every
such change made outside this mount (:meth:`changed`, from the watcher
thread); the mount's own changes to the workspace are its commits (the
view calls :meth:`stale` around them) and, in unversioned trees, its
pass-through calls and a run's bind mounts, which is why no directory in an
unversioned tree is kept (``keep`` says no; a change of the rules empties
the table).  Between an outside rename and its event a lookup may answer
from the directory under its old name, as the kernel's own cached entries
do until the same event reaches them.

Threading: the descriptors are used and closed only under the view's lock;
another thread only marks the table stale (:meth:`changed`, :meth:`stale`,
:attr:`enabled`), and the next user empties it, so no descriptor is ever
closed while a lookup uses it.
"""

from __future__ import annotations

import os
from typing import Callable, Iterable

from stepfs.overlayfs.core.upper import rel

#: Descriptors kept at most (the oldest opened is closed first): a few
#: hundred directories cover a repository's working set, and stay far from
#: the process's descriptor limit.
LIMIT = 256

_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW


class DirHandles:
    """Kept descriptors of workspace directories, by view path (see the
    module docstring).  Off until :meth:`start`."""

    def __init__(self, root, limit: int = LIMIT):
        self.root = root
        self.limit = limit
        #: Cleared (from any thread) when the mount stops watching.
        self.enabled = False
        self._keep: Callable[[str], bool] | None = None
        self._generation: Callable[[], int] = lambda: 0
        self._seen_generation = 0
        self._fds: dict[str, int] = {}
        #: Every kept path and each directory above it (view paths).
        self._above: set[str] = set()
        self._stale = False

    def start(self, keep: Callable[[str], bool], generation: Callable[[], int]) -> None:
        """Keep descriptors of the directories ``keep(path)`` accepts, until
        ``generation()`` (of the unversioned rules) changes."""
        self._keep, self._generation = keep, generation
        self._seen_generation = generation()
        self.enabled = True

    def fd(self, path: str) -> int:
        """A descriptor of the workspace directory at view path ``path``
        (not the root), or -1 when none is kept or may be.  Under the
        view's lock."""
        if not self.enabled:
            if self._fds:
                self._reset()  # the mount stopped watching: close what it kept
            return -1
        if self._stale or self._seen_generation != self._generation():
            self._reset()
        fd = self._fds.get(path)
        if fd is not None:
            return fd
        if not self._keep(path):
            return -1
        # Named before the open: an event about the directory that the
        # watcher handles from here on finds it (a spare reset at worst).
        above, up = self._above, path
        while up and up not in above:
            above.add(up)
            up = up.rpartition("/")[0]
        try:
            fd = self.root.open(rel(path), _FLAGS)
        except OSError:
            return -1
        fds = self._fds
        if len(fds) >= self.limit:
            os.close(fds.pop(next(iter(fds))))  # the oldest; _above keeps its paths (a spare reset at worst)
        fds[path] = fd
        return fd

    def lstat(self, path: str) -> os.stat_result | None:
        """``lstat`` of view path ``path`` (not the root) through its
        directory's kept descriptor; None when that cannot answer (no
        descriptor, or a name starting with a dot): ask ``Root.lstat``.
        Raises ``OSError`` as ``lstat`` does."""
        head, _, name = path.rpartition("/")
        if not name or name[0] == ".":
            return None  # a dot name (the store's, "..") or an unnormalized path: Root's checks decide
        fd = self.fd(head) if head else (self.root.fd if self.enabled else -1)
        if fd < 0:
            return None
        return os.stat(name, dir_fd=fd, follow_symlinks=False)

    def changed(self, paths: Iterable[str]) -> None:
        """These view paths were removed, renamed or replaced in the
        workspace (any thread): the table is stale when one of them is a
        kept directory or above one."""
        above = self._above
        if any(p in above for p in paths):
            self._stale = True

    def stale(self) -> None:
        """The workspace may have changed anywhere (a commit, a rollback,
        lost events): empty the table before its next use (any thread)."""
        self._stale = True

    def close(self) -> None:
        """Close every descriptor (the view closes; under its lock)."""
        self.enabled = False
        self._reset()

    def _reset(self) -> None:
        fds, self._fds = self._fds, {}
        self._above = set()
        self._stale = False
        self._seen_generation = self._generation()
        for fd in fds.values():
            os.close(fd)
