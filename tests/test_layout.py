"""The layout's import rules, read from the source with ``ast`` (README,
"Architecture"): every import of every product module, at module level, in
functions and under ``TYPE_CHECKING`` alike.

    cli -> client -> daemon's protocol (overlayfs/daemon/protocol.py)
    daemon -> core -> store
    client -> store (history reads);  stepfs.api -> client
    store imports nothing above it; core imports neither daemon nor client;
    no import cycles between modules.

And every file of the repository imports the product as ``stepfs.…``: no
test, bench or script loads the checkout's folders as top-level packages
(a second copy of the store's modules, with its own locks and caches).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from conftest import ROOT

#: Folder in the checkout -> its import name once installed (pyproject.toml).
PACKAGES = {"stepfs": "stepfs", "store": "stepfs.store", "overlayfs": "stepfs.overlayfs", "cli": "stepfs.cli"}

#: Who may import whom, by role (see :func:`role`).
ALLOWED = {
    "store": {"store"},
    "core": {"core", "store"},
    "protocol": {"protocol"},
    "daemon": {"daemon", "protocol", "core", "store"},
    "client": {"client", "protocol", "store"},
    "cli": {"cli", "client", "store"},
    "api": {"api", "client", "store"},
}

#: Cycles that exist today and have an owner.
ALLOWED_CYCLES: list[set[str]] = []


def product_modules() -> dict[str, Path]:
    """Import name -> file, for every module the distribution installs."""
    out = {}
    for folder, name in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([name, *parts])] = path
    return out


MODULES = product_modules()


def role(module: str) -> str | None:
    for prefix, name in [("stepfs.store", "store"), ("stepfs.overlayfs.core", "core"),
                         ("stepfs.overlayfs.daemon.protocol", "protocol"), ("stepfs.overlayfs.daemon", "daemon"),
                         ("stepfs.overlayfs.client", "client"), ("stepfs.cli", "cli"), ("stepfs.api", "api")]:
        if module == prefix or module.startswith(prefix + "."):
            return name
    return None  # the packages stepfs and stepfs.overlayfs themselves


def imported(module: str, path: Path) -> set[str]:
    """The product modules ``module`` imports anywhere in its file."""
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor if is_package else anchor[:-1]
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # ``from pkg import mod`` imports the module pkg.mod, not pkg
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name and name != module:
                out.add(name)
    return out


GRAPH = {module: imported(module, path) for module, path in MODULES.items()}


def test_every_role_folder_is_found():
    roles = {role(m) for m in MODULES}
    assert {"store", "core", "protocol", "daemon", "client", "cli", "api"} <= roles
    assert "stepfs.overlayfs.core.view" in MODULES and "stepfs.overlayfs.daemon.fuse_ops" in MODULES
    # the relative-import resolution above is exercised: the store's own modules import each other
    assert "stepfs.store.schema" in GRAPH["stepfs.store.db"]


def test_imports_follow_the_layers():
    wrong = []
    for module, targets in GRAPH.items():
        mine = role(module)
        for target in targets:
            theirs = role(target)
            if mine is None or theirs is None:
                if target not in ("stepfs",):  # the top-level packages hold no code to import
                    wrong.append(f"{module} -> {target} (a package __init__ should import nothing)")
                continue
            if theirs not in ALLOWED[mine]:
                wrong.append(f"{module} ({mine}) -> {target} ({theirs})")
    assert wrong == [], "imports against the layering:\n" + "\n".join(sorted(wrong))


def test_role_packages_hold_no_code():
    for folder in ["overlayfs", "overlayfs/core", "overlayfs/daemon", "overlayfs/client", "store", "cli"]:
        assert (ROOT / folder / "__init__.py").read_text().strip() == "", folder


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    found = cycles(GRAPH)
    unexpected = [sorted(c) for c in found if c not in ALLOWED_CYCLES]
    assert unexpected == [], f"import cycles: {unexpected}"
    stale = [sorted(c) for c in ALLOWED_CYCLES if c not in found]
    assert stale == [], f"allowed cycles that no longer exist (remove them from ALLOWED_CYCLES): {stale}"


#: ``import store``, ``from overlayfs.x import``, ``-m cli.main`` written in code or text.
STALE = re.compile(r"(?m)^\s*import (store|overlayfs|cli)\b|\bfrom (store|overlayfs|cli)(\.\w+)* import\b"
                   r"|-m (store|overlayfs|cli)\.")


def _python_files() -> list[Path]:
    skip = {".venv", ".git", "build", "node_modules"}
    return [p for p in ROOT.rglob("*.py") if not skip & set(p.relative_to(ROOT).parts)]


def test_nothing_imports_the_checkout_folders_as_top_level_packages():
    top = {"store", "overlayfs", "cli"}
    wrong = []
    for path in _python_files():
        tree = ast.parse(path.read_text(), str(path))
        where = path.relative_to(ROOT)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                wrong += [f"{where}:{node.lineno} import {a.name}" for a in node.names if a.name.split(".")[0] in top]
            elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] in top:
                wrong.append(f"{where}:{node.lineno} from {node.module} import ...")
            elif isinstance(node, (ast.List, ast.Tuple)):
                # [python, "-m", "module", ...]: a module run by path must be stepfs.…
                items = node.elts
                for a, b in zip(items, items[1:]):
                    if isinstance(a, ast.Constant) and a.value == "-m" and isinstance(b, ast.Constant) \
                            and isinstance(b.value, str) and "." in b.value and b.value.split(".")[0] in top:
                        wrong.append(f"{where}:{node.lineno} -m {b.value}")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                # code handed to another interpreter (python -c, shell shims)
                wrong += [f"{where}:{node.lineno} {m.group(0)!r} in a string" for m in STALE.finditer(node.value)]
    assert wrong == [], "\n".join(wrong)


def test_shell_docker_and_docs_run_stepfs_modules():
    wrong = []
    for path in [*ROOT.glob("docker/*"), *ROOT.glob("scripts/*"), ROOT / "Makefile", *ROOT.glob("bench/*.sh"),
                 *ROOT.glob("*.md"), *ROOT.glob("docs/*.md"), *ROOT.glob("bench/*.md")]:
        if path.is_file():
            wrong += [f"{path.relative_to(ROOT)}: {m.group(0)!r}" for m in STALE.finditer(path.read_text())]
    assert wrong == [], "\n".join(wrong)


#: The entry seam (docs/format8.md, "What has to change"): every query on
#: the local entry tables (format 8: ``paths``, ``layer_entries``,
#: ``path_layers``; format 7's ``entries``) lives in these modules, so a new
#: entry layout replaces them and nothing else.
ENTRY_SEAM = {"stepfs.store.entrytable", "stepfs.store.entryrows"}
#: Modules that name the tables for what they are: their one definition,
#: the 6 -> 7 upgrade that rebuilt format 7's table (a frozen format) and
#: the 7 -> 8 upgrade that reads it once.
ENTRY_TABLE_DEFINED = {"stepfs.store.schema", "stepfs.store.upgrade7", "stepfs.store.upgrade8"}
#: The tables' names.
ENTRY_TABLES = r"(?:entries|layer_entries|path_layers|paths)"
#: SQL naming a table or format 7's index, and the Core table objects.
ENTRY_SQL = re.compile(rf"\b(?:FROM|JOIN|INTO|UPDATE|TABLE)\s+{ENTRY_TABLES}\b|\bentries_path_layer\b"
                       rf"|\bschema\.{ENTRY_TABLES}\b")


def entry_table_uses(text: str) -> list[str]:
    """The lines of ``text`` that name the local entries table in SQL, or
    import the Core table from the schema."""
    lines = text.splitlines()
    found = {i for i, line in enumerate(lines) if ENTRY_SQL.search(line)}
    for node in ast.walk(ast.parse(text)):
        if (isinstance(node, ast.ImportFrom) and (node.module or "").rpartition(".")[2] == "schema"
                and any(re.fullmatch(ENTRY_TABLES, a.name) for a in node.names)):
            found.add(node.lineno - 1)
    return [lines[i].strip() for i in sorted(found)]


def test_entry_table_rule_recognises_each_way_of_naming_the_table():
    assert entry_table_uses('fetch("SELECT layer FROM entries WHERE layer = ?")')
    assert entry_table_uses('q = "WITH x AS (SELECT 1 FROM layers l JOIN entries e ON e.layer = l.number)"')
    assert entry_table_uses('q = "DELETE FROM entries"') and entry_table_uses('q = "INSERT INTO entries VALUES (?)"')
    assert entry_table_uses("E = schema.entries") and entry_table_uses("from stepfs.store.schema import entries")
    assert entry_table_uses("from stepfs.store.schema import (\n    layers,\n    entries as E,\n)")
    assert entry_table_uses('q = "CREATE INDEX entries_path_layer ON entries (path, layer)"')
    assert entry_table_uses('fetch("SELECT data FROM layer_entries WHERE layer = ?")')
    assert entry_table_uses('q = "SELECT id FROM paths WHERE parent = ?"') and entry_table_uses("P = schema.path_layers")
    # The shared history's table, a layer's ``entries`` argument and prose are not the table.
    assert not entry_table_uses("select(T.entries.c.layer)")
    assert not entry_table_uses("publish.write_layer(ws, entries, kind=SYNC)")
    assert not entry_table_uses("from stepfs.store.layers import entries as load_entries")
    assert not entry_table_uses('"""The layer entries, read from entries."""')


def test_only_the_entry_seam_names_the_entries_table():
    outside = []
    for module, path in MODULES.items():
        if module in ENTRY_SEAM or module in ENTRY_TABLE_DEFINED:
            continue
        outside += [f"{module}: {line}" for line in entry_table_uses(path.read_text())]
    assert outside == [], ("SQL on the entries table outside store/entrytable.py and store/entryrows.py "
                           "(add a function there):\n" + "\n".join(outside))
    for module in ENTRY_SEAM | ENTRY_TABLE_DEFINED - {"stepfs.store.schema"}:
        assert entry_table_uses(MODULES[module].read_text()), f"{module} no longer names the table: update the rule"
