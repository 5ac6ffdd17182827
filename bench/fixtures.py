"""Input data of the benchmark, generated once per run under the temp root.

Everything is deterministic (seeded) so two runs measure the same bytes:

* :func:`big_file`      random bytes (incompressible, no dedupe shortcuts);
* :func:`source_tree`   N small text files in nested directories, like a
                        source checkout (sizes 0.2-8 KiB);
* :func:`tarball`       that tree as an uncompressed tar;
* :func:`git_repo`      that tree committed in a git repository;
* :func:`workspace`     N tiny files, 100 per directory (commit, mount and
                        checkpoint workspaces of 1k-100k files);
* :func:`text_file`     a text file of a given size in 100-byte lines.

Preparing a case copies from these templates with ``cp -al`` (hard links)
where the workload never writes a file in place, so preparing stays cheap.
"""

from __future__ import annotations

import os
import random
import subprocess
from pathlib import Path

MiB = 1 << 20

GIT_ENV = {
    "GIT_AUTHOR_NAME": "bench", "GIT_AUTHOR_EMAIL": "bench@example.invalid",
    "GIT_COMMITTER_NAME": "bench", "GIT_COMMITTER_EMAIL": "bench@example.invalid",
    "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null",
}

WORDS = ("alpha beta gamma delta return value const let function import export from class self "
         "def if else for while yield async await true false null none").split()


def git_env() -> dict[str, str]:
    return {**os.environ, **GIT_ENV}


def big_file(path: Path, mib: int, seed: int = 1) -> Path:
    if path.exists() and path.stat().st_size == mib * MiB:
        return path
    rng = random.Random(seed)
    with open(path, "wb") as f:
        for _ in range(mib):
            f.write(rng.randbytes(MiB))
    return path


def _text(rng: random.Random, size: int) -> bytes:
    out, n = [], 0
    while n < size:
        line = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) + "\n"
        out.append(line)
        n += len(line)
    return "".join(out).encode()[:size]


def source_tree(root: Path, files: int, seed: int = 2) -> Path:
    """``files`` text files, 20 per directory, directories two levels deep."""
    rng = random.Random(seed)
    for i in range(files):
        d = root / f"pkg{i // 400:02d}" / f"mod{(i // 20) % 20:02d}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"file{i:05d}.py").write_bytes(_text(rng, rng.randint(200, 8192)))
    return root


def tarball(tree: Path, out: Path) -> Path:
    """``tree`` as ``out`` (uncompressed); members are ``<tree name>/...``."""
    subprocess.run(["tar", "-cf", str(out), "-C", str(tree.parent), tree.name], check=True)
    return out


def git_repo(tree: Path, repo: Path) -> Path:
    subprocess.run(["cp", "-a", str(tree), str(repo)], check=True)
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-q", "-m", "base"]):
        subprocess.run(cmd, cwd=repo, env=git_env(), check=True, capture_output=True)
    return repo


def ws_path(i: int) -> str:
    """Relative path of file ``i`` of a :func:`workspace`."""
    return f"d{i // 100:04d}/f{i % 100:02d}.txt"


def workspace(root: Path, files: int) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for i in range(files):
        if i % 100 == 0:
            (root / f"d{i // 100:04d}").mkdir(exist_ok=True)
        (root / ws_path(i)).write_bytes(f"file {i}\n".encode() * 8)
    return root


def text_file(path: Path, size: int, seed: int = 3) -> Path:
    """``size`` bytes in lines of exactly 100 bytes (99 characters + newline)."""
    rng = random.Random(seed)
    lines = []
    for i in range(size // 100):
        body = f"{i:08d} " + " ".join(rng.choice(WORDS) for _ in range(20))
        lines.append((body[:99].ljust(99) + "\n").encode())
    path.write_bytes(b"".join(lines))
    return path
