"""The runs a mount knows about, and whether each is confined (FUSE-free).

``stepfs run`` and ``stepfs confine`` tell a mount's daemon, through the
control channel (``{"op": "run"}``), the pid of each command they start in
it and how it is confined (``client/confine.py``: Landlock, what it may
write), or that it is not.  ``MOUNT/.stepfs/status`` and ``stepfs status``
show the runs whose process is still alive.

What this can and cannot say: a process is recognised by its pid and its
start time (read here from ``/proc`` when the run is registered, so a
reused pid is not taken for the run); the kernel offers no way to ask
whether another process is under Landlock, so the record is the word of
the stepfs process that applied it.  Writers stepfs did not start (a
shell in the mount, an editor) are not runs: the status says so.

Threading: its own lock; the control thread adds, any thread reads.
"""

from __future__ import annotations

import threading


def start_time(pid: int) -> int | None:
    """The start time of process ``pid`` in clock ticks since boot (field 22
    of ``/proc/PID/stat``), or None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rfind(b")") + 2:].split()
    return int(fields[19])


class Runs:
    """Registered runs: pid -> (start time, what was registered)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._runs: dict[int, tuple[int, dict]] = {}

    def add(self, pid: int, command: list[str], confinement: dict) -> bool:
        """Record a run; False if ``pid`` is not a live process."""
        start = start_time(pid)
        if start is None:
            return False
        info = {"pid": pid, "command": [str(c) for c in command], **confinement,
                "confined": bool(confinement.get("confined"))}
        with self._lock:
            self._runs[pid] = (start, info)
        return True

    def live(self) -> list[dict]:
        """The runs whose process still runs (the dead are forgotten)."""
        with self._lock:
            for pid, (start, _info) in list(self._runs.items()):
                if start_time(pid) != start:
                    del self._runs[pid]
            return [dict(info) for _start, info in sorted(self._runs.values(), key=lambda r: r[1]["pid"])]

    def status_lines(self) -> list[str]:
        runs = self.live()
        if not runs:
            return ["confined: unknown (no run of 'stepfs run' or 'stepfs confine' is live here; other "
                    "writers are not confined by stepfs)"]
        lines = [f"confined: {'yes' if all(r['confined'] for r in runs) else 'no'}"]
        for r in runs:
            what = " ".join(r["command"])[:120]
            if r["confined"]:
                net = r.get("tcp_connect", "any")
                lines.append(f"  run {r['pid']} ({what}): confined by Landlock ABI {r.get('abi')}; writes only "
                             f"beneath: {', '.join(r.get('writable', []))}; reads: "
                             f"{r.get('readable') if isinstance(r.get('readable'), str) else ', '.join(r['readable'])}; "
                             f"tcp connect: {net if isinstance(net, str) else ', '.join(map(str, net)) or 'none'}")
            else:
                lines.append(f"  run {r['pid']} ({what}): not confined (started without --confine)")
        return lines
