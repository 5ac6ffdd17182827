"""Statistics, ratios, the issue's targets, and the printed table.

Every measurement is stored as raw samples plus a summary (median, p95,
min, max); printed numbers are medians unless a row says p50/p95.  A ratio
``stepfs/X`` is stepfs's median time divided by X's median time from the
same run (lower is better; for throughput rows the time ratio is printed
too, so "2.0x" always means "stepfs took twice as long").
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

REFERENCES = ("native", "overlay", "fuse-overlayfs", "passthrough")


def summary(samples: list[float]) -> dict:
    if not samples:
        return {"samples": [], "n": 0, "median": None, "p95": None, "min": None, "max": None}
    ordered = sorted(samples)
    return {
        "samples": list(samples),
        "n": len(samples),
        "median": statistics.median(ordered),
        "p95": percentile(ordered, 95),
        "min": ordered[0],
        "max": ordered[-1],
    }


def percentile(ordered: list[float], pct: float) -> float:
    """Nearest-rank percentile of an already sorted list."""
    rank = max(1, math.ceil(pct / 100 * len(ordered)))
    return ordered[rank - 1]


def ratios(results: dict[str, dict], subject: str = "stepfs", stat: str = "median") -> dict[str, float]:
    """``{"stepfs/native": 1.8, ...}`` for every reference with a result."""
    out: dict[str, float] = {}
    mine = results.get(subject, {}).get(stat)
    if not mine:
        return out
    for ref, res in results.items():
        if ref == subject or not res.get(stat):
            continue
        out[f"{subject}/{ref}"] = mine / res[stat]
    return out


def fmt_seconds(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 1e-3:
        return f"{s * 1e6:.0f} us"
    if s < 1:
        return f"{s * 1e3:.1f} ms"
    return f"{s:.2f} s"


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def fmt_ratio(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}x" if r < 10 else f"{r:.0f}x"


# -- the targets ------------------------------------------------------------


@dataclass
class Goal:
    goal: str
    value: float | None
    limit: float
    cmp: str                 # "<=" or ">="
    unit: str = "x"
    note: str = ""

    @property
    def met(self) -> bool | None:
        if self.value is None:
            return None
        return self.value <= self.limit if self.cmp == "<=" else self.value >= self.limit

    def to_json(self) -> dict:
        return {"goal": self.goal, "value": self.value, "limit": self.limit, "cmp": self.cmp, "unit": self.unit,
                "met": self.met, "note": self.note}


def _ratio(w: dict, name: str, key: str) -> float | None:
    return w.get(name, {}).get("ratios", {}).get(key)


def _stat(w: dict, name: str, target: str, stat: str) -> float | None:
    return w.get(name, {}).get("results", {}).get(target, {}).get(stat)


def _by_size(w: dict, prefix: str) -> list[tuple[int, str]]:
    """``[(workspace files, workload name)]`` of names ``<prefix><N>files``, by N."""
    out = []
    for k in w:
        middle = k[len(prefix):-len("files")] if k.startswith(prefix) and k.endswith("files") else ""
        if middle.isdigit():
            out.append((int(middle), k))
    return sorted(out)


def evaluate(w: dict) -> list[Goal]:
    """The targets of the issue, from the workloads of one run."""
    goals: list[Goal] = []
    fo, pt = "stepfs/fuse-overlayfs", "stepfs/passthrough"
    # Throughput >= 0.8x fuse-overlayfs  <=>  time <= 1.25x fuse-overlayfs.
    for name, what in (("seq_read", "sequential read of an untouched file"), ("seq_write", "sequential write")):
        if name not in w:
            continue
        r = _ratio(w, name, fo)
        goals.append(Goal(f"{what}: throughput >= 0.8x fuse-overlayfs", None if r is None else 1 / r, 0.8, ">="))
    # Issue 19: every metadata-heavy row within 1.5x fuse-overlayfs and no
    # slower than the bare passthrough (what any Python FUSE daemon pays).
    for name in ("untar", "find_stat", "find_stat_warm", "ls_lR", "ls_lR_warm", "git_status", "git_status_warm",
                 "rm_rf", "npm_create"):
        if name in w:
            goals.append(Goal(f"{name}: time <= 1.5x fuse-overlayfs", _ratio(w, name, fo), 1.5, "<="))
            if _ratio(w, name, pt) is not None:
                goals.append(Goal(f"{name}: time <= 1.0x bare passthrough", _ratio(w, name, pt), 1.0, "<="))
    for name, limit in (("npm_create_unversioned", 1.5), ("rm_rf_unversioned", 2.0)):
        if name in w:  # issue 19 part 1: generated trees at native speed
            goals.append(Goal(f"{name}: time <= {limit:g}x native", _ratio(w, name, "stepfs/native"), limit, "<="))
    if "tools_total" in w:  # issue 19: the real-client workloads of the suite's tool tests
        goals.append(Goal("real-client tools (git, pip, compileall, pytest, sqlite3, sed/cp, rsync + diff, tar, "
                          "make + gcc) in total: time <= 1.5x fuse-overlayfs", _ratio(w, "tools_total", fo), 1.5, "<="))
    commits = _by_size(w, "commit_10_")
    if commits:
        big_n, big = commits[-1]
        goals.append(Goal(f"10-file step commit p95 < 20 ms in the {big_n}-file workspace (library call via the daemon)",
                          _stat(w, big, "stepfs", "p95"), 0.020, "<=", unit="s"))
    for prefix, label in (("mount_", "mount time"), ("commit_10_", "10-file commit time")):
        sizes = _by_size(w, prefix)
        if len(sizes) >= 2:
            (small_n, small), (big_n, big_k) = sizes[0], sizes[-1]
            a, b = _stat(w, small, "stepfs", "median"), _stat(w, big_k, "stepfs", "median")
            goals.append(Goal(f"{label}: {big_n}-file workspace within 10% of {small_n}-file one (ratio)",
                              None if not a or b is None else b / a, 1.10, "<="))
    if "checkpoint" in w:
        r = _ratio(w, "checkpoint", "stepfs/shadow-git")
        goals.append(Goal("checkpoint cost >= 50x lower than shadow-git (shadow-git/stepfs)",
                          None if not r else 1 / r, 50, ">="))
    for name, wl in w.items():
        if name.startswith("cli_") and "target_ratio" in wl:
            goals.append(Goal(f"'stepfs {name[4:].replace('_', '-')}': <= {wl['target_ratio']:g}x 'python -c pass' "
                              f"(paired median)", wl.get("paired_ratio"), wl["target_ratio"], "<="))
    if "close_write_4k" in w:
        goals.append(Goal("close-write of a 4 KiB rewrite, guard on: p50 <= 60 us",
                          _stat(w, "close_write_4k", "stepfs", "median"), 60e-6, "<=", unit="s"))
        guard = w["close_write_4k"].get("guard_added_p95")
        goals.append(Goal("close-write guard adds < 2 ms p95 for a 4 KiB file", guard, 0.002, "<=", unit="s",
                          note="" if guard is not None else "guard toggle not available"))
    if "store_growth_edited_10mb" in w:
        goals.append(Goal("store growth for a one-line edit of a committed 10 MB file <= 1 MB",
                          _stat(w, "store_growth_edited_10mb", "stepfs", "median"), 1_000_000, "<=", unit="B"))
    if "agent_session" in w:  # issue 20
        s = w["agent_session"]["session"]
        goals.append(Goal(f"{s['steps']}-step agent session: store after gc <= 1.0x shadow-git's packed .git",
                          s["store_vs_git"], 1.0, "<="))
        goals.append(Goal("the same session with --keep-last 20: store <= 3x the workspace",
                          s["keep_last_20_vs_workspace"], 3.0, "<="))
    if "gc_scale" in w:  # issue 20
        c, g = w["gc_scale"]["gc_scale"]["churn"], w["gc_scale"]["gc_scale"]["gib"]
        goals.append(Goal("after temp-file churn and gc, chunks <= 1.2x what the layers reference",
                          c["chunks_vs_referenced"], 1.2, "<="))
        goals.append(Goal(f"gc of {g['garbage_before'] / (1 << 30):.2f} GiB of garbage: under a minute",
                          g["gc_seconds"], 60.0, "<=", unit="s"))
        goals.append(Goal("the same gc frees >= 95% of the garbage", g["freed_fraction"], 0.95, ">="))
    return goals


# -- printing -------------------------------------------------------------------------


def _cell(res: dict | None, kind: str) -> str:
    if not res or res.get("median") is None:
        return "-"
    if kind == "bytes":
        return fmt_bytes(res["median"])
    if kind == "latency":
        return f"{fmt_seconds(res['median'])} / {fmt_seconds(res['p95'])}"
    return fmt_seconds(res["median"])


def _grid(rows: list[list[str]]) -> list[str]:
    """Left-aligned columns; the last column is free text."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = []
    for n, r in enumerate(rows):
        lines.append(("  ".join(c.ljust(widths[i]) for i, c in enumerate(r[:-1])) + "  " + r[-1]).rstrip())
        if n == 0:
            lines.append("-" * min(150, sum(widths) + 2 * len(widths) + 8))
    return lines


#: Ratios printed first in a row's notes: the issue's targets are against
#: fuse-overlayfs, and native says what the disk itself costs.
FIRST = ("stepfs/fuse-overlayfs", "stepfs/native")


def _notes(wl: dict) -> str:
    ratios = wl.get("ratios", {})
    order = [k for k in FIRST if k in ratios] + [k for k in ratios if k not in FIRST]
    notes = [f"{k} {fmt_ratio(ratios[k])}" for k in order]
    if wl.get("throughput_mib_s"):
        notes.append("MiB/s " + " ".join(f"{k}={v:.0f}" for k, v in wl["throughput_mib_s"].items()))
    if wl.get("cpu_per_step_s"):
        cpu = wl["cpu_per_step_s"]
        notes.append("CPU per step: " + ", ".join(f"{k} {fmt_seconds(v)}" for k, v in cpu.items()))
    if wl.get("note"):
        notes.append(wl["note"])
    if wl.get("status"):
        notes.append(wl["status"])
    return ", ".join(notes)


def _label(name: str, wl: dict) -> str:
    return name + (" (p50 / p95)" if wl.get("kind") == "latency" else "")


def table(run: dict) -> str:
    """Two tables: side-by-side rows (stepfs and references), then rows
    only stepfs has (with shadow-git where it is the comparison)."""
    w = run["workloads"]
    side = {n: wl for n, wl in w.items() if any(r in wl.get("results", {}) for r in REFERENCES)}
    cols = [t for t in run["targets"] if run["targets"][t].get("available")]
    cols += sorted({t for wl in side.values() for t in wl["results"] if t not in cols})
    lines = []
    if side:
        rows = [["workload"] + cols + ["stepfs / reference"]]
        for name, wl in side.items():
            rows.append([_label(name, wl)] + [_cell(wl["results"].get(c), wl.get("kind", "time")) for c in cols]
                        + [_notes(wl)])
        lines += _grid(rows)
    own = {n: wl for n, wl in w.items() if n not in side}
    if own:
        if lines:
            lines.append("")
        rows = [["stepfs only", "stepfs", "compared with", "notes"]]
        for name, wl in own.items():
            kind = wl.get("kind", "time")
            res = wl.get("results", {})
            other = [f"{t} {_cell(r, kind)}" for t, r in res.items() if t != "stepfs"]
            rows.append([_label(name, wl), _cell(res.get("stepfs"), kind), ", ".join(other) or "-", _notes(wl)])
        lines += _grid(rows)
    return "\n".join(lines)


def goals_text(goals: list[dict]) -> str:
    lines = []
    for g in goals:
        mark = {True: "MET    ", False: "NOT MET", None: "n/a    "}[g["met"]]
        v = g["value"]
        if v is None:
            shown = g["note"] or "not measured"
        elif g["unit"] == "s":
            shown = fmt_seconds(v)
        elif g["unit"] == "B":
            shown = fmt_bytes(v)
        else:
            shown = f"{v:.2f}x"
        lines.append(f"  [{mark}] {g['goal']}: {shown}")
    return "\n".join(lines)
