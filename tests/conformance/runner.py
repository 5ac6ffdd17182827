"""Run the conformance cases against a directory and compare targets.

A *run* executes every case in its own subdirectory of a root and returns
``{key: reason or None}`` where ``key`` is ``"<mode>:<case id>"``:

* ``fresh``: the whole case runs through the target (everything it touches
  was created there);
* ``lower``: only two-phase cases; their setup ran in the backing directory
  before the target existed (for an overlay: files of the lower layer, for
  stepfs: committed workspace files), their check runs through the target.

:func:`run_fresh` and :func:`run_lower` are the building blocks; the
fixtures that mount the targets live in the test module and
:mod:`tests.conformance.fuse_overlay`.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path

from . import cases_data, cases_meta, cases_misc, cases_names  # noqa: F401  (they register the cases)
from .kit import CASES, Case, Fail, T

KNOWN_DIFFERENCES = Path(__file__).with_name("known_differences.txt")


def _reason(exc: BaseException) -> str:
    if isinstance(exc, Fail):
        return str(exc)
    if isinstance(exc, OSError):
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        return f"unexpected {type(exc).__name__}: {exc} (line {frame.lineno})"
    return f"{type(exc).__name__}: {exc}"


def _case_dir(root: str, c: Case) -> str:
    path = os.path.join(root, c.dirname)
    os.mkdir(path, 0o755)
    os.chmod(path, 0o755)
    return path


def _finish(gen: Iterator) -> None:
    for _ in gen:
        raise Fail("a case yields at most once")


def run_fresh(root: str, cases: list[Case] | None = None) -> dict[str, str | None]:
    """Every case, entirely through ``root``."""
    results: dict[str, str | None] = {}
    for c in cases if cases is not None else CASES:
        key = f"fresh:{c.id}"
        try:
            t = T(_case_dir(root, c))
            out = c.fn(t, *c.args)
            if c.two_phase:
                next(out, None)
                _finish(out)
            results[key] = None
        except Exception as exc:  # noqa: BLE001 - a failing case is a result
            results[key] = _reason(exc)
    return results


class LowerRun:
    """The two-phase cases: :meth:`setup` in the backing directory, then
    (once the target is up) :meth:`check` through it."""

    def __init__(self, cases: list[Case] | None = None) -> None:
        self.cases = [c for c in (cases if cases is not None else CASES) if c.two_phase]
        self._pending: dict[str, tuple[T, Iterator]] = {}
        self.results: dict[str, str | None] = {}

    def setup(self, backing: str) -> None:
        for c in self.cases:
            key = f"lower:{c.id}"
            try:
                t = T(_case_dir(backing, c))
                gen = c.fn(t, *c.args)
                next(gen)
                self._pending[key] = (t, gen)
            except StopIteration:
                self.results[key] = "the case did not yield"
            except Exception as exc:  # noqa: BLE001
                self.results[key] = "setup: " + _reason(exc)

    def check(self, root: str) -> dict[str, str | None]:
        for key, (t, gen) in self._pending.items():
            t.d = os.path.join(root, os.path.basename(t.d))
            try:
                _finish(gen)
                self.results[key] = None
            except Exception as exc:  # noqa: BLE001
                self.results[key] = _reason(exc)
        self._pending.clear()
        return self.results


def groups(results: dict[str, str | None]) -> dict[str, tuple[int, int]]:
    """``{group: (passed, total)}`` over both modes."""
    out: dict[str, list[int]] = {}
    for key, reason in results.items():
        group = key.split(":", 1)[1].split("/", 1)[0]
        counts = out.setdefault(group, [0, 0])
        counts[1] += 1
        counts[0] += reason is None
    return {g: (p, n) for g, (p, n) in sorted(out.items())}


def load_known(path: Path = KNOWN_DIFFERENCES) -> dict[str, str]:
    """``{key: reason}`` from the checked-in list (``key  # reason`` lines)."""
    known: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, _, reason = line.partition(" # ")
        known[key.strip()] = reason.strip()
    return known


def table(by_target: dict[str, dict[str, str | None]]) -> str:
    """A summary: passed/total per group and target, then totals."""
    names = list(by_target)
    all_groups = sorted({g for r in by_target.values() for g in groups(r)})
    per = {n: groups(r) for n, r in by_target.items()}
    width = max(14, *(len(n) + 2 for n in names))
    lines = ["group".ljust(12) + "".join(n.rjust(width) for n in names)]
    for g in all_groups:
        cells = [f"{per[n].get(g, (0, 0))[0]}/{per[n].get(g, (0, 0))[1]}" for n in names]
        lines.append(g.ljust(12) + "".join(c.rjust(width) for c in cells))
    totals = []
    for n in names:
        r = by_target[n]
        totals.append(f"{sum(v is None for v in r.values())}/{len(r)}")
    lines.append("TOTAL".ljust(12) + "".join(c.rjust(width) for c in totals))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """``python -m tests.conformance.runner DIR``: run the fresh cases in an
    existing empty directory (a mount of anything) and list the failures."""
    if len(argv) != 1:
        print("usage: python -m tests.conformance.runner EMPTY_DIR", file=sys.stderr)
        return 2
    results = run_fresh(argv[0])
    for key, reason in sorted(results.items()):
        if reason is not None:
            print(f"FAIL {key}: {reason}")
    print(table({argv[0]: results}))
    return 0 if all(v is None for v in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
