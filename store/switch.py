"""Steps 2 and 4 of a commit (``store.publish``): every new file made as a
temporary file in ``.stepfs/tmp``, then the switch that renames each over
its path (removals deepest first, directories shallowest first, directory
metadata last) and fsyncs every directory it touched.
"""

from __future__ import annotations

import errno
import logging
import os
import stat as stat_mod

from stepfs.store import durable, tokens, xattrs
from stepfs.store.completion import SYNC_BATCH, _DirSync, _sync_closing, _sync_dirs
from stepfs.store.contained import NODE_KINDS, kind_of, rdev_of
from stepfs.store.layers import Entry, State
from stepfs.store.plan import LEAF_KINDS, _current_kind, _lstat
from stepfs.store.ready import ReadyFiles, key_of
from stepfs.store.wsparts import WorkspaceParts

log = logging.getLogger("stepfs.publish")

def _depth(path: bytes) -> int:
    return path.count(b"/")


def _temp_name(number: int, seq: int) -> bytes:
    return f"L{number}-{seq}".encode()


def _prepare(ws: WorkspaceParts, number: int, entries: list[Entry], conn=None, keep: set[bytes] = frozenset(),
             ready: ReadyFiles | None = None) -> list[int]:
    """Step 2: every new file, symlink, FIFO, device node, socket and hard
    link as a temporary file in ``.stepfs/tmp``.  Returns the open descriptors of the regular
    files not fsynced yet; the caller fsyncs them (``durable.fsync_all`` or
    ``start_fsync_all``) before any of them is renamed into place, and
    closes them.  Files beyond a batch of :data:`SYNC_BATCH` are fsynced
    here, together, a batch at a time (one journal commit per batch instead
    of one per file, and a bounded number of open descriptors).

    A name depends only on the entry's position, so a re-run replaces the
    files of an interrupted one.  A hard link is made to the temporary file
    of the name it links to when that is in this layer, else to the
    workspace path (unchanged by the layer).  ``conn``: a transaction of
    the caller to read the objects in (else one of its own).  ``keep``:
    paths recovery leaves alone (:func:`classify`): no temporary file, and
    a hard link of one is made as a copy of its after state (the path
    itself holds something else).  ``ready``: files a mount daemon wrote
    ahead (``store/ready.py``), renamed into place of the ones they match,
    already fsynced.  Raises ``OSError``."""
    if conn is None:
        with ws.db.read() as own:
            return _prepare(ws, number, entries, own, keep, ready)
    root = ws.root
    seq_of = {e.path: seq for seq, e in enumerate(entries)}
    tmp_fd = ws.tmp.fd  # held by the workspace: never resolved by name here
    unsynced: list[int] = []

    def sync_batch() -> None:
        try:
            durable.fsync_all(unsynced)
        finally:
            for fd in unsynced:
                os.close(fd)
            unsynced.clear()

    try:
        # Links last: the files they link to must exist first.
        for seq in sorted(range(len(entries)), key=lambda i: entries[i].after_link is not None):
            e = entries[seq]
            if e.after.kind not in LEAF_KINDS or e.path in keep:
                continue
            tmp_name = _temp_name(number, seq)
            try:
                os.unlink(tmp_name, dir_fd=tmp_fd)
            except FileNotFoundError:
                pass
            owner = _owner_for(ws, e.path, e.after)
            if e.after_link is not None and e.after_link not in keep:
                if e.after_link in seq_of:
                    os.link(_temp_name(number, seq_of[e.after_link]), tmp_name, src_dir_fd=tmp_fd,
                            dst_dir_fd=tmp_fd, follow_symlinks=False)
                else:
                    sfd, sname = root.parent(e.after_link)
                    try:
                        os.link(sname, tmp_name, src_dir_fd=sfd, dst_dir_fd=tmp_fd, follow_symlinks=False)
                    finally:
                        os.close(sfd)
            elif e.after.kind == "file":
                if ready is not None and ready.take(e.path, key_of(e.after.oid, e.after.mode, e.after.uid, e.after.gid,
                                                                   e.after.xattrs, e.after_mtime_ns), tmp_name, tmp_fd):
                    continue
                # A spare inode when there is one (``store.spares``: creating
                # is the dearest call here on some filesystems), else a new file.
                fd = ws.spares.take(tmp_name, tmp_fd)
                if fd is None:
                    fd = os.open(tmp_name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600,
                                 dir_fd=tmp_fd)
                unsynced.append(fd)
                ws.objects.write_to_fd(conn, e.after.oid, fd)
                if owner is not None:
                    os.fchown(fd, *owner)
                os.fchmod(fd, e.after.mode)
                if e.after.xattrs:
                    xattrs.apply_fd(fd, xattrs.decode(e.after.xattrs))
                if e.after_mtime_ns:
                    os.utime(fd, ns=(e.after_mtime_ns, e.after_mtime_ns))
                if len(unsynced) >= SYNC_BATCH:
                    sync_batch()
            elif e.after.kind in NODE_KINDS:
                # A socket too is an S_IFSOCK node (what bind() leaves behind);
                # a device needs CAP_MKNOD, as it did to be made in the mount.
                os.mknod(tmp_name, NODE_KINDS[e.after.kind] | 0o600, rdev_of(e.after.kind, e.after.target),
                         dir_fd=tmp_fd)
                if owner is not None:
                    os.chown(tmp_name, *owner, dir_fd=tmp_fd, follow_symlinks=False)
                os.chmod(tmp_name, e.after.mode, dir_fd=tmp_fd)
            else:
                durable.symlink(e.after.target, tmp_name, dir_fd=tmp_fd)
                if owner is not None:
                    os.chown(tmp_name, *owner, dir_fd=tmp_fd, follow_symlinks=False)
    except BaseException:
        for fd in unsynced:  # never fsynced: the commit fails anyway
            os.close(fd)
        raise
    return unsynced


def _remove_temps(ws: WorkspaceParts) -> None:
    """Delete every temporary file (only commits use ``.stepfs/tmp``, and the
    caller holds the commit lock)."""
    for name in os.listdir(ws.tmp_dir):  # /proc/self/fd/N of the held handle
        try:
            os.unlink(name, dir_fd=ws.tmp.fd)
        except (FileNotFoundError, IsADirectoryError):
            pass


class _Prepped:
    """What :func:`_switch_prep` found and opened for a layer of files
    only (no directory made, removed or replaced): each distinct parent
    directory opened once (``O_RDONLY``: the renames' ``dir_fd`` and the
    directory fsyncs), and each entry's current kind."""

    def __init__(self) -> None:
        self.parents: dict[bytes, int] = {}
        self.kinds: dict[bytes, str | None] = {}

    def close(self) -> None:
        for fd in self.parents.values():
            os.close(fd)
        self.parents.clear()


def _split(path: bytes) -> tuple[bytes, bytes]:
    parent, _, name = path.rpartition(b"/")
    return parent or b".", name


def _switch_prep(ws: WorkspaceParts, entries: list[Entry]) -> _Prepped | None:
    """The part of :func:`_switch` that changes nothing in the workspace,
    done while the intent is being committed (a commit runs it on the fsync
    pool meanwhile): open every parent once and look at what each path is
    now.  Retiring is left to the switch: a second name moves the file's
    ctime, so its token, and a commit that fails before its commit point
    must leave every token as it was (a retry would see a conflict).
    None for a layer that makes, removes or replaces a
    directory, or when anything here fails: :func:`_switch` then does all
    of it itself, in its own order."""
    if any(e.after.kind == "dir" for e in entries):
        return None
    prepped = _Prepped()
    try:
        for e in entries:
            parent, name = _split(e.path)
            pfd = prepped.parents.get(parent)
            if pfd is None:
                pfd = prepped.parents[parent] = ws.root.open(parent, os.O_RDONLY | os.O_DIRECTORY)
            try:
                kind = kind_of(os.stat(name, dir_fd=pfd, follow_symlinks=False).st_mode)
            except FileNotFoundError:
                kind = None
            if kind == "dir":
                prepped.close()
                return None
            prepped.kinds[e.path] = kind
    except OSError as exc:
        log.debug("switch not prepared ahead (%s); it does all of it itself", exc)
        prepped.close()
        return None
    return prepped


#: The mode the switch makes a new directory with; its own mode is set last.
_NEW_DIR_MODE = 0o700


def _switch(ws: WorkspaceParts, number: int, entries: list[Entry], wait: bool = True,
            prepped: _Prepped | None = None, keep: set[bytes] = frozenset(),
            expect: dict[bytes, str] | None = None, left: list[Entry] | None = None) -> _DirSync | None:
    """Step 4: make the workspace match every entry's after state, using the
    temporary files of :func:`_prepare`.

    Idempotent: running it again (after :func:`_prepare`) following a crash
    at any point completes the same result.  Raises ``OSError`` on any
    failure, a failed fsync included, which is never retried here.

    ``wait=False``: the last batch of directory fsyncs is returned (a
    :class:`_DirSync`, begun by its ``start``) instead of done; the caller
    MUST wait for it before it marks the layer committed, and close it.

    ``prepped``: what :func:`_switch_prep` did ahead for a layer of files
    only (taken over: its descriptors are closed here or handed to the
    result): the same durable calls run in the same order on the parents
    it opened and the kinds it found.

    ``keep``: paths left as they are (recovery: they hold something the
    layer must not overwrite, :func:`classify`); the directories that hold
    them are fsynced all the same.

    ``expect``: the token each path had when the plan captured its before
    state (a commit; recovery checks with :func:`classify` instead).  Just
    before the switch first changes a path it compares the path's token
    now: a path changed outside stepfs since the plan (or a directory to
    remove that received a name meanwhile, ``ENOTEMPTY``) is not touched
    and its entry appended to ``left`` (design semantics 14: the caller
    records it as an ``outside-change`` conflict).
    """
    root = ws.root
    unchecked = dict(expect) if expect is not None else {}
    skipped: set[bytes] = set()
    #: Inodes this commit linked, unlinked or replaced a name of: that moved
    #: their ctime, so another name of the same inode is compared without it.
    touched: set[tuple[int, int]] = set()
    if expect is not None:
        # So did step 2's links of a new name to a workspace file outside the layer.
        paths = {e.path for e in entries}
        for e in entries:
            if e.after_link is not None and e.after_link not in paths:
                st = _lstat(ws, e.after_link)
                if st is not None:
                    touched.add((st.st_dev, st.st_ino))

    #: Paths of a commit found absent just before their publish (at the
    #: check, or removed by this switch): renamed with RENAME_NOREPLACE.
    absent: set[bytes] = set()

    def changed_outside(e: Entry, pfd: int, name: bytes) -> bool:
        """Whether ``e.path`` no longer has its planned token (checked once,
        before the first change the switch makes to it).

        Between this check and the rename that follows it is one system
        call.  A path found absent is renamed with RENAME_NOREPLACE, so a
        name made there meanwhile is never replaced.  For a path that
        exists the window cannot be closed: a write through a descriptor
        opened before the switch reaches the inode whenever it comes, after
        any check and after the rename too (only a lease, which needs the
        file open nowhere else and blocks every other opener, would order
        it); and RENAME_EXCHANGE followed by a check of the displaced inode
        and an exchange back only moves the window (between the two
        exchanges the path shows the layer's version, and a rename over it
        there would be undone by the exchange back) while the exchange
        itself moves the inode's ctime, the one field ``utime`` cannot
        forge."""
        want = unchecked.pop(e.path, None)
        if want is None:
            return False
        st, now = _token_at(pfd, name)
        if st is None:
            absent.add(e.path)
        if now != want and not (st is not None and stat_mod.S_ISREG(st.st_mode)
                                and (st.st_dev, st.st_ino) in touched
                                and now.rpartition(":")[0] == want.rpartition(":")[0]):
            return leave(e, "it was changed outside stepfs after the commit planned it")
        if st is not None:
            touched.add((st.st_dev, st.st_ino))  # the switch changes this name next
        return False

    def leave(e: Entry, why: str) -> bool:
        log.warning("commit of layer %d leaves %s alone: %s; the layer's version of it is kept as an "
                    "'outside-change' conflict", number, os.fsdecode(e.path), why)
        skipped.add(e.path)
        if left is not None:
            left.append(e)
        return True

    try:
        # Every parent of a touched path, and every directory whose mode the
        # layer sets, is fsynced at the end, whether or not this run changed
        # it: after a crash the re-run finds a removal or chmod already done
        # (in the page cache, maybe not on disk) and must still make it
        # durable before the layer is marked committed.
        dirs_to_sync: set[bytes] = {_split(e.path)[0] for e in entries}
        dirs_to_sync.update(e.path for e in entries if e.after.kind == "dir")
        if keep:
            entries_all, entries = entries, [e for e in entries if e.path not in keep]
            seq_of = {id(e): seq for seq, e in enumerate(entries_all)}  # temporary names follow the whole list
        else:
            seq_of = None

        def parent(path: bytes) -> tuple[int, bytes, bool]:
            """``(directory fd, name, whether the caller closes the fd)``.
            Without ``prepped`` each is opened when needed: a directory of
            the layer may have been made or removed since."""
            if prepped is not None:
                parent_path, name = _split(path)
                return prepped.parents[parent_path], name, False
            pfd, name = root.parent(path)
            return pfd, name, True

        def kind_now(path: bytes) -> str | None:
            return prepped.kinds[path] if prepped is not None else _current_kind(ws, path)

        # 1. removals, deepest first
        for e in sorted(entries, key=lambda e: -_depth(e.path)):
            cur = kind_now(e.path)
            if cur is None or cur == e.after.kind:
                continue
            pfd, name, owned = parent(e.path)
            try:
                if changed_outside(e, pfd, name):
                    pass
                elif cur == "dir":
                    try:
                        durable.rmdir(name, dir_fd=pfd)
                    except FileNotFoundError:
                        if expect is None:
                            raise
                        # removed outside as well after the check: gone, as the layer wants
                    except OSError as exc:
                        if expect is None or exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                            raise
                        leave(e, "it is a directory the layer removes, and a name was made in it outside stepfs")
                else:
                    ws.spares.retire(name, pfd)  # freed after the commit, not in the unlink
                    try:
                        durable.unlink(name, dir_fd=pfd)
                    except FileNotFoundError:
                        if expect is None:
                            raise
                if expect is not None and e.path not in skipped:
                    absent.add(e.path)
            finally:
                if owned:
                    os.close(pfd)

        # 2. new directories, shallowest first (none in a prepared layer)
        for e in sorted((e for e in entries if e.after.kind == "dir"), key=lambda e: _depth(e.path)):
            if e.path in skipped or _current_kind(ws, e.path) == "dir":
                continue
            pfd, name = root.parent(e.path)
            try:
                if not changed_outside(e, pfd, name):
                    durable.mkdir(name, _NEW_DIR_MODE, dir_fd=pfd)
            except FileExistsError:
                if expect is None:
                    raise
                # Made outside after the check (mkdir never replaces): leave
                # it, and what the layer puts below it.
                leave(e, "a name was made there outside stepfs while the commit made the directory")
                below = e.path + b"/"
                for child in entries:
                    if child.path.startswith(below) and child.path not in skipped:
                        leave(child, f"{os.fsdecode(e.path)} was made outside stepfs while the commit made it")
            finally:
                os.close(pfd)

        # 3. files, symlinks, FIFOs, devices, sockets and links: each
        # temporary file renamed over its path
        tmp_fd = ws.tmp.fd
        try:
            for seq, e in enumerate(entries):
                if e.after.kind not in LEAF_KINDS or e.path in skipped:
                    continue
                if seq_of is not None:
                    seq = seq_of[id(e)]
                pfd, name, owned = parent(e.path)
                try:
                    if changed_outside(e, pfd, name):
                        continue
                    if e.path in absent:
                        try:
                            durable.rename(_temp_name(number, seq), name, src_dir_fd=tmp_fd, dst_dir_fd=pfd,
                                           noreplace=True)
                        except FileExistsError:
                            leave(e, "it was made outside stepfs while the commit published it")
                        continue
                    # The replaced inode is freed after the commit, not inside
                    # the rename (``store.spares``: freeing is the dearest part).
                    ws.spares.retire(name, pfd)
                    durable.rename(_temp_name(number, seq), name, src_dir_fd=tmp_fd, dst_dir_fd=pfd)
                finally:
                    if owned:
                        os.close(pfd)
        finally:
            ws.spares.release()

        # 4. directory metadata (last, so a read-only directory is filled first)
        for e in entries:
            if e.after.kind == "dir" and e.path not in skipped:
                fd = root.open(e.path, os.O_RDONLY | os.O_DIRECTORY)
                try:
                    st = os.fstat(fd)
                    owner = _owner_for(ws, e.path, e.after)
                    if owner is not None and (st.st_uid, st.st_gid) != owner:
                        os.fchown(fd, *owner)
                    if stat_mod.S_IMODE(st.st_mode) != e.after.mode:
                        os.fchmod(fd, e.after.mode)
                    xattrs.apply_fd(fd, xattrs.decode(e.after.xattrs))
                finally:
                    os.close(fd)

        # 5. make every directory entry and metadata change durable: each
        # distinct directory once, all of a batch together (one journal
        # commit), a prepared parent on the descriptor it was opened with
        dir_fds: list[int] = []
        try:
            for d in sorted(dirs_to_sync):
                fd = prepped.parents.pop(d, None) if prepped is not None else None
                if fd is None:
                    try:
                        fd = root.open(d, os.O_RDONLY | os.O_DIRECTORY)
                    except OSError as exc:
                        if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                            continue  # removed, or replaced by a file or symlink, in this same layer
                        raise
                dir_fds.append(fd)
                if len(dir_fds) >= SYNC_BATCH:  # bounded: a big layer never holds every directory open
                    batch, dir_fds = dir_fds, []
                    _sync_closing(batch)
            last, dir_fds = dir_fds, []
        finally:
            for fd in dir_fds:
                os.close(fd)
        return _sync_dirs(last, wait)
    finally:
        if prepped is not None:
            prepped.close()


def _token_at(pfd: int, name: bytes) -> tuple[os.stat_result | None, str]:
    """``(lstat, version token)`` of ``name`` in directory ``pfd`` now (the
    token as the plan took it: ``tokens.from_stat``, a symlink with its
    target)."""
    try:
        st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
    except FileNotFoundError:
        return None, tokens.ABSENT
    return st, tokens.from_stat(st, os.readlink(name, dir_fd=pfd) if stat_mod.S_ISLNK(st.st_mode) else None)


def apply_entries(ws: WorkspaceParts, number: int, entries: list[Entry], left: dict[bytes, str] | None = None) -> None:
    """Steps 2 and 4 together: publish a layer whose intent is recorded
    (recovery).  Idempotent.  ``left`` (:func:`classify`): paths not
    touched (the directories holding them are fsynced all the same).
    Raises ``OSError``; the layer then stays pending."""
    keep = set(left or ())
    fds = _prepare(ws, number, entries, keep=keep)
    try:
        durable.fsync_all(fds)
    finally:
        for fd in fds:
            os.close(fd)
    _switch(ws, number, entries, keep=keep)


def _owner_for(ws: WorkspaceParts, path: bytes, state: State | None = None) -> tuple[int, int] | None:
    """The owner to give a published path when we run as root: the one the
    view recorded, else that of the file being replaced or of the directory
    a new file lands in, so a commit never hands a user's files to root."""
    if os.geteuid() != 0:
        return None
    if state is not None and state.uid is not None and state.gid is not None:
        return state.uid, state.gid
    for candidate in (path, path.rpartition(b"/")[0] or b"."):
        st = _lstat(ws, candidate)
        if st is not None:
            return st.st_uid, st.st_gid
    return None
