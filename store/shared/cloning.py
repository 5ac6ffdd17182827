"""``stepfs clone``: a new workspace holding a shared history as of a layer.

The workspace is built whole in a new sibling directory of the target
(``.NAME.stepfs-clone-XXXX``: same filesystem), then published by ONE
rename onto the target (absent, or an empty directory).  Nothing in the
tree exists for anyone else before that rename, so none of a rollback
switch's protections is needed: the files are written straight from the
downloaded bytes at their own paths (no temporary file and rename each, no
outside-change or version-token check), and made durable by one
``syncfs`` of the filesystem instead of an fsync each.  The local store
receives the same bytes (its objects), and the layer is recorded committed
at once: the tree it describes appears with it or not at all.

A crash before the rename leaves the target as it was (no workspace) and
the sibling behind, which the next clone into the same target removes
(each clone holds an ``flock`` on its sibling: a free one is a dead
clone's); after it, a complete, durable workspace.  A target that is no longer empty when the
rename comes (another clone into it) fails the clone with nothing
changed there.  Where no sibling can be made (the parent is not writable)
or the target is a mount point (a rename cannot replace it), the clone is
written in place through the rollback machinery instead
(``publish.write_layer``), as before.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import queue
import re
import shutil
import stat as stat_mod
import threading
import time
import uuid
from typing import Generator, Iterator

from stepfs.store import durable, entrytable, layers as local_layers, publish
from stepfs.store.errors import HistoryError, NoSuchLayer, WorkspaceError
from stepfs.store.journal import _INSERT_LAYER, intent_checksum
from stepfs.store.layers import Entry, State
from stepfs.store.shared import attachment, newtree, stall, stateread
from stepfs.store.shared.attachment import Attachment
from stepfs.store.shared.newtree import NewTree
from stepfs.store.shared.remote import Remote
from stepfs.store.shared.transfer import Downloader
from stepfs.store.shared.url import HistoryURL

#: The local layer's kind (``sync.SYNC``: a layer taken from the history).
SYNC = "sync"


def clone(url: HistoryURL, directory: str, at: int | None = None) -> tuple[str, int, int]:
    """Make ``directory`` (absent or empty) a workspace holding the history
    as of layer ``at`` (default: the head), attached to it.  Returns
    (workspace path, shared layer, local layer)."""
    directory = os.path.realpath(directory)  # a symlink to an empty directory: that directory, as before
    _check_target(directory)
    with Remote.open(url, hint=stall.RETRY_HINT) as remote:
        head = remote.head()
        if head is None:
            raise HistoryError(f"the shared history {url.display} does not exist; attach a workspace to make it "
                               f"with 'stepfs mount WS MNT --history URL' or 'stepfs sync WS --history URL'.")
        number = head if at is None else at
        if not 0 <= number <= head:
            raise NoSuchLayer(f"layer {number} does not exist in the shared history {url.display} (its head is "
                              f"{head}).")
        header = remote.layer(number)
        _refuse_pruned(remote, number, header)
        meta = {"shared_layer": number, "shared_host": header.host, "shared_workspace": header.workspace_path}
        message = f"clone of {url.display} at layer {number}"
        made = _make_staging(directory)
        if made is None:
            return _clone_in_place(url, remote, directory, number, meta, message)
        staging, held = made
        try:
            local = _build(url, remote, staging, number, meta, message)
            _publish_tree(staging, directory)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        finally:
            os.close(held)
    return directory, number, local


def _refuse_pruned(remote: Remote, number: int, header=None) -> None:
    """Exit 11 if ``stepfs prune --history`` dropped layer ``number``; asked
    again after its states are read, since a prune committed meanwhile
    leaves them half folded."""
    from stepfs.store.shared import prune as shared_prune

    if (header or remote.layer(number)).kind == shared_prune.PRUNED:
        raise shared_prune.pruned_error(remote, number, "cannot clone: ")


def _check_target(directory: str) -> None:
    if os.path.lexists(directory) and (not os.path.isdir(directory) or os.listdir(directory)):
        raise WorkspaceError(f"{directory} exists and is not an empty directory; clone into a new directory.")


#: What follows a sibling's prefix: a clone's own (its flock held until it ends).
_SIBLING_ID = re.compile(r"[0-9a-f]{12}")


def _make_staging(directory: str) -> tuple[str, int] | None:
    """A new empty sibling of ``directory`` to build in and the descriptor
    holding its ``flock`` (close it when done), or None where the tree
    cannot be published by a rename (see the module doc).  The siblings a
    crashed clone of the same target left (their lock free: the process is
    gone) are removed first.  A sibling is made under another name and
    locked before it takes its swept name, so a clone never removes one
    that is still being built."""
    if os.path.isdir(directory) and (os.path.ismount(directory) or _is_cwd(directory)):
        return None  # a rename would leave the caller in the empty directory it replaced ('clone URL .')
    parent, name = os.path.split(directory)
    prefix = f".{name[:100]}.stepfs-clone-"
    fresh = os.path.join(parent, f".{name[:100]}.stepfs-cloning-{uuid.uuid4().hex[:12]}")
    try:
        os.makedirs(parent, exist_ok=True)  # as a clone in place makes them
        os.mkdir(fresh, 0o700)
    except OSError as exc:
        if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            return None
        raise
    try:
        held = os.open(fresh, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except BaseException:
        os.rmdir(fresh)
        raise
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        _sweep(parent, prefix)
        staging = os.path.join(parent, prefix + uuid.uuid4().hex[:12])
        os.rename(fresh, staging)
    except BaseException:
        os.close(held)
        shutil.rmtree(fresh, ignore_errors=True)
        raise
    return staging, held


def _is_cwd(directory: str) -> bool:
    try:
        return os.path.samefile(directory, os.getcwd())
    except OSError:
        return False


def _sweep(parent: str, prefix: str) -> None:
    """Remove the siblings of ``prefix`` no live clone holds."""
    for entry in os.scandir(parent):
        if not (entry.name.startswith(prefix) and _SIBLING_ID.fullmatch(entry.name[len(prefix):])
                and entry.is_dir(follow_symlinks=False)):
            continue
        try:
            fd = os.open(entry.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue  # gone meanwhile (another clone swept it), or not ours to open
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue  # a clone in progress
        try:
            shutil.rmtree(entry.path, ignore_errors=True)
        finally:
            os.close(fd)


def _build(url: HistoryURL, remote: Remote, staging: str, number: int, meta: dict, message: str) -> int:
    """The workspace in ``staging``: the tree, the store's objects and its
    committed layer, the attachment.  Returns the local layer's number."""
    from stepfs.store.workspace import Workspace

    with Workspace.open(staging, create=True) as ws:
        with ws.db.read() as conn:
            base = local_layers.head(conn)
        entries: list[Entry] = []
        tree = NewTree(staging)
        try:
            for batch in _ahead(stateread.batches(remote, number)):
                writing = tree.write(batch)  # on the tree's threads, while the store takes the same bytes
                files = [s for s in batch if s.kind == "file"]
                with ws.db.write() as conn:  # durable with the tree: syncfs, before the rename
                    oids = ws.objects.put_many(conn, [s.data for s in files])
                oid_of = {id(s): oid for s, oid in zip(files, oids)}
                entries += [Entry(s.path, State(None), State(s.kind, s.mode, oid_of.get(id(s)), s.target, None, None,
                                                             s.xattrs), s.mtime_ns) for s in batch]
                tree.wait(writing)
            tree.finish()
        finally:
            tree.close()
        _refuse_pruned(remote, number)
        with ws.db.write(durable=True) as conn:
            local = local_layers.next_number(conn)
            _INSERT_LAYER.executemany(conn, [dict(
                number=local, state="committed", kind=SYNC, created_ns=time.time_ns(), message=message, agent="",
                mount="", meta=json.dumps(meta, sort_keys=True), intent_sum=intent_checksum(entries, None),
                step=None)])
            entrytable.insert(conn, local, entries)
        attachment.write(ws, Attachment(url, uuid.uuid4().hex, base, number))
    return local


def _ahead(batches: Generator[list, None, None], depth: int = 2) -> Iterator[list]:
    """``batches`` read on a thread of its own, up to ``depth`` ahead: the
    server's answer and its checking overlap the writing of the files (the
    reader waits on its socket, which releases the GIL).  The caller's
    failure stops the reader at its next batch."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    done = object()

    def read() -> None:
        try:
            for batch in batches:
                while not stop.is_set():
                    try:
                        q.put((batch, None), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            q.put((done, None))
        except BaseException as exc:  # handed to the caller, raised there
            q.put((None, exc))
        finally:
            batches.close()  # its transaction ends here, on this thread, even when stopped early

    reader = threading.Thread(target=read, name="stepfs-clone-read", daemon=True)
    reader.start()
    try:
        while True:
            batch, exc = q.get()
            if exc is not None:
                raise exc
            if batch is done:
                return
            yield batch
    finally:
        stop.set()
        while reader.is_alive():  # unblock a reader waiting to put
            try:
                q.get(timeout=0.1)
            except queue.Empty:
                pass
        reader.join()


def _publish_tree(staging: str, directory: str) -> None:
    """Give the tree's root the target's mode (and owner), make all of it
    durable, then rename it onto the target: the clone's one commit point."""
    try:
        st = os.lstat(directory)
    except FileNotFoundError:
        st = None
    if st is not None:
        os.chmod(staging, stat_mod.S_IMODE(st.st_mode))
        if os.geteuid() == 0 and (st.st_uid, st.st_gid) != (os.getuid(), os.getgid()):
            os.chown(staging, st.st_uid, st.st_gid)
    else:
        os.chmod(staging, 0o777 & ~newtree.current_umask())
    parent, name = os.path.split(directory)
    pfd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        rfd = os.open(staging, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            durable.syncfs(rfd)  # every file, directory and the store's database, once
        finally:
            os.close(rfd)
        try:
            # Absent: made by this rename and never over a name made meanwhile;
            # an empty directory: replaced (rename refuses a non-empty one).
            durable.rename(os.fsencode(os.path.basename(staging)), os.fsencode(name), src_dir_fd=pfd,
                           dst_dir_fd=pfd, noreplace=st is None)
        except OSError as exc:
            if exc.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
                raise WorkspaceError(f"{directory} is not an empty directory any more (another clone or program "
                                     f"wrote there meanwhile); nothing was written there: clone into a new "
                                     f"directory.") from None
            raise
        durable.fsync(pfd)
    finally:
        os.close(pfd)


def _clone_in_place(url: HistoryURL, remote: Remote, directory: str, number: int, meta: dict,
                    message: str) -> tuple[str, int, int]:
    """The clone written into ``directory`` itself by the rollback
    machinery (where no sibling can be renamed onto it)."""
    from stepfs.store.workspace import Workspace

    with remote.objects_held():  # the states, then their objects: no gc-history in between
        states = remote.state_at(number)
        _refuse_pruned(remote, number)
        os.makedirs(directory, exist_ok=True)
        with Workspace.open(directory, create=True) as ws:
            with ws.db.read() as conn:
                base = local_layers.head(conn)
            with ws.commit_lock():
                down = Downloader(ws, remote)
                down.fetch([{"after_object": row["after_object"]} for row in states.values()])
                entries = [Entry(p, State(None), down.state(row, "after"), row["after_mtime_ns"])
                           for p, row in sorted(states.items()) if row["after_kind"] is not None]
                local = publish.write_layer(ws, entries, kind=SYNC, message=message, agent="", mount="",
                                            meta=meta, consume_step=None)
            attachment.write(ws, Attachment(url, uuid.uuid4().hex, base, number))
            return ws.path, number, local
