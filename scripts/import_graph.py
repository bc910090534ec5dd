"""The import graph of mtpspec, read from the source with `ast` (nothing is imported), and its cycles.

Every `import` and `from ... import` statement in every module under mtpspec/ counts, wherever it sits: at module
level, inside a function or method, under `if`/`try`. A function-level (lazy) import only moves when the dependency
is paid, not whether it exists, so it counts the same as a module-level one. Resolution:

- `import a.b.c` depends on the deepest mtpspec module the dotted name names (a.b.c, else a.b, ...);
- `from a.b import x` depends on the module a.b.x when x is a submodule, else on a.b (x is a name defined there);
- relative imports (`from . import x`, `from ..models.common import y`) resolve against the importing module's
  package, the way Python resolves them;
- the parent packages Python initialises on the way (mtpspec/__init__.py for every import of mtpspec.*) are not
  edges: they would put every module in one cycle through the root package and say nothing about the code;
- names given to `importlib.import_module` as strings are not statements and are not counted: mtpspec/cli.py loads
  its optional subcommand modules that way, and those modules register themselves in its COMMANDS table.

Prints each module's imports of other mtpspec modules (function-level ones marked `(lazy)`), or with `--packages`
the same graph collapsed to the top-level subpackages (the files directly under mtpspec/ are `base` or `core`, see
BASE_MODULES): each package edge followed by the module imports that make it up, the edges that go against LAYERS,
and the cycles between packages (informational: package cycles are not errors). Then each import cycle between
modules, as a path `a -> b -> a` with the line of each import, and exits 1 when there is one (0 otherwise).

    .venv/bin/python scripts/import_graph.py              # module graph, cycles
    .venv/bin/python scripts/import_graph.py --packages   # package graph, layer violations, cycles
    .venv/bin/python scripts/import_graph.py --quiet      # cycles only
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "mtpspec"

# The files directly under mtpspec/ split in two for the package view: `base`, the vocabulary every layer builds on
# (types, errors, the cache and sampling primitives), and `core`, the engine side that assembles the rest (engine,
# api, compiled, batching, the top-level cli ...). A top-level file not named here is `core`.
BASE_MODULES = {"types", "errors", "cache", "sampling", "tree", "heap", "config", "threads", "metrics",
                "adaptive", "verify", "weight_cache"}

# Lower layers first; an import may go to its own layer or a lower one, and none goes between two application
# packages (the last layer): bench, viz, server and train are uses of the engine that nothing on the engine side,
# and none of each other, should need.
LAYERS: list[set[str]] = [
    {"base", "kernels"},
    {"models"},
    {"loading", "drafters"},
    {"core"},
    {"train", "bench", "viz", "server"},
]


@dataclass(frozen=True)
class Edge:
    """One import statement of `src` that depends on module `dst`."""

    src: str
    dst: str
    line: int
    lazy: bool  # inside a function body: paid on first call, not on import


@dataclass
class Graph:
    modules: dict[str, Path]  # dotted name -> file
    edges: list[Edge] = field(default_factory=list)

    def adjacency(self) -> dict[str, set[str]]:
        adj: dict[str, set[str]] = {m: set() for m in self.modules}
        for e in self.edges:
            adj[e.src].add(e.dst)
        return adj

    def edges_between(self, src: str, dst: str) -> list[Edge]:
        return [e for e in self.edges if e.src == src and e.dst == dst]


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def find_modules(root: Path, package: str = PACKAGE) -> dict[str, Path]:
    return {module_name(p, root): p for p in sorted((root / package).rglob("*.py"))}


def _deepest_module(name: str, modules: dict[str, Path]) -> str | None:
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def _resolve_from(node: ast.ImportFrom, importer: str, importer_is_pkg: bool) -> str:
    """The absolute dotted name of `from <level dots><module> import ...` in module `importer`."""
    if node.level == 0:
        return node.module or ""
    base = importer.split(".") if importer_is_pkg else importer.split(".")[:-1]
    if node.level - 1 > len(base) - 1:
        raise ValueError(f"{importer}: relative import of level {node.level} goes above the top package")
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


class _Collector(ast.NodeVisitor):
    """Every import statement of one module, with whether it sits inside a function."""

    def __init__(self) -> None:
        self.found: list[tuple[ast.Import | ast.ImportFrom, bool]] = []
        self._depth = 0

    def _function(self, node: ast.AST) -> None:
        self._depth += 1
        self.generic_visit(node)
        self._depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_Import(self, node: ast.Import) -> None:
        self.found.append((node, self._depth > 0))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        self.found.append((node, self._depth > 0))


def module_edges(name: str, path: Path, modules: dict[str, Path]) -> list[Edge]:
    collector = _Collector()
    collector.visit(ast.parse(path.read_text(), filename=str(path)))
    edges = []
    for node, lazy in collector.found:
        targets: list[str | None] = []
        if isinstance(node, ast.Import):
            targets = [_deepest_module(alias.name, modules) for alias in node.names]
        else:
            base = _resolve_from(node, name, is_package(path))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                targets.append(sub if sub in modules else _deepest_module(base, modules))
        for dst in dict.fromkeys(targets):  # one edge per statement and module, in order
            if dst is not None and dst != name:
                edges.append(Edge(name, dst, node.lineno, lazy))
    return edges


def build_graph(root: Path = ROOT, package: str = PACKAGE) -> Graph:
    modules = find_modules(root, package)
    if not modules:
        raise FileNotFoundError(f"no modules under {root / package}")
    graph = Graph(modules)
    for name, path in modules.items():
        graph.edges.extend(module_edges(name, path, modules))
    return graph


def strongly_connected(adj: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative), each sorted; only those that hold a cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for start in sorted(adj):
        if start in index:
            continue
        work = [(start, iter(sorted(adj[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            advanced = False
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(adj[w]))))
                    advanced = True
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1 or v in adj[v]:
                    out.append(sorted(comp))
    return sorted(out)


def _shortest_path(adj: dict[str, set[str]], src: str, dst: str, allowed: set[str]) -> list[str] | None:
    prev: dict[str, str | None] = {src: None}
    queue = deque([src])
    while queue:
        v = queue.popleft()
        if v == dst:
            path = []
            node: str | None = v
            while node is not None:
                path.append(node)
                node = prev[node]
            return path[::-1]
        for w in sorted(adj[v]):
            if w in allowed and w not in prev:
                prev[w] = v
                queue.append(w)
    return None


def find_cycles(adj: dict[str, set[str]]) -> list[list[str]]:
    """Cycles that together use every edge lying on some cycle: for each such edge u -> v, the shortest way back
    v -> ... -> u. Each is a path that starts and ends at its smallest module, [a, b, a]; duplicates dropped."""
    cycles: set[tuple[str, ...]] = set()
    for comp in strongly_connected(adj):
        members = set(comp)
        for u in comp:
            for v in sorted(adj[u] & members):
                back = _shortest_path(adj, v, u, members)
                if back is None:
                    continue
                ring = [u] + back[:-1]  # u -> v -> ... (back to u)
                k = ring.index(min(ring))
                ring = ring[k:] + ring[:k]
                cycles.add(tuple(ring + [ring[0]]))
    return [list(c) for c in sorted(cycles, key=lambda c: (len(c), c))]


def package_of(module: str, modules: dict[str, Path], package: str = PACKAGE) -> str:
    """Top-level subpackage of a module: mtpspec.bench.cli -> bench; mtpspec.types -> base; mtpspec.engine and the
    package's own __init__ -> core."""
    parts = module.split(".")
    if len(parts) >= 2 and parts[0] == package and f"{package}.{parts[1]}" in modules \
            and is_package(modules[f"{package}.{parts[1]}"]):
        return parts[1]
    return "base" if len(parts) == 2 and parts[1] in BASE_MODULES else "core"


def layer_of(pkg: str) -> int:
    for i, layer in enumerate(LAYERS):
        if pkg in layer:
            return i
    raise KeyError(f"package {pkg!r} is in no layer of LAYERS; add it there")


def package_edges(graph: Graph) -> dict[tuple[str, str], list[Edge]]:
    out: dict[tuple[str, str], list[Edge]] = {}
    for e in graph.edges:
        a, b = package_of(e.src, graph.modules), package_of(e.dst, graph.modules)
        if a != b:
            out.setdefault((a, b), []).append(e)
    return dict(sorted(out.items()))


def layer_violations(graph: Graph) -> dict[tuple[str, str], list[Edge]]:
    """Package edges that import from a higher layer, or sideways between two application packages."""
    bad = {}
    for (a, b), edges in package_edges(graph).items():
        la, lb = layer_of(a), layer_of(b)
        if lb > la or (la == lb and la == len(LAYERS) - 1):
            bad[(a, b)] = edges
    return bad


def _edge_text(e: Edge) -> str:
    return f"{e.src}:{e.line} -> {e.dst}" + (" (lazy)" if e.lazy else "")


def format_cycle(graph: Graph, cycle: list[str]) -> str:
    steps = []
    for a, b in zip(cycle, cycle[1:]):
        lines = ",".join(str(e.line) + ("L" if e.lazy else "") for e in graph.edges_between(a, b))
        steps.append(f"{a} (line {lines})")
    return " -> ".join(steps + [cycle[-1]])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--packages", action="store_true", help="collapse to top-level subpackages; list layer violations")
    parser.add_argument("--quiet", action="store_true", help="print only the cycles")
    parser.add_argument("--root", type=Path, default=ROOT, help="the directory holding mtpspec/")
    args = parser.parse_args(argv)

    graph = build_graph(args.root)
    if not args.quiet and args.packages:
        print("# package graph (package -> package: the module imports that make it up)")
        for (a, b), edges in package_edges(graph).items():
            print(f"{a} -> {b}")
            for e in edges:
                print(f"    {_edge_text(e)}")
        print("\n# layer violations (imports of a higher layer, or between application packages)")
        print("# layers, low to high: " + " < ".join("/".join(sorted(layer)) for layer in LAYERS))
        bad = layer_violations(graph)
        for (a, b), edges in bad.items():
            print(f"{a} -> {b}")
            for e in edges:
                print(f"    {_edge_text(e)}")
        if not bad:
            print("none")
        pkg_adj: dict[str, set[str]] = {}
        for a, b in package_edges(graph):
            pkg_adj.setdefault(a, set()).add(b)
            pkg_adj.setdefault(b, set())
        print("\n# package cycles (informational; each package edge on a cycle lies on one listed)")
        for c in find_cycles(pkg_adj):
            print(" -> ".join(c))
        print()
    elif not args.quiet:
        print("# module graph (module: the mtpspec modules it imports; (lazy): inside a function)")
        by_src: dict[str, dict[str, bool]] = {m: {} for m in graph.modules}
        for e in graph.edges:
            by_src[e.src][e.dst] = by_src[e.src].get(e.dst, True) and e.lazy
        for src, dsts in by_src.items():
            names = [d + (" (lazy)" if lazy else "") for d, lazy in sorted(dsts.items())]
            print(f"{src}: {', '.join(names) if names else '-'}")
        print()

    cycles = find_cycles(graph.adjacency())
    if not cycles:
        print(f"no import cycles among {len(graph.modules)} modules ({len(graph.edges)} imports)")
        return 0
    print(f"{len(cycles)} import cycle(s) (line numbers of each import; L: inside a function):")
    for c in cycles:
        print(f"  {format_cycle(graph, c)}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
