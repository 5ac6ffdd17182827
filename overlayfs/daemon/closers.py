"""Which FLUSH is the writer's close (FUSE-free; the adapter asks, the view decides).

The kernel sends FLUSH for every ``close`` of any copy of a descriptor:
``dup`` copies, the copies a ``fork`` child inherits and closes before its
``exec`` (close-on-exec, or Python's ``subprocess`` closing every descriptor
above 2), a shell saving and restoring a redirected descriptor, a child's
exit.  Publishing at each of them would publish a half-written file the
moment its writer starts a process (issue 18 item 0).  Only the close that
ends the writer's use of the handle publishes; every other FLUSH publishes
nothing, and what was written waits for that close or, failing that, for
RELEASE (the view's ``release`` decides a handle that still wrote, and
records a lost race as a conflict copy, as before).

What the requests carry (kernel ``fs/fuse/file.c``; libfuse passes them on):

* every request's header carries the calling *thread*'s id in the daemon's
  pid namespace (``fuse_get_context``), 0 for a caller outside it and for
  writes of dirty mmap pages (sent from writeback, without credentials);
* FLUSH carries ``lock_owner``, the (scrambled) address of the closer's
  descriptor table (``current->files``), shared by threads;
* WRITE carries a lock owner only for direct I/O (``FUSE_WRITE_LOCKOWNER``);
  buffered writes do not, so a writer's descriptor table cannot be learned
  from its writes.  Its process can: the thread id of each write, mapped to
  its thread group (``Tgid`` in ``/proc/<tid>/status``), which is the
  process that owns the descriptor table (threads share both).

The rule (:meth:`Writers.is_writers_close`): a FLUSH is the writer's close
when the closing process wrote through the handle (its ``O_TRUNC`` or
create counts as a write) and no longer holds a writable descriptor of the
same file (a ``dup``, or the shell's saved copy: the closed descriptor is
already gone from ``/proc/<pid>/fd`` when FLUSH is sent; an exiting
process shows none).  So a child that never wrote is never the writer
(fork, ``posix_spawn``/``subprocess``, a shell's subshell); a child that
wrote publishes what it wrote when it is done with it; threads of the
writer are the writer.  Where the writer cannot be told -- a write or close
with pid 0, a process whose ``/proc`` cannot be read -- every FLUSH decides,
as before this rule.

Known limits: a process sharing its descriptor table with the writer
without being one of its threads (``clone(CLONE_FILES)``) counts as
another process, so its closes defer to RELEASE; a writer whose main
thread has exited (its other threads still running) shows no descriptors,
so its FLUSHes publish.

Cost: a dict lookup per write (a new thread of a handle: one ``pidfd_open``,
or one ``/proc/<tid>/status`` for a thread that is not its group's
leader); per close of a writer, a ``readlink`` of each of its
descriptors in ``/proc/<pid>/fd`` (``fdinfo`` of those in the mount), so
it grows with the writer's open descriptors; the directory is listed only
when the descriptors differ from those of the writer's previous close
(:func:`links_of`), and while they do not, the ``fstat`` giving their count
and those ``readlink`` calls are all of it (:meth:`FdDirs.inside`).
FLUSHes of processes that never wrote cost one ``pidfd_open``.

Why no writer's close can skip the look (issue 19): nothing the kernel
sends tells how many descriptors share the closed file (FLUSH's
``lock_owner`` names the descriptor table only), ``dup``/``dup2``/``fcntl``
and descriptors received over a socket send no request, and a ``dup2``
onto a number that held a file outside the mount (a shell's ``exec 1>&3``)
leaves the process's descriptor count unchanged; so every descriptor's
link is read again at each writer's close.

Threading: FUSE loop thread only (the adapter's callbacks, and the look
a FLUSH answered first leaves for after its reply: :meth:`Writers.done`;
which process closes is told before the reply, :meth:`Writers.closer`).
"""

from __future__ import annotations

import os

#: Bound of the writer table (fh -> writers); cleared when full, which only
#: makes the next FLUSHes of the handles then open decide, as before the rule.
WRITERS_LIMIT = 100_000
#: Bound of the writers' /proc/<pid>/fd directories held open (FdDirs);
#: all are closed when full, which only costs their next look a listing.
FD_DIRS_LIMIT = 32


def tgid_of(tid: int) -> int | None:
    """The process (thread group) of thread ``tid``, or None (gone, pid 0)."""
    if tid <= 0:
        return None
    try:
        os.close(os.pidfd_open(tid))  # refused for a thread that is not its group's leader
        return tid
    except (OSError, AttributeError):
        pass
    try:
        with open(f"/proc/{tid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Tgid:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def links_of(fd_dir: int, guess=(), count: int = 0) -> dict[str, str]:
    """Every descriptor of a process (``fd_dir``: its ``/proc/<pid>/fd``,
    open) -> the target of its link.  ``guess``: the descriptor names it
    had at the last look; ``count``: how many it holds (the directory's
    size, Linux 6.2+).  Listing the directory makes the kernel build an
    entry per descriptor, costlier than the ``readlink`` of each; so the
    guessed names are read first, and when ``count`` of them are open they
    are all of them and no listing is made.  Otherwise the listing
    decides, reusing what was read."""
    links: dict[str, str] = {}
    if guess and count:
        for name in guess:
            try:
                links[name] = os.readlink(name, dir_fd=fd_dir)
            except OSError:
                pass  # closed since
        if len(links) == count:
            return links
    out: dict[str, str] = {}
    for name in os.listdir(fd_dir):
        target = links.get(name)
        if target is None:
            try:
                target = os.readlink(name, dir_fd=fd_dir)
            except OSError:
                continue  # closed meanwhile
        out[name] = target
    return out


class FdDirs:
    """The ``/proc/<pid>/fd`` directories of the writers seen last, held
    open with their descriptor names at the last look: opening one cost
    as much as reading a few links.  A held directory is used only while
    its size (the process's descriptor count) is not 0: a process that
    lives keeps its pid, so the number still names it; a process gone
    (or a kernel without the count) has the pid looked up again."""

    def __init__(self) -> None:
        self._held: dict[int, tuple[int, tuple[str, ...]]] = {}

    def inside(self, pid: int, inside: str) -> list[tuple[str, str]]:
        """``(descriptor, target)`` of each descriptor of process ``pid``
        whose link starts with ``inside`` (OSError: cannot be read).  Every
        close of a writer comes here: while the process holds as many
        descriptors as at its last look and each of those names is still
        open, those are all of them, and a ``readlink`` of each is the
        whole look, with nothing built or stored."""
        held = self._held.get(pid)
        if held is not None:
            fd_dir, guess = held
            try:
                count = os.fstat(fd_dir).st_size
            except OSError:
                count = 0
            if count and count == len(guess):
                found = []
                readlink = os.readlink
                try:
                    for name in guess:
                        target = readlink(name, dir_fd=fd_dir)
                        if target.startswith(inside):
                            found.append((name, target))
                    return found
                except OSError:
                    pass  # closed since: the full look below
        return [(name, target) for name, target in self.links(pid).items() if target.startswith(inside)]

    def links(self, pid: int) -> dict[str, str]:
        """:func:`links_of` for process ``pid`` (OSError: cannot be read)."""
        held = self._held.pop(pid, None)
        count = 0
        if held is not None:
            fd_dir, guess = held
            try:
                count = os.fstat(fd_dir).st_size
            except OSError:
                pass
            if not count:
                os.close(fd_dir)
                held = None
        if held is None:
            # Links read relative to the open directory: each readlink then
            # walks one name instead of /proc/<pid>/fd/<n> from the root.
            fd_dir = os.open(f"/proc/{pid}/fd", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            guess = ()
        try:
            links = links_of(fd_dir, guess, count)
        except OSError:
            os.close(fd_dir)
            raise
        if len(self._held) >= FD_DIRS_LIMIT:
            self.close()
        self._held[pid] = (fd_dir, tuple(links))
        return links

    def close(self) -> None:
        for fd_dir, _names in self._held.values():
            os.close(fd_dir)
        self._held.clear()


def holds(pid: int, prefix: str, ino, path: str, fd_dirs: FdDirs | None = None) -> bool | None:
    """Whether process ``pid`` has a writable descriptor open on the file of
    this mount (mountpoint ``prefix``) with inode ``ino`` (or, when the
    inode is unknown, named ``prefix + path``); None when its descriptors
    cannot be read.  ``ino`` may be a callable giving it: it is then asked
    only if a writable descriptor inside the mount is found (a getattr of
    the handle cost as much as the rest of the look, and the writer's close
    usually leaves none).  Reads ``/proc/<pid>/fd`` links and ``fdinfo`` only:
    neither sends a request to this mount (a ``stat`` through the link
    would, and this runs on the FUSE loop).  ``fd_dirs``: the directories
    held from earlier looks (:class:`FdDirs`)."""
    inside = prefix.rstrip("/") + "/"
    try:
        if fd_dirs is None:
            fd_dirs = FdDirs()
            try:
                found = fd_dirs.inside(pid, inside)
            finally:
                fd_dirs.close()
        else:
            found = fd_dirs.inside(pid, inside)
    except OSError:
        return None
    want = prefix + path
    for name, target in found:
        try:
            with open(f"/proc/{pid}/fdinfo/{name}", "rb") as f:
                info = f.read()
        except OSError:
            continue
        fields = dict(line.split(b":", 1) for line in info.splitlines() if b":" in line)
        try:
            flags = int(fields[b"flags"].strip(), 8)
        except (KeyError, ValueError):
            flags = os.O_RDWR
        if flags & os.O_ACCMODE == os.O_RDONLY:
            continue
        if callable(ino):
            ino = ino()
        if ino is not None and b"ino" in fields:
            try:
                if int(fields[b"ino"].strip()) == ino:
                    return True
            except ValueError:
                continue
        elif target.removesuffix(" (deleted)") == want:
            return True
    return False


class Writers:
    """Per open handle (``fh``): the threads that wrote through it, each with
    its process (``None``: unknown, see the module doc)."""

    def __init__(self, mountpoint: str):
        self.prefix = os.path.realpath(mountpoint)  # as /proc/<pid>/fd shows it (before the mount exists)
        self._by_fh: dict[int, dict[int, int | None]] = {}
        self._fd_dirs = FdDirs()

    def wrote(self, fh: int, tid: int) -> None:
        """Thread ``tid`` changed the file through ``fh`` (write, truncate,
        fallocate, an open with ``O_TRUNC``, a create).  The thread's
        process is looked up once per handle and thread: the thread may be
        gone by the time the handle is closed."""
        w = self._by_fh.get(fh)
        if w is None:
            if len(self._by_fh) >= WRITERS_LIMIT:
                self._by_fh.clear()
            w = self._by_fh[fh] = {}
        if tid not in w:
            w[tid] = tgid_of(tid)

    def forget(self, fh: int) -> None:
        """The handle is released."""
        self._by_fh.pop(fh, None)

    def is_writers_close(self, fh: int, tid: int, ino, path: str) -> bool:
        """Whether thread ``tid``'s FLUSH of ``fh`` ends the writer's use of
        it (the module doc's rule).  ``ino()``: the file's inode number as
        the mount shows it, or None (called only when needed)."""
        who = self.closer(fh, tid)
        if isinstance(who, bool):
            return who
        return self.done(who, ino, path)

    def closer(self, fh: int, tid: int) -> bool | int:
        """The first half of :meth:`is_writers_close`, from what is known
        at the FLUSH: True or False when that decides (True: nothing
        written through it, or a writer that cannot be told apart; False:
        a process that never wrote through it), else the writing process
        whose descriptors decide (:meth:`done`).  Asked before a FLUSH's
        reply: once answered, the closer may exit, and a process gone can
        no longer be told from a writer."""
        w = self._by_fh.get(fh)
        if not w or None in w.values():
            return True  # nothing written through it, or a writer we cannot tell apart
        pid = w.get(tid) or tgid_of(tid)
        if pid is None:
            return True
        if pid not in w.values():
            return False  # a process that never wrote through this handle
        return pid

    def done(self, pid: int, ino, path: str) -> bool:
        """The second half: whether writing process ``pid`` holds no other
        writable descriptor of the file (may run after the reply: a
        process that exited meanwhile holds none)."""
        held = holds(pid, self.prefix, ino, path, self._fd_dirs)
        return not held  # None (cannot look): decide, as before the rule
