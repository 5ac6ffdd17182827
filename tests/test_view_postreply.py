"""A close answered before its publish (``Content.flush``'s ``later``),
without a kernel: what may wait for after the reply, and that nothing sees
the gap -- a commit from another thread waits for the deferred publish,
a stale close is still decided (and refused) before the reply.

``later`` stands for ``libfuse.lowlevel.AfterReply.later``: the test
plays the loop thread, running the handed work when the reply would have
been sent.
"""

from __future__ import annotations

import os
import threading

import pytest

from stepfs.overlayfs.core.errors import Stale
from stepfs.store import refs
from viewkit import open_view, read_all, read_fh, write_file


@pytest.fixture
def view(tmp_path):
    ws_dir = tmp_path / "ws"
    ws_dir.mkdir()
    (ws_dir / "w.txt").write_bytes(b"workspace\n")
    ws, v = open_view(tmp_path, row_delay=None)  # rows wait, as with the daemon's timer
    write_file(v, "/f", b"first\n")  # staged: later closes take the recorded path
    yield v
    ws.close()


def seen(view, path: str) -> bytes:
    """What another agent reads (the writer's own agent sees its draft)."""
    fh = view.open(path, os.O_RDONLY, agent="reader")
    try:
        return read_fh(view, fh)
    finally:
        view.release(fh)


def rewrite(view, path: str, data: bytes, agent=None) -> int:
    kw = {"agent": agent} if agent else {}
    fh = view.open(path, os.O_WRONLY | os.O_TRUNC, **kw)
    assert view.write(fh, data, 0) == len(data)
    return fh


def test_a_small_rewrite_of_a_staged_file_publishes_after_the_reply(view):
    fh = rewrite(view, "/f", b"second\n")
    work = []
    view.flush(fh, publish=lambda: True, later=work.append)
    assert len(work) == 1  # answered 0; the publish waits for the reply
    work.pop()()
    assert seen(view, "/f") == b"second\n"
    assert read_all(view, "/f") == b"second\n"
    view.release(fh)
    assert read_all(view, "/f") == b"second\n"


def test_a_commit_from_another_thread_waits_for_the_deferred_publish(view):
    """DESIGN: what a close returned is durable by the step's commit.  The
    lock taken at the close's check is held until the deferred publish ran;
    without it this commit would publish ``first``."""
    fh = rewrite(view, "/f", b"second\n")
    work = []
    view.flush(fh, publish=lambda: True, later=work.append)
    assert work
    done = []
    t = threading.Thread(target=lambda: done.append(view.commit("after the close")))
    t.start()
    t.join(0.5)
    assert t.is_alive() and not done, "the commit ran between the close's reply and its publish"
    work.pop()()
    t.join(30)
    assert done
    view.release(fh)
    with open(os.path.join(view.ws.path, "f"), "rb") as f:
        assert f.read() == b"second\n"  # the layer has the closed content


def test_a_stale_close_is_refused_before_the_reply(view):
    fh = rewrite(view, "/f", b"mine\n", agent="a")
    write_file_as(view, "/f", b"theirs\n", agent="b")
    work = []
    with pytest.raises(Stale):
        view.flush(fh, publish=lambda: True, later=work.append)
    assert not work
    view.release(fh)
    assert read_all(view, "/f") == b"theirs\n"


def write_file_as(view, path, data, agent):
    fh = view.open(path, os.O_WRONLY | os.O_TRUNC, agent=agent)
    try:
        view.write(fh, data, 0)
        view.flush(fh)
    finally:
        view.release(fh)


def test_a_non_writers_close_after_the_reply_publishes_nothing(view):
    fh = rewrite(view, "/f", b"second\n")
    work = []
    view.flush(fh, publish=lambda: False, later=work.append)  # a forked child's copy
    work.pop()()
    assert seen(view, "/f") == b"first\n"  # waits for the writer's close
    view.flush(fh, publish=lambda: True, later=work.append)
    work.pop()()
    assert seen(view, "/f") == b"second\n"
    view.release(fh)


def test_a_non_writers_close_waits_for_release_after_the_reply(view):
    fh = rewrite(view, "/f", b"second\n")
    work = []
    view.flush(fh, publish=lambda: False, later=work.append)
    work.pop()()
    assert seen(view, "/f") == b"first\n"
    view.release(fh)  # the handle still wrote: decided here
    assert read_all(view, "/f") == b"second\n"


def test_what_may_fail_is_decided_before_the_reply(view, tmp_path):
    work = []
    # First staging of a workspace file: a store transaction.
    fh = rewrite(view, "/w.txt", b"changed\n")
    view.flush(fh, publish=lambda: True, later=work.append)
    assert not work
    view.release(fh)
    assert read_all(view, "/w.txt") == b"changed\n"
    # A file staged by reference.
    big = b"x" * refs.MIN_SIZE
    fh = rewrite(view, "/f", big)
    view.flush(fh, publish=lambda: True, later=work.append)
    assert not work
    view.release(fh)
    assert read_all(view, "/f") == big


def test_a_created_files_first_close_is_answered_after_its_publish(view):
    """The middle of a burst (tar -x): the next request waits for the
    publish anyway, so nothing is left for after the reply."""
    fh = view.create("/new", 0o644, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    view.write(fh, b"new\n", 0)
    work = []
    view.flush(fh, publish=lambda: True, later=work.append)
    assert not work
    assert seen(view, "/new") == b"new\n"
    view.release(fh)


def test_rows_written_at_once_are_decided_before_the_reply(tmp_path):
    ws, v = open_view(tmp_path, row_delay=0.0)  # every record is written at once: may fail
    try:
        write_file(v, "/f", b"first\n")
        fh = rewrite(v, "/f", b"second\n")
        work = []
        v.flush(fh, publish=lambda: True, later=work.append)
        assert not work
        v.release(fh)
        assert read_all(v, "/f") == b"second\n"
    finally:
        ws.close()


def test_a_failed_deferred_publish_leaves_the_bytes_to_release(view, monkeypatch):
    fh = rewrite(view, "/f", b"second\n")
    work = []
    view.flush(fh, publish=lambda: True, later=work.append)
    job = work.pop()
    calls = []
    real = view.content.cas._record

    def failing(*args):
        calls.append(1)
        if len(calls) == 1:
            raise OSError(5, "injected")
        return real(*args)
    monkeypatch.setattr(view.content.cas, "_record", failing)
    with pytest.raises(OSError):
        job()
    assert view.lock.acquire(blocking=False)  # released despite the failure
    view.lock.release()
    view.release(fh)  # the handle still wrote: its release publishes
    assert read_all(view, "/f") == b"second\n"
