"""The request loop polls for the next request before it sleeps
(libfuse/spin.py): the poll window's policy kernel-free, then real mounts
served by the polling loop and by libfuse's own loop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import sh, stepfs
from stepfs.overlayfs.client import control, mounts
from stepfs.overlayfs.daemon.libfuse import spin

DEADLINE = 30.0

# 1,000 lookups of names that are not there: one LOOKUP each, one after the other.
PROBE = "import os\nfor i in range(1000):\n    os.path.lexists(f'absent{i}')\n"


def loop_counts(m) -> dict:
    return control.request(str(m.mountpoint), {"op": "ping"})["loop"]


def wait_for(cond, what: str):
    end = time.monotonic() + DEADLINE
    while True:
        got = cond()
        if got:
            return got
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.02)


def _main_thread(pid: int) -> list[str]:
    """Fields 3.. of ``/proc/PID/task/PID/stat``: the daemon's main thread, the FUSE loop."""
    with open(f"/proc/{pid}/task/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def thread_cpu_ticks(pid: int) -> int:
    fields = _main_thread(pid)
    return int(fields[11]) + int(fields[12])  # utime + stime


def thread_state(pid: int) -> str:
    return _main_thread(pid)[0]


# -- the window, kernel-free ------------------------------------------------------


def test_the_window_grows_through_a_burst_and_drops_after_a_long_sleep():
    w = spin.Window(200_000)
    assert w.ns == 0  # a new loop sleeps until a burst shows
    w.slept(60_000)  # a request soon after falling asleep: a burst
    assert w.ns == spin.GROW_START_NS
    seen = []
    for _ in range(10):
        w.slept(60_000)
        seen.append(w.ns)
    assert seen[:4] == [20_000, 40_000, 80_000, 160_000]
    assert max(seen) == 200_000 and seen[-1] == 200_000  # never past the limit
    w.slept(200_000)  # exactly the limit still counts as soon
    assert w.ns == 200_000
    w.slept(200_001)  # a longer sleep: no burst
    assert w.ns == 0


def test_the_limit_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(spin.SPIN_ENV, raising=False)
    assert spin.limit_ns() == spin.SPIN_US * 1000
    for raw, want in (("0", 0), ("50", 50_000), ("-5", 0), ("", spin.SPIN_US * 1000),
                      ("fast", spin.SPIN_US * 1000), ("1.5", spin.SPIN_US * 1000)):
        monkeypatch.setenv(spin.SPIN_ENV, raw)
        assert spin.limit_ns() == want, raw


# -- real mounts ---------------------------------------------------------------------


@pytest.mark.mount
@pytest.mark.timeout(120)
def test_a_burst_is_taken_by_polling_and_an_idle_mount_stops(workspace, mount, monkeypatch):
    # A limit no scheduler delay on a busy machine reaches, so the burst
    # is polled for however slow the prober is to come back.
    monkeypatch.setenv(spin.SPIN_ENV, "100000")
    m = mount(workspace)
    before = loop_counts(m)
    assert before["limit_us"] == 100_000
    subprocess.run([sys.executable, "-c", PROBE], cwd=m.mountpoint, check=True, timeout=60)
    after = loop_counts(m)
    polled = after["polled"] - before["polled"]
    slept = after["slept"] - before["slept"]
    assert polled + slept >= 1000
    assert polled > slept, after  # after its first few requests the burst never woke the loop

    # Idle: the loop polls out its window, then sleeps without polling.
    assert after["window_us"] > 0  # grown in the burst: as far as the burst needed
    wait_for(lambda: thread_state(m.pid) == "S", "the loop to sleep")
    ticks = thread_cpu_ticks(m.pid)
    time.sleep(0.5)  # a span with no request: what the loop thread burns in it
    assert thread_cpu_ticks(m.pid) - ticks <= 2  # clock ticks (10 ms each): asleep, not polling
    # The request that ends a long sleep takes the window back to zero.
    assert not m.path("absent-after-idle").exists()
    idle = loop_counts(m)
    assert idle["window_us"] == 0 and idle["slept"] > after["slept"], idle

    # And the next burst is polled again.
    subprocess.run([sys.executable, "-c", PROBE.replace("absent", "other")], cwd=m.mountpoint, check=True,
                   timeout=60)
    assert loop_counts(m)["polled"] > after["polled"]


@pytest.mark.mount
@pytest.mark.timeout(120)
def test_libfuse_own_loop_when_polling_is_off(workspace, mount, monkeypatch):
    monkeypatch.setenv(spin.SPIN_ENV, "0")
    (workspace / "kept.txt").write_text("kept\n")
    m = mount(workspace)
    sh("echo new > new.txt && mkdir d && mv new.txt d/ && cat kept.txt d/new.txt > both && rm kept.txt", m.mountpoint)
    assert m.path("both").read_text() == "kept\nnew\n"
    res = stepfs("step", m.mountpoint, "-m", "with libfuse's loop")
    assert res.returncode == 0, res.stderr
    assert (workspace / "d" / "new.txt").read_text() == "new\n" and not (workspace / "kept.txt").exists()
    counts = loop_counts(m)
    assert counts["limit_us"] == 0 and counts["polled"] == counts["slept"] == 0
    # LOOKUPs are told by libfuse's wrapped lookup entry here (the polling
    # loop tells them from the request header): an absent name is cached.
    wait_for(lambda: _absent_noted(m, "absent-name"), "a negative name recorded")


def _absent_noted(m, name: str) -> bool:
    assert not os.path.lexists(m.path(name))
    return control.request(str(m.mountpoint), {"op": "ping"})["negatives_noted"] >= 1


@pytest.mark.mount
@pytest.mark.timeout(120)
def test_sigterm_while_polling_ends_the_daemon(workspace, mount, monkeypatch):
    monkeypatch.setenv(spin.SPIN_ENV, "100000")
    m = mount(workspace)
    subprocess.run([sys.executable, "-c", PROBE], cwd=m.mountpoint, check=True, timeout=60)
    os.kill(m.pid, signal.SIGTERM)  # most likely inside the 100 ms poll right after the burst
    wait_for(lambda: not os.path.exists(f"/proc/{m.pid}") or _zombie(m.pid), "the daemon to exit")
    wait_for(lambda: mounts.find(str(m.mountpoint)) is None, "the mount to go")


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
