"""The real-client workloads of ``tests/test_mount_tools.py``, timed as a
user runs them (the ``tools`` row; issue 19: "the real-client workloads of
the suite's tool tests in total <= 1.5x fuse-overlayfs").

One repetition runs every tool in turn in one fresh mount of a target, in
the same order on every target, each timed on its own, plus their sum:

* ``git``          clone of a small repository made outside, branch, commit,
                   rebase, ``gc --prune=now``, status, fsck;
* ``venv_pip``     ``python -m venv --without-pip``, then ``pip --python``
                   install of a small local wheel (``--no-index``);
* ``compileall``   ``python -m compileall`` of a few hundred stdlib ``.py``
                   files in the workspace (their ``__pycache__`` is new);
* ``pytest``       pytest of a tiny project in the workspace
                   (``-p no:cacheprovider``, bytecode written);
* ``sqlite``       the sqlite3 CLI in WAL mode: a few thousand inserts in
                   transactions of 250 rows, then a count;
* ``sed_cp``       ``sed -i`` of a few hundred workspace files, ``cp -a`` of them;
* ``rsync_diff``   ``rsync -a`` of a copy of the Python stdlib into the
                   mount, then ``diff -r`` against the source;
* ``tar``          tar of that copy out of the mount, untar back into it;
* ``make_gcc``     ``make`` of a small C program (a few units), run it,
                   ``make -q`` (up to date: mtimes are consistent).

Inputs that exist before (the stdlib ``.py`` files, the tiny project, the
C sources) are in the workspace, hard-linked from the run's templates
(every tool here replaces such files by rename, never writes them in
place); everything the tools create goes into the mount.  The commands
check their results by exit status (``diff -r``, ``git fsck``, the row
count, ``make -q``), so a broken mount cannot look fast.  pip and pytest
run once natively before the first repetition, so the bytecode their first
run writes (outside every mount) is charged to no target.  Sizes come from
the run's config (``tools_*``).
"""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import sys
import sysconfig
import zipfile
from pathlib import Path

from .context import Context, sh, timed
from .fixtures import GIT_ENV

#: ``(name, description)`` of each tool, in run order; metric ``tools_<name>``.
TOOLS: list[tuple[str, str]] = [
    ("git", "git: clone a small repository into the mount, branch, commit, rebase, gc, status, fsck"),
    ("venv_pip", "python -m venv --without-pip, then pip install of a local wheel (--no-index)"),
    ("compileall", "python -m compileall of stdlib .py files in the workspace"),
    ("pytest", "pytest of a tiny project in the workspace (-p no:cacheprovider)"),
    ("sqlite", "sqlite3 CLI, WAL mode: inserts in transactions of 250 rows, then a count"),
    ("sed_cp", "sed -i of workspace files, then cp -a of them"),
    ("rsync_diff", "rsync -a of a copy of the Python stdlib into the mount, then diff -r"),
    ("tar", "tar of that copy out of the mount, untar it back in"),
    ("make_gcc", "make + gcc of a small C program, run it, make -q"),
]
TOTAL = "tools_total"
METRICS: dict[str, str] = {f"tools_{n}": d for n, d in TOOLS}
METRICS[TOTAL] = "the tools above in total, one mount per repetition (issue 19: <= 1.5x fuse-overlayfs)"

GIT = "git -c init.defaultBranch=main -c gc.auto=0 -c maintenance.auto=false"
#: Directory names left out of the stdlib copy: test suites (some files
#: there are deliberately not valid Python), installed packages, caches and
#: the static libpython of ``config-*``.
SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


def tool_env() -> dict[str, str]:
    """The environment the tools run in: a user's, with git's identity and
    no global config, pip kept off the network and its cache, and bytecode
    written (the test harness may set ``PYTHONDONTWRITEBYTECODE``; a user's
    pytest and imports write ``__pycache__``)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env.update(GIT_ENV)
    env.update({"PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_CACHE_DIR": "1", "PIP_NO_INPUT": "1"})
    return env


# -- inputs, built once per run ---------------------------------------------------------


def stdlib_files(limit: int, suffix: str = "") -> list[Path]:
    """The first ``limit`` files (by relative path) of this interpreter's
    stdlib ending in ``suffix``, test suites and ``config-*`` left out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("config-"))
        for name in sorted(filenames):
            path = Path(dirpath, name)
            if name.endswith(suffix) and not path.is_symlink():
                out.append(path)
                if len(out) >= limit:
                    return out
    return out


def copy_stdlib(dest: Path, limit: int, suffix: str = "") -> Path:
    """A copy of :func:`stdlib_files` under ``dest`` (modes and mtimes kept)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in stdlib_files(limit, suffix):
        target = dest / path.relative_to(root)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
    return dest


def build_wheel(path: Path) -> Path:
    """A minimal valid wheel built by hand (no build backend needed)."""
    files = {
        "tinypkg/__init__.py": b"def answer():\n    return 42\n",
        "tinypkg-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: tinypkg\nVersion: 1.0\n",
        "tinypkg-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: bench\nRoot-Is-Purelib: true\n"
                                       b"Tag: py3-none-any\n",
    }
    record = []
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}")
    record.append("tinypkg-1.0.dist-info/RECORD,,")
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr("tinypkg-1.0.dist-info/RECORD", "\n".join(record) + "\n")
    return path


def origin_repo(dest: Path, files: int) -> Path:
    """A repository of ``files`` stdlib ``.py`` files and 5 commits (the
    last four each change a few files), made outside every mount."""
    copy_stdlib(dest, files, ".py")
    sh(f"{GIT} init -q && {GIT} add -A && {GIT} commit -qm base", dest, tool_env())
    paths = sorted(p for p in dest.rglob("*.py") if ".git" not in p.parts)
    for c in range(1, 5):
        for p in paths[c::max(1, len(paths) // 5)]:
            with open(p, "a") as f:
                f.write(f"# change {c}\n")
        sh(f"{GIT} commit -qam 'change {c}'", dest, tool_env())
    return dest


def project(dest: Path, tests: int = 5) -> Path:
    """A tiny pytest project: one module and ``tests`` test files."""
    dest.mkdir(parents=True)
    (dest / "calc.py").write_text("def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n")
    for i in range(tests):
        (dest / f"test_calc{i}.py").write_text(
            "from calc import add, mul\n\n\n"
            f"def test_add():\n    assert add({i}, 3) == {i + 3}\n\n\n"
            f"def test_mul():\n    assert mul({i}, 3) == {i * 3}\n")
    return dest


def c_program(dest: Path, units: int) -> Path:
    """A C program of ``units`` source files plus ``main.c`` and a Makefile."""
    dest.mkdir(parents=True)
    decls, calls = [], []
    for i in range(units):
        (dest / f"u{i}.c").write_text(f"int f{i}(int x) {{ int s = 0; for (int k = 0; k < x; k++) s += k * {i + 1};"
                                      f" return s; }}\n")
        decls.append(f"int f{i}(int x);")
        calls.append(f"f{i}(10)")
    (dest / "main.c").write_text("#include <stdio.h>\n" + "\n".join(decls) + "\n"
                                 f"int main(void) {{ printf(\"%d\\n\", {' + '.join(calls) or '0'}); return 0; }}\n")
    objs = " ".join(f"u{i}.o" for i in range(units))
    (dest / "Makefile").write_text(f"OBJS = main.o {objs}\n"
                                   "prog: $(OBJS)\n\tgcc -o prog $(OBJS)\n"
                                   "%.o: %.c\n\tgcc -O1 -c -o $@ $<\n")
    return dest


def sqlite_script(path: Path, rows: int, per_txn: int = 250) -> Path:
    """SQL that makes a WAL database and inserts ``rows`` rows in
    transactions of ``per_txn``."""
    lines = ["PRAGMA journal_mode=WAL;", "CREATE TABLE t(id INTEGER PRIMARY KEY, name TEXT, n INTEGER);"]
    for start in range(0, rows, per_txn):
        lines.append("BEGIN;")
        lines += [f"INSERT INTO t(name, n) VALUES ('row {i}', {i});" for i in range(start, min(rows, start + per_txn))]
        lines.append("COMMIT;")
    path.write_text("\n".join(lines) + "\n")
    return path


def inputs(ctx: Context) -> dict[str, Path]:
    """The run's inputs of the tools by name, built on first use."""
    cfg = ctx.cfg
    d = ctx.data_dir / "tools"
    inp = {
        "origin": ctx.once("tools: git origin", lambda: origin_repo(d / "origin", cfg.tools_git_files)),
        "wheel": ctx.once("tools: wheel", lambda: build_wheel(d / "wheels" / "tinypkg-1.0-py3-none-any.whl")),
        "pylib": ctx.once("tools: stdlib .py files", lambda: copy_stdlib(d / "pylib", cfg.tools_py_files, ".py")),
        "project": ctx.once("tools: pytest project", lambda: project(d / "proj")),
        "cprog": ctx.once("tools: C program", lambda: c_program(d / "cprog", cfg.tools_c_units)),
        "sql": ctx.once("tools: sqlite script", lambda: sqlite_script(d / "insert.sql", cfg.tools_sqlite_rows)),
        "stdlib": ctx.once("tools: stdlib copy", lambda: copy_stdlib(d / "stdlib", cfg.tools_tree_files)),
    }
    ctx.once("tools: warm-up", lambda: _warm_up(ctx, inp, d / "warm-up"))
    return inp


def _warm_up(ctx: Context, inp: dict[str, Path], root: Path) -> Path:
    """Run the Python tools once outside every mount: their first run
    writes the bytecode of pip and pytest (outside the mount), which would
    otherwise be charged to whichever target runs first."""
    (root / "scratch").mkdir(parents=True)
    sh(f"cp -a {inp['project']} proj", root)
    for name, cmd in commands(inp, ctx.cfg.tools_sqlite_rows, root / "scratch"):
        if name in ("venv_pip", "pytest"):
            sh(cmd, root, tool_env())
    shutil.rmtree(root)
    return root


# -- the workload ---------------------------------------------------------------------------


def prepare(ctx: Context, lower: Path) -> None:
    """The workspace's files that exist before the tools run: hard links to
    the run's templates (cheap; no tool here writes one of them in place)."""
    inp = inputs(ctx)
    for name, src in (("pylib", inp["pylib"]), ("edit", inp["pylib"]), ("proj", inp["project"]),
                      ("cprog", inp["cprog"])):
        sh(f"cp -al {src} {name}", lower)


def commands(inp: dict[str, Path], rows: int, scratch: Path) -> list[tuple[str, str]]:
    """``(tool, shell command)`` in run order, run in the mount's root;
    ``scratch`` is a directory outside the mount (the tar archive)."""
    py = sys.executable
    cmds = {
        "git": (f"{GIT} clone -q {inp['origin']} repo && cd repo"
                f" && {GIT} checkout -q -b feature && echo feature > feat.txt && {GIT} add feat.txt"
                f" && {GIT} commit -qm feat"
                f" && {GIT} checkout -q main && echo more >> README.bench && {GIT} add README.bench"
                f" && {GIT} commit -qm more"
                f" && {GIT} checkout -q feature && {GIT} rebase -q main && {GIT} gc -q --prune=now"
                f" && test -z \"$({GIT} status --porcelain)\" && {GIT} fsck --no-progress"),
        "venv_pip": (f"{py} -m venv --without-pip venv"
                     f" && {py} -m pip --python venv/bin/python install -q --no-index {inp['wheel']}"
                     f" && test \"$(venv/bin/python -c 'import tinypkg; print(tinypkg.answer())')\" = 42"),
        "compileall": f"{py} -m compileall -q pylib > /dev/null",
        "pytest": f"{py} -m pytest -q -p no:cacheprovider proj > /dev/null",
        "sqlite": (f"sqlite3 app.db < {inp['sql']} > /dev/null"
                   f" && test \"$(sqlite3 app.db 'SELECT count(*) FROM t')\" = {rows}"),
        "sed_cp": "find edit -name '*.py' -print0 | xargs -0 sed -i 's/^import /import  /' && cp -a edit edit.copy",
        "rsync_diff": f"rsync -a {inp['stdlib']}/ stdlib/ && diff -r {inp['stdlib']} stdlib",
        "tar": f"tar -cf {scratch}/stdlib.tar stdlib && mkdir untar && tar -xf {scratch}/stdlib.tar -C untar",
        "make_gcc": "cd cprog && make -s && ./prog > /dev/null && make -q",
    }
    return [(name, cmds[name]) for name, _ in TOOLS]


def run(ctx: Context, mp: Path) -> dict[str, float]:
    """Seconds per tool (``tools_<name>``) and their sum (``tools_total``)
    in the mount ``mp``."""
    scratch = ctx.tmp / "tools-scratch"
    scratch.mkdir()
    env = tool_env()
    out: dict[str, float] = {}
    try:
        for name, cmd in commands(inputs(ctx), ctx.cfg.tools_sqlite_rows, scratch):
            out[f"tools_{name}"] = timed(cmd, mp, env)
    finally:
        shutil.rmtree(scratch)
    out[TOTAL] = sum(out.values())
    return out
