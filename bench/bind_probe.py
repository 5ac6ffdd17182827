"""The bind-mount hybrid for an unversioned tree, measured on the bare
passthrough (issue 19 part 1, idea a; README "Unversioned paths").

``python -m bench.bind_probe [--files N] [--reps R]`` (root) compares, for
N npm-like files created in ``node_modules`` and then ``rm -rf``:

* ``native``      a plain directory;
* ``fuse``        ``bench/passthrough.py`` with entry timeout 0, no bind
                  (every walk and every operation reaches the daemon);
* ``bind-cached`` the same with the workspace's ``node_modules`` bind-mounted
                  over the mount's and a 60 s entry timeout: the kernel
                  serves the tree, the daemon is never asked, and the final
                  ``rmdir`` of ``rm -rf`` fails with EBUSY;
* ``bind-mv``     as ``bind-probe``, then ``mv node_modules moved`` (the
                  same LOOKUP, from a rename; its row's ``rm -rf`` removes
                  ``moved`` through the daemon, so only its exit status
                  counts);
* ``bind-probe``  the hybrid: entry timeout 0, so every path walk that
                  passes the mountpoint sends the daemon a LOOKUP of it;
                  the daemon reads the caller's ``/proc/TID/syscall`` and,
                  when the caller is in ``rmdir``, ``unlinkat(AT_REMOVEDIR)``
                  or a ``rename``, detaches the bind mount
                  (``umount2(MNT_DETACH)`` of ``/proc/self/fd/N``, an
                  ``O_PATH`` descriptor of the mount's root: no walk back
                  into the daemon) before it answers.  The kernel's
                  ``is_local_mountpoint`` check then passes and the RMDIR or
                  RENAME reaches the daemon.

The bind mount is made by a thread of the daemon (``open_tree`` +
``move_mount``), never by a request handler.  The run prints the native
cost per create and unlink, the load average, each row's ratio to native,
``rm -rf``'s exit status, and the LOOKUPs of the mountpoint the probe saw.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.passthrough import Passthrough, mfusepy  # noqa: E402
from bench.unversioned import _timed  # noqa: E402  (the same timing as the unversioned rows)

NPM = Path(__file__).with_name("npm_like.py")
_libc = ctypes.CDLL(None, use_errno=True)
_SYS = {"x86_64": {"open_tree": 428, "move_mount": 429}, "aarch64": {"open_tree": 428, "move_mount": 429}}
#: syscall numbers of the calls that need the mountpoint itself: (rmdir,
#: rename, renameat, renameat2) and unlinkat, which does when AT_REMOVEDIR.
_DESTRUCTIVE = {"x86_64": ({84, 82, 264, 316}, 263), "aarch64": ({38, 276}, 35)}
OPEN_TREE_CLONE, AT_EMPTY_PATH, AT_REMOVEDIR = 1, 0x1000, 0x200
MOVE_MOUNT_F_EMPTY_PATH, MOVE_MOUNT_T_EMPTY_PATH = 0x4, 0x40
MNT_DETACH = 2


def _check(rc: int, what: str) -> int:
    if rc < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return rc


def bind_over(source_fd: int, target_fd: int) -> int:
    """Attach a clone of the tree at ``source_fd`` over ``target_fd``;
    returns an O_PATH descriptor of the new mount's root."""
    nr = _SYS[platform.machine()]
    tree = _check(_libc.syscall(nr["open_tree"], source_fd, b"", OPEN_TREE_CLONE | AT_EMPTY_PATH | os.O_CLOEXEC),
                  "open_tree")
    _check(_libc.syscall(nr["move_mount"], tree, b"", target_fd, b"",
                         MOVE_MOUNT_F_EMPTY_PATH | MOVE_MOUNT_T_EMPTY_PATH), "move_mount")
    return tree


def detach(tree: int) -> None:
    _check(_libc.umount2(f"/proc/self/fd/{tree}".encode(), MNT_DETACH), "umount2")
    os.close(tree)


def destructive(tid: int) -> bool:
    """Whether task ``tid`` is blocked in a call that needs the mountpoint
    itself (True when that cannot be read: the safe side)."""
    nums, unlinkat = _DESTRUCTIVE.get(platform.machine(), (set(), -1))
    try:
        with open(f"/proc/{tid}/syscall", "rb") as f:
            fields = f.read().split()
        nr = int(fields[0])
    except (OSError, ValueError, IndexError):
        return True
    return nr in nums or (nr == unlinkat and int(fields[3], 16) & AT_REMOVEDIR != 0)


class BindProbe(Passthrough):
    def __init__(self, source: str, mountpoint: str, name: str):
        super().__init__(source)
        self.name = "/" + name
        self.mountpoint = os.path.realpath(mountpoint)
        self.tree = -1
        self.lookups = 0
        self.detached = 0

    def init(self, path):
        threading.Thread(target=self._bind, daemon=True).start()

    def _bind(self) -> None:
        src = os.open(self._full(self.name), os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            dst = os.open(self.mountpoint + self.name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW)
            try:
                self.tree = bind_over(src, dst)
            finally:
                os.close(dst)
        finally:
            os.close(src)

    def getattr(self, path, fh=None):
        if fh is None and path == self.name and self.tree >= 0:
            self.lookups += 1
            if destructive(mfusepy.fuse_get_context()[2]):
                detach(self.tree)
                self.tree = -1
                self.detached += 1
        return super().getattr(path, fh)

    def destroy(self, path):
        sys.stderr.write(f"probe: {self.lookups} lookups of {self.name}, {self.detached} detached\n")
        if self.tree >= 0:
            try:
                detach(self.tree)
            except OSError:
                pass  # the driver detached it already (after an EBUSY)


def serve(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="bench.bind_probe serve")
    ap.add_argument("source")
    ap.add_argument("mountpoint")
    ap.add_argument("--bind", default="")
    ap.add_argument("--entry-timeout", type=float, default=0.0)
    args = ap.parse_args(argv)
    ops = BindProbe(args.source, args.mountpoint, args.bind) if args.bind else Passthrough(args.source)
    mfusepy.FUSE(ops, args.mountpoint, foreground=True, nothreads=True, fsname="bind-probe", subtype="probe",
                 default_permissions=True, use_ino=True, hard_remove=True, attr_timeout=60.0,
                 entry_timeout=args.entry_timeout, negative_timeout=0.0)
    return 0


def _mounted(path: str) -> bool:
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == path for line in f)


def _wait(cond, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.02)


def _case(kind: str, tmp: Path, files: int) -> dict:
    ws, mnt = tmp / "ws", tmp / "mnt"
    ws.mkdir()
    mnt.mkdir()
    (ws / "node_modules").mkdir()
    create = [sys.executable, str(NPM), "node_modules", "--files", str(files)]
    out: dict = {}
    if kind == "native":
        out["create"], _, _ = _timed(create, ws)
        out["rm"], out["rm_rc"], out["rm_err"] = _timed(["rm", "-rf", "node_modules"], ws)
        return out
    cmd = [sys.executable, "-m", "bench.bind_probe", "serve", str(ws), str(mnt),
           "--entry-timeout", "60" if kind == "bind-cached" else "0"]
    if kind != "fuse":
        cmd += ["--bind", "node_modules"]
    daemon = subprocess.Popen(cmd, cwd=Path(__file__).resolve().parents[1], stderr=subprocess.PIPE, text=True)
    try:
        _wait(lambda: _mounted(str(mnt)), "the mount")
        if kind != "fuse":
            _wait(lambda: _mounted(str(mnt / "node_modules")), "the bind mount")
        out["create"], rc, err = _timed(create, mnt)
        if rc:
            raise RuntimeError(f"{kind}: create failed: {err}")
        if kind == "bind-mv":
            # mv of the bound directory: the same LOOKUP, from a rename.
            _, out["mv_rc"], out["mv_err"] = _timed(["mv", "node_modules", "moved"], mnt)
        out["rm"], out["rm_rc"], out["rm_err"] = _timed(
            ["rm", "-rf", "moved" if out.get("mv_rc") == 0 else "node_modules"], mnt)
    finally:
        if _mounted(str(mnt / "node_modules")):
            subprocess.run(["umount", "-l", str(mnt / "node_modules")], check=False)
        subprocess.run(["fusermount3", "-u", str(mnt)], check=False)
        try:
            _, errtext = daemon.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            daemon.kill()
            _, errtext = daemon.communicate()
        out["probe"] = " ".join(line for line in errtext.splitlines() if line.startswith("probe:"))
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        return serve(argv[1:])
    ap = argparse.ArgumentParser(prog="bench.bind_probe")
    ap.add_argument("--files", type=int, default=20_000)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--only", default="native,fuse,bind-cached,bind-probe,bind-mv")
    args = ap.parse_args(argv)
    kinds = args.only.split(",")
    base = Path(tempfile.mkdtemp(prefix="stepfs-bench-bind-"))
    try:
        print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; files {args.files}", flush=True)
        results: dict[str, list[dict]] = {k: [] for k in kinds}
        for rep in range(args.reps):
            for kind in kinds:
                tmp = base / f"{kind}-{rep}"
                tmp.mkdir()
                try:
                    results[kind].append(_case(kind, tmp, args.files))
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
        ref_c = min(r["create"] for r in results["native"]) if "native" in results else None
        ref_r = min(r["rm"] for r in results["native"]) if "native" in results else None
        print(f"{'kind':12} {'create s':>9} {'x native':>9} {'rm -rf s':>9} {'x native':>9}  rm exit / probe")
        for kind in kinds:
            c = min(r["create"] for r in results[kind])
            r = min(r["rm"] for r in results[kind])
            last = results[kind][-1]
            rc = f"{last['rm_rc']}" + (f" ({last['rm_err']})" if last["rm_rc"] else "")
            if "mv_rc" in last:
                rc += f"; mv exit {last['mv_rc']}" + (f" ({last['mv_err']})" if last["mv_rc"] else "")
            print(f"{kind:12} {c:9.3f} {c / ref_c if ref_c else 0:9.2f} {r:9.3f} {r / ref_r if ref_r else 0:9.2f}"
                  f"  {rc} {last.get('probe', '')}")
        print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
