"""What every workload needs: the config, the temp root, the shared input
data (built lazily, once per run) and small helpers to time commands."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import fixtures
from .config import Config

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent


def log(msg: str) -> None:
    print(f"bench: {msg}", file=sys.stderr, flush=True)


def sh(cmd: str, cwd: Path | str, env: dict | None = None, timeout: float = 1800) -> None:
    """Run ``cmd`` with bash; raise with its stderr if it fails."""
    result = subprocess.run(["bash", "-c", cmd], cwd=cwd, capture_output=True, timeout=timeout,
                            env=env if env is not None else os.environ)
    if result.returncode != 0:
        raise RuntimeError(f"{cmd!r} in {cwd} exited {result.returncode}: "
                           f"{result.stderr.decode(errors='replace').strip()[-500:]}")


def timed(cmd: str, cwd: Path | str, env: dict | None = None) -> float:
    """Wall time of one shell command (fork/exec included, a few ms)."""
    t0 = time.perf_counter()
    sh(cmd, cwd, env)
    return time.perf_counter() - t0


def drop_caches() -> None:
    """Write back dirty pages, then drop the page cache, dentries and inodes
    (machine-wide: other processes' reads get slower for a moment)."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


@dataclass
class Context:
    cfg: Config
    tmp: Path
    _data: dict = field(default_factory=dict)

    @property
    def data_dir(self) -> Path:
        d = self.tmp / "data"
        d.mkdir(exist_ok=True)
        return d

    def new_dir(self, *parts: str) -> Path:
        d = self.tmp.joinpath(*parts)
        d.mkdir(parents=True, exist_ok=False)
        return d

    def once(self, key: str, make) -> Path:
        if key not in self._data:
            t0 = time.perf_counter()
            self._data[key] = make()
            os.sync()  # its writeback must not land inside a timed section
            log(f"prepared {key} in {time.perf_counter() - t0:.1f} s")
        return self._data[key]

    # -- shared inputs ------------------------------------------------------------

    def big_file(self) -> Path:
        return self.once("big file", lambda: fixtures.big_file(self.data_dir / "big.bin", self.cfg.big_mib))

    def tree(self) -> Path:
        return self.once("source tree", lambda: fixtures.source_tree(self.data_dir / "src", self.cfg.small_files))

    def tar(self) -> Path:
        return self.once("tarball", lambda: fixtures.tarball(self.tree(), self.data_dir / "src.tar"))

    def workspace(self, files: int) -> Path:
        """A workspace of ``files`` tiny files shared by the stepfs-only
        groups (mount time, then commit latency); removed with the temp root."""
        return self.once(f"{files}-file workspace",
                          lambda: fixtures.workspace(self.data_dir / f"ws{files}", files))

    def repo(self) -> Path:
        return self.once("git repository", lambda: fixtures.git_repo(self.tree(), self.data_dir / "repo"))
