"""Real processes that are agents of a mount, driven one file operation at
a time over pipes (one JSON command a line, one JSON answer a line), so a
test interleaves several processes exactly, with no sleeps: the harness of
the real-mount token and close-write tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

#: The process's program: file operations on command; an ``OSError``
#: answers ``{"ok": False, "errno": ...}``.
WORKER = r"""
import json, os, subprocess, sys, threading
fds = {}
for line in sys.stdin:
    cmd = json.loads(line)
    op = cmd["op"]
    out = {"ok": True}
    try:
        if op == "open":
            fds[cmd["name"]] = os.open(cmd["path"], cmd["flags"], 0o644)
        elif op == "write":
            out["n"] = os.write(fds[cmd["name"]], cmd["data"].encode("latin-1"))
        elif op == "close":
            os.close(fds.pop(cmd["name"]))
        elif op == "dup":
            fds[cmd["new"]] = os.dup(fds[cmd["name"]])
        elif op == "fork_close":
            pid = os.fork()
            if pid == 0:
                try:
                    os.close(fds[cmd["name"]])
                    code = 0
                except OSError as exc:
                    code = exc.errno
                os._exit(code)
            out["rc"] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        elif op == "pread":
            out["data"] = os.pread(fds[cmd["name"]], cmd["size"], cmd["offset"]).decode("latin-1")
        elif op == "mmap":  # a shared mapping needs the page cache
            import mmap
            mmap.mmap(fds[cmd["name"]], 0, mmap.MAP_SHARED, mmap.PROT_READ).close()
        elif op == "read":
            with open(cmd["path"], "rb") as f:
                out["data"] = f.read().decode("latin-1")
        elif op == "pyclose":  # what Python's own file objects do
            with open(cmd["path"], "w") as f:
                f.write(cmd["data"])
                print(json.dumps({"ok": True, "opened": True}), flush=True)
                sys.stdin.readline()  # wait until told to close
        elif op == "subprocess":  # closes every inherited descriptor above 2 before its exec
            out["rc"] = subprocess.run(["true"]).returncode
        elif op == "fork_exit":  # no exec: the child's exit closes its copies
            pid = os.fork()
            if pid == 0:
                os._exit(0)
            out["rc"] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        elif op == "spawn":  # posix_spawn (vfork + exec); the copy inherited or closed at the exec
            fd = fds[cmd["name"]]
            os.set_inheritable(fd, cmd["inherit"])
            pid = os.posix_spawn("/bin/true", ["true"], dict(os.environ))
            out["rc"] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            os.set_inheritable(fd, False)
        elif op == "threads":  # several threads write; one starts a process meanwhile
            fd = fds[cmd["name"]]
            started = threading.Barrier(len(cmd["parts"]) + 1)
            def writer(i, part):
                started.wait()
                os.pwrite(fd, part.encode(), i * len(part))
            ts = [threading.Thread(target=writer, args=(i, p)) for i, p in enumerate(cmd["parts"])]
            ts.append(threading.Thread(target=lambda: (started.wait(), subprocess.run(["true"]))))
            for t in ts:
                t.start()
            for t in ts:
                t.join()
        elif op == "thread_close":  # another thread than the writers closes
            err = []
            def closer():
                try:
                    os.close(fds.pop(cmd["name"]))
                except OSError as exc:
                    err.append(exc.errno)
            t = threading.Thread(target=closer)
            t.start()
            t.join()
            if err:
                raise OSError(err[0], os.strerror(err[0]))
        else:
            raise ValueError(op)
    except OSError as exc:
        out = {"ok": False, "errno": exc.errno, "error": str(exc)}
    print(json.dumps(out), flush=True)
"""


class Agent:
    """A process in the mount that is one agent (``name=None``: the mount's
    default agent)."""

    def __init__(self, cwd: Path, name: str | None):
        env = {k: v for k, v in os.environ.items() if k != "STEPFS_AGENT"}
        if name is not None:
            env["STEPFS_AGENT"] = name
        self.name = name
        self.proc = subprocess.Popen([sys.executable, "-c", WORKER], cwd=cwd, env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def send(self, op: str, **kw) -> None:
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()

    def reply(self) -> dict:
        line = self.proc.stdout.readline()
        assert line, f"agent {self.name} died"
        return json.loads(line)

    def __call__(self, op: str, **kw) -> dict:
        self.send(op, **kw)
        return self.reply()

    def ok(self, op: str, **kw) -> dict:
        out = self(op, **kw)
        assert out["ok"], f"{self.name}: {op} {kw}: {out}"
        return out

    def read(self, path: str) -> str:
        return self.ok("read", path=path)["data"]

    def open_w(self, name: str, path: str, trunc: bool = True) -> dict:
        return self("open", name=name, path=path, flags=os.O_WRONLY | (os.O_TRUNC if trunc else 0) | os.O_CREAT)

    def write_file(self, path: str, data: str) -> dict:
        """open, write, close; the first failure is the answer."""
        out = self.open_w("w", path)
        if not out["ok"]:
            return out
        self.ok("write", name="w", data=data)
        return self("close", name="w")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


@pytest.fixture
def agents():
    """Factory ``agents(cwd, name)``; every process is stopped after the test."""
    made: list[Agent] = []

    def make(cwd: Path, name: str | None) -> Agent:
        made.append(Agent(cwd, name))
        return made[-1]

    try:
        yield make
    finally:
        for a in made:
            try:
                a.stop()
            except Exception:
                a.proc.kill()
                a.proc.wait()
