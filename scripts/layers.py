#!/usr/bin/env python3
"""Check that nbexec's import graph matches its folders: arrows point down, nothing imports in a circle.

Every module of the package belongs to a layer (the first matching prefix of LAYERS, top to bottom). A module may
import modules of its own layer or of lower ones, never a higher one; no two modules (nor two folders) import each
other, however indirectly; `config` imports no feature; no module imports another module's private (``_name``)
names; only the source registry and the CLI import a backend package (BACKENDS, with the listed exceptions).
Imports only for type checking count too: a type is an arrow as well. Exits 1 and lists what is wrong.

    scripts/layers.py           # check
    scripts/layers.py --graph   # print each module's imports, layer by layer
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "nbexec"

BACKENDS = ("nbexec.sandbox.docker", "nbexec.sandbox.fake", "nbexec.sandbox.remote",
            "nbexec.sandbox.ray")  # behind the seam
BACKEND_USERS = ("nbexec.engine.sources", "nbexec.cli")  # the source registry and the CLI: the only ways in
# Who else imports a backend, what of it, and why. A new entry is a design conversation (docs/design/backends.md).
BACKEND_EXCEPTIONS = {
    # The node's routes and the router speak the remote backend's wire (its frames, URL paths, node health).
    "nbexec.service": ("nbexec.sandbox.remote.frames", "nbexec.sandbox.remote.paths", "nbexec.sandbox.remote.nodes"),
    # The E2B door's processes, ports and code contexts run through the local sandbox's supervisor.
    "nbexec.service.e2b": ("nbexec.sandbox.docker",),
    # A Ray node's agent runs that node's local source; the driver reads its answers with the remote backend's
    # hostile-input readers (frames, listings, files, node ranking), so both backends read a node the same way.
    "nbexec.sandbox.ray": ("nbexec.sandbox.docker.local", "nbexec.sandbox.remote.frames",
                           "nbexec.sandbox.remote.files", "nbexec.sandbox.remote.nodes",
                           "nbexec.sandbox.remote.lost"),
}

# Top to bottom. A prefix names a module or a folder (everything under it).
LAYERS: list[tuple[str, ...]] = [
    ("nbexec.cli",),
    ("nbexec.service", "nbexec.integrations"),
    ("nbexec",),  # the package's __init__: the public API
    ("nbexec.engine",),
    BACKENDS,  # the sources behind the seam
    ("nbexec.packages", "nbexec.stores"),
    ("nbexec.sandbox.source",),  # the seam: what the engine, packages and the service use of a sandbox
    ("nbexec.sandbox",),  # the kernel wire: kernel, messages, lasterror, zmtp
    ("nbexec.egress", "nbexec.files"),
    ("nbexec.notebook",),
    ("nbexec.config", "nbexec.hostconfig", "nbexec.judgelangs", "nbexec.languages", "nbexec.names", "nbexec.result"),
    ("nbexec.errors", "nbexec.kinds", "nbexec.overrides"),  # kinds, overrides: typing words, nothing imported
]
LEAVES = {  # what these may import at all
    "nbexec.config": {"nbexec.errors", "nbexec.languages", "nbexec.names", "nbexec.overrides"},
    "nbexec.hostconfig": {"nbexec.errors"},
    "nbexec.judgelangs": {"nbexec.errors"},
    "nbexec.languages": {"nbexec.errors"},
    "nbexec.names": {"nbexec.errors"},
}
MAX_LINES = 400  # a longer module is a design conversation (STYLE.md): its reason is written here
LONGER: dict[str, tuple[str, int]] = {}  # module: why it passes MAX_LINES, and the most it may have


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> int:
    best, best_len = len(LAYERS), -1
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    return best


def imports(path: Path, modules: set[str]) -> list[tuple[str, list[str], int]]:
    """(imported module, names taken from it, line) for each nbexec import of ``path``."""
    this = module_name(path)
    package = this if path.name == "__init__.py" else this.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            if not base.startswith("nbexec"):
                continue
            names = []
            for alias in node.names:
                if f"{base}.{alias.name}" in modules:
                    found.append((f"{base}.{alias.name}", [], node.lineno))
                else:
                    names.append(alias.name)
            if names:
                found.append((base, names, node.lineno))
        elif isinstance(node, ast.Import):
            found += [(a.name, [], node.lineno) for a in node.names if a.name.startswith("nbexec")]
    return found


def under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def backend_import(this: str, target: str) -> str | None:
    """Why ``this`` may not import ``target``, or None: only the source registry and the CLI import a backend
    (a backend imports itself; BACKEND_EXCEPTIONS lists the rest)."""
    backend = next((b for b in BACKENDS if under(target, b)), None)
    if backend is None or under(this, backend) or any(under(this, user) for user in BACKEND_USERS):
        return None
    allowed = [a for prefix, found in BACKEND_EXCEPTIONS.items() if under(this, prefix) for a in found]
    if any(under(target, a) for a in allowed):
        return None
    return "a backend package, which only the source registry and the CLI import (scripts/layers.py BACKENDS)"


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one member (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def folder_of(module: str, modules: set[str]) -> str:
    return module if module in FOLDERS else module.rsplit(".", 1)[0]


FOLDERS: set[str] = set()


def too_long(files: list[Path]) -> list[str]:
    """The modules longer than MAX_LINES (or than their written reason allows), and reasons left unused."""
    lengths = {str(path.relative_to(ROOT)): len(path.read_text().splitlines()) for path in files}
    found = [f"{name}: {n} lines, over {LONGER.get(name, ('', MAX_LINES))[1]}" for name, n in lengths.items()
             if n > LONGER.get(name, ("", MAX_LINES))[1]]
    return found + [f"{name}: a reason to pass {MAX_LINES} lines, but it has {lengths.get(name, 0)}"
                    for name in LONGER if lengths.get(name, 0) <= MAX_LINES]


def check() -> list[str]:
    files = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(p) for p in files}
    FOLDERS.update(module_name(p) for p in files if p.name == "__init__.py")
    problems: list[str] = []
    graph: dict[str, set[str]] = defaultdict(set)
    folders: dict[str, set[str]] = defaultdict(set)
    for path in files:
        this = module_name(path)
        for target, names, line in imports(path, modules):
            while target not in modules and "." in target:
                target = target.rsplit(".", 1)[0]
            if target == this:
                continue
            where = f"{path.relative_to(ROOT)}:{line}"
            graph[this].add(target)
            if layer_of(target) < layer_of(this):
                problems.append(f"{where}: {this} imports {target}, a higher layer")
            if this in LEAVES and target not in LEAVES[this]:
                problems.append(f"{where}: {this} may import only {sorted(LEAVES[this])}, not {target}")
            if (why := backend_import(this, target)) is not None:
                problems.append(f"{where}: {this} imports {target}: {why}")
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private:
                problems.append(f"{where}: {this} imports private names of {target}: {', '.join(private)}")
            mine, theirs = folder_of(this, modules), folder_of(target, modules)
            if mine != theirs and not mine.startswith(theirs + ".") and not theirs.startswith(mine + "."):
                folders[mine].add(theirs)
    problems += too_long(files)
    for component in cycles(graph):
        problems.append("modules import each other in a circle: " + " -> ".join(component))
    for component in cycles(folders):
        problems.append("folders import each other in a circle: " + " -> ".join(component))
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graph", action="store_true", help="print each module's imports")
    args = parser.parse_args()
    if args.graph:
        files = sorted(PACKAGE.rglob("*.py"))
        modules = {module_name(p) for p in files}
        for path in sorted(files, key=lambda p: (layer_of(module_name(p)), module_name(p))):
            targets = sorted({t for t, _, _ in imports(path, modules)})
            print(f"[{layer_of(module_name(path))}] {module_name(path)} -> {', '.join(targets)}")
        return 0
    problems = check()
    for problem in problems:
        print(problem)
    if problems:
        print(f"{len(problems)} problem(s) in the import graph (see scripts/layers.py)", file=sys.stderr)
        return 1
    print(f"import graph ok: arrows point down, no circles, no module over {MAX_LINES} lines without a written reason")
    return 0


if __name__ == "__main__":
    sys.exit(main())
