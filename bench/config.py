"""Sizes and repetition counts of one benchmark run (full, ``--quick``, ``--smoke``).

Sizes that a target of the issue names (2,000 files, 20,000 files, 10k/100k
workspaces, 50k checkpoint workspace, 10 MB edit, 100 steps) stay the same in
``--quick``; only the big file and the repetition counts shrink.  ``--smoke``
is a tiny configuration for the test that keeps the suite from rotting: its
numbers mean nothing.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class Config:
    mode: str = "full"
    big_mib: int = 512             # sequential read / write file size
    reps: int = 5                  # repetitions of each comparative workload per target
    small_files: int = 2_000       # untar / stat / ls / git status / rm -rf tree
    npm_files: int = 20_000        # npm-like creation
    commit_ws: tuple[int, ...] = (10_000, 100_000)
    commit_changed: tuple[int, ...] = (1, 10, 100)
    commit_reps: int = 20          # per (workspace size, changed files): p95 needs some
    mount_ws: tuple[int, ...] = (1_000, 100_000)
    mount_reps: int = 5
    cli_reps: int = 10
    guard_samples: int = 300       # close-write latencies per target
    checkpoint_files: int = 50_000
    checkpoint_changed: int = 10
    checkpoint_reps: int = 10
    growth_big_mib: int = 10
    growth_steps: int = 100
    tools_git_files: int = 200     # tools: .py files of the repository git clones
    tools_py_files: int = 300      # tools: stdlib .py files compileall compiles (and sed -i edits)
    tools_tree_files: int = 1_000  # tools: files of the stdlib copy rsync / diff / tar move (3.11: all 999, 32 MB)
    tools_sqlite_rows: int = 5_000  # tools: rows inserted by the sqlite3 CLI, 250 per transaction
    tools_c_units: int = 8         # tools: C source files make builds
    targets: tuple[str, ...] = ("native", "overlay", "fuse-overlayfs", "passthrough", "stepfs")
    only: tuple[str, ...] = ()     # workload groups to run (empty: all)
    profile: tuple[str, ...] = ()  # side-by-side workloads to profile (empty: no profile)
    extra: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)


def full() -> Config:
    return Config()


def quick() -> Config:
    # mount_reps: a mount is ~0.3 s and the 10% target compares two medians; 3 samples a size were too few.
    # commit_reps as the full run's: the nearest-rank p95 of 10 samples is their maximum, so one disk
    # stall from another process decided the commit target; 20 commits cost well under a second more.
    return Config(mode="quick", big_mib=64, reps=3, commit_reps=20, mount_reps=6, cli_reps=5, guard_samples=100,
                  checkpoint_reps=10)


def smoke() -> Config:
    """Two workload groups (untar, commit) against native and stepfs, tiny sizes."""
    return Config(mode="smoke", big_mib=1, reps=1, small_files=40, npm_files=100, commit_ws=(200,),
                  commit_changed=(1,), commit_reps=2, mount_ws=(100,), mount_reps=1, cli_reps=1, guard_samples=5,
                  checkpoint_files=200, checkpoint_reps=1, growth_big_mib=1, growth_steps=2,
                  tools_git_files=10, tools_py_files=20, tools_tree_files=30, tools_sqlite_rows=500, tools_c_units=2,
                  targets=("native", "stepfs"), only=("untar", "commit"))
