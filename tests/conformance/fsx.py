"""A random-operation data-integrity exerciser in the manner of fsx.

One file, one seeded sequence of operations, an in-memory model of what
the file must hold.  Every read (``pread`` or through a shared mapping) is
compared with the model byte for byte, and the size after every operation.
Operations: write at a random offset (also past the end: a hole), truncate
up and down, read, mmap read, mmap write + msync, posix_fallocate, punch
hole, fsync, close and reopen.

``checkpoint`` (optional) is called every ``every`` operations with the
exerciser: the stepfs test commits a step there and compares the committed
workspace file with the model.  Reproduce a failure with the seed it
reports: ``python -m conformance.fsx FILE --seed S --ops N`` (from tests/).
"""

from __future__ import annotations

import argparse
import mmap
import os
import random
import sys
from collections import deque
from collections.abc import Callable

from .kit import FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE, fallocate

PAGE = mmap.PAGESIZE

#: Relative weights of the operations.
WEIGHTS = {
    "write": 24, "read": 18, "mapread": 8, "mapwrite": 8, "truncate": 8, "fallocate": 4, "punch": 5,
    "fsync": 3, "reopen": 3,
}


class FsxFailure(AssertionError):
    pass


class Fsx:
    """The exerciser.  Invariant: ``self.model`` is what the file holds
    after every completed operation."""

    def __init__(self, path: str, seed: int, max_size: int = 256 << 10, max_len: int = 48 << 10) -> None:
        self.path = path
        self.seed = seed
        self.rng = random.Random(seed)
        self.max_size = max_size
        self.max_len = max_len
        self.model = bytearray()
        self.ops_done = 0
        self.counts = dict.fromkeys(WEIGHTS, 0)
        self.history: deque[str] = deque(maxlen=16)
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self._names = list(WEIGHTS)
        self._weights = list(WEIGHTS.values())

    # -- helpers ---------------------------------------------------------------

    def fail(self, what: str) -> None:
        raise FsxFailure(f"fsx seed {self.seed}, op {self.ops_done}: {what}\nlast operations:\n  "
                         + "\n  ".join(self.history))

    def compare(self, got: bytes, offset: int, what: str) -> None:
        want = bytes(self.model[offset:offset + len(got)])
        if got != want:
            at = next(i for i in range(min(len(got), len(want))) if got[i] != want[i]) \
                if len(got) == len(want) else min(len(got), len(want))
            self.fail(f"{what}: {len(got)} bytes at {offset} differ from the model at byte "
                      f"{offset + at} (got {got[at:at + 8].hex()}, want {want[at:at + 8].hex()})")

    def check_file(self, path: str | None = None) -> None:
        """The whole file at ``path`` (default: ours, by pread) equals the model."""
        if path is None:
            data = os.pread(self.fd, len(self.model) + 1, 0)
        else:
            with open(path, "rb") as f:
                data = f.read()
        if len(data) != len(self.model):
            self.fail(f"{path or 'the file'} holds {len(data)} bytes, the model {len(self.model)}")
        self.compare(data, 0, f"whole file {path or ''}".strip())

    def _range(self, limit: int) -> tuple[int, int]:
        off = self.rng.randrange(limit) if limit > 0 else 0
        return off, self.rng.randint(1, self.max_len)

    # -- operations -------------------------------------------------------------

    def op_write(self) -> None:
        off, n = self._range(self.max_size)
        n = min(n, self.max_size - off) or 1
        data = self.rng.randbytes(n)
        self.history.append(f"write {off}+{n}")
        if os.pwrite(self.fd, data, off) != n:
            self.fail("short write")
        if off > len(self.model):
            self.model.extend(bytes(off - len(self.model)))
        self.model[off:off + n] = data

    def op_read(self) -> None:
        size = len(self.model)
        off, n = self._range(size + 1)
        self.history.append(f"read {off}+{n}")
        self.compare(os.pread(self.fd, n, off), off, "pread")

    def op_mapread(self) -> None:
        size = len(self.model)
        if size == 0:
            return
        off, n = self._range(size)
        n = min(n, size - off)
        self.history.append(f"mapread {off}+{n}")
        with mmap.mmap(self.fd, size, prot=mmap.PROT_READ) as m:
            self.compare(m[off:off + n], off, "mmap read")

    def op_mapwrite(self) -> None:
        size = len(self.model)
        if size == 0:
            return
        off, n = self._range(size)
        n = min(n, size - off)
        data = self.rng.randbytes(n)
        self.history.append(f"mapwrite {off}+{n}")
        with mmap.mmap(self.fd, size) as m:
            m[off:off + n] = data
            m.flush()  # msync(MS_SYNC)
        self.model[off:off + n] = data

    def op_truncate(self) -> None:
        size = self.rng.randrange(self.max_size + 1)
        self.history.append(f"truncate {len(self.model)} -> {size}")
        os.ftruncate(self.fd, size)
        if size < len(self.model):
            del self.model[size:]
        else:
            self.model.extend(bytes(size - len(self.model)))

    def op_fallocate(self) -> None:
        off, n = self._range(self.max_size)
        n = min(n, self.max_size - off) or 1
        self.history.append(f"fallocate {off}+{n}")
        os.posix_fallocate(self.fd, off, n)
        if off + n > len(self.model):
            self.model.extend(bytes(off + n - len(self.model)))

    def op_punch(self) -> None:
        size = len(self.model)
        if size == 0:
            return
        off, n = self._range(size)
        self.history.append(f"punch {off}+{n}")
        fallocate(self.fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, off, n)
        end = min(size, off + n)
        self.model[off:end] = bytes(end - off)

    def op_fsync(self) -> None:
        self.history.append("fsync")
        os.fsync(self.fd)

    def op_reopen(self) -> None:
        self.history.append("close+reopen")
        self.reopen()

    def reopen(self) -> None:
        os.close(self.fd)
        self.fd = -1
        self.fd = os.open(self.path, os.O_RDWR)

    # -- driver -----------------------------------------------------------------------

    def run(self, ops: int, every: int = 0, checkpoint: Callable[["Fsx"], None] | None = None) -> None:
        for _ in range(ops):
            name = self.rng.choices(self._names, self._weights)[0]
            try:
                getattr(self, "op_" + name)()
            except OSError as exc:
                self.fail(f"{name} failed: {exc}")
            self.counts[name] += 1
            self.ops_done += 1
            size = os.fstat(self.fd).st_size
            if size != len(self.model):
                self.fail(f"after {name}: fstat size {size}, model {len(self.model)}")
            if checkpoint is not None and every and self.ops_done % every == 0:
                self.history.append("checkpoint")
                checkpoint(self)
        self.check_file()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="fsx.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("file")
    parser.add_argument("--ops", type=int, default=10000)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    ex = Fsx(args.file, args.seed)
    try:
        ex.run(args.ops)
    except FsxFailure as exc:
        print(exc, file=sys.stderr)
        return 1
    finally:
        ex.close()
    print(f"fsx: {ex.ops_done} operations, seed {args.seed}: the file matched the model throughout "
          f"({', '.join(f'{k} {v}' for k, v in ex.counts.items())})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
