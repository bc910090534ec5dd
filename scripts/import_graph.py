"""The import graph of mtpspec, read with `ast` (nothing imported); exits 1 on an import cycle or a layer violation.

Every import statement counts, a function-level (lazy) one too: it moves when the dependency is paid, not whether it
exists. `from a import x` depends on a.x when that is a module, else on a; relative imports resolve as Python does;
parent packages initialised on the way are not edges; `importlib.import_module("...")` strings are not counted.
    python scripts/import_graph.py [--packages] [--quiet] [--root DIR]
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Files directly under mtpspec/ are `base` (the vocabulary every layer builds on) or else `core` (the engine side).
BASE_MODULES = {"types", "errors", "cache", "sampling", "tree", "heap", "config", "threads", "metrics", "adaptive", "verify",
                "weight_cache", "device"}
# Lower layers first: an import goes to its own layer or a lower one, never between two application packages.
LAYERS: list[set[str]] = [{"base", "kernels"}, {"models"}, {"loading", "drafters"}, {"core"}, {"train", "bench", "viz", "server"}]


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    line: int
    lazy: bool  # inside a function body


@dataclass
class Graph:
    modules: dict[str, Path]  # dotted name -> file
    edges: list[Edge] = field(default_factory=list)

    def adjacency(self) -> dict[str, set[str]]:
        adj: dict[str, set[str]] = {m: set() for m in self.modules}
        for e in self.edges:
            adj[e.src].add(e.dst)
        return adj


def _imports(tree: ast.AST, lazy: bool = False):
    """(import node, inside a function) for every import statement under `tree`."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, lazy
        yield from _imports(node, lazy or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))


def build_graph(root: Path = ROOT) -> Graph:
    files = sorted((root / "mtpspec").rglob("*.py"))
    names = [".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__") for p in files]
    graph = Graph(dict(zip(names, files)))

    def deepest(name: str) -> str | None:
        parts = name.split(".")
        while parts and ".".join(parts) not in graph.modules:
            parts.pop()
        return ".".join(parts) or None

    for name, path in graph.modules.items():
        for node, lazy in _imports(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                dsts = [deepest(a.name) for a in node.names]
            else:
                pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = ".".join(pkg[: len(pkg) - node.level + 1] + [node.module or ""]).strip(".") if node.level else node.module
                dsts = [f"{base}.{a.name}" if f"{base}.{a.name}" in graph.modules else deepest(base) for a in node.names]
            graph.edges += [Edge(name, d, node.lineno, lazy) for d in dict.fromkeys(dsts) if d is not None and d != name]
    return graph


def find_cycles(adj: dict[str, set[str]]) -> list[list[str]]:
    """For every edge u -> v on a cycle, the shortest way back v -> ... -> u, as [a, ..., a] from its smallest node."""
    cycles = set()
    for u in sorted(adj):
        for v in sorted(adj[u]):
            prev, queue = {v: None}, deque([v])
            while queue and u not in prev:
                x = queue.popleft()
                for w in sorted(adj.get(x, ())):
                    if w not in prev:
                        prev[w] = x
                        queue.append(w)
            if u in prev:
                path, x = [], u
                while x is not None:
                    path.append(x)
                    x = prev[x]
                ring = [u] + path[::-1][:-1]  # u -> v -> ... (back to u)
                k = ring.index(min(ring))
                cycles.add(tuple(ring[k:] + ring[:k] + [min(ring)]))
    return [list(c) for c in sorted(cycles, key=lambda c: (len(c), c))]


def package_of(module: str, modules: dict[str, Path]) -> str:
    """mtpspec.bench.cli -> bench; mtpspec.types -> base; mtpspec.engine and the root package -> core."""
    parts = module.split(".")
    if len(parts) >= 2 and modules.get(f"mtpspec.{parts[1]}", Path()).name == "__init__.py":
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
    top = len(LAYERS) - 1
    return {(a, b): es for (a, b), es in package_edges(graph).items() if layer_of(b) > layer_of(a) or layer_of(a) == layer_of(b) == top}


def _edge_text(e: Edge) -> str:
    return f"{e.src}:{e.line} -> {e.dst}" + (" (lazy)" if e.lazy else "")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--packages", action="store_true", help="the graph of top-level subpackages, with the imports that make it")
    p.add_argument("--quiet", action="store_true", help="print only cycles and layer violations")
    p.add_argument("--root", type=Path, default=ROOT, help="the directory holding mtpspec/")
    args = p.parse_args(argv)
    graph = build_graph(args.root)
    if args.packages and not args.quiet:
        print("# package graph (package -> package: the module imports that make it up)")
        for (a, b), edges in package_edges(graph).items():
            print(f"{a} -> {b}\n" + "".join(f"    {_edge_text(e)}\n" for e in edges), end="")
    elif not args.quiet:
        print("# module graph (module: the mtpspec modules it imports; (lazy): inside a function)")
        for m, dsts in graph.adjacency().items():
            lazy = {d: all(e.lazy for e in graph.edges if e.src == m and e.dst == d) for d in dsts}
            print(f"{m}: " + (", ".join(d + " (lazy)" * lazy[d] for d in sorted(dsts)) or "-"))
    bad = layer_violations(graph)
    print("\n# layer violations (layers, low to high: " + " < ".join("/".join(sorted(x)) for x in LAYERS) + ")")
    print("\n".join(_edge_text(e) for es in bad.values() for e in es) or "none")
    cycles = find_cycles(graph.adjacency())
    if not cycles:
        print(f"no import cycles among {len(graph.modules)} modules ({len(graph.edges)} imports)")
        return 1 if bad else 0
    print(f"{len(cycles)} import cycle(s) (line numbers of each import; L: inside a function):")
    for c in cycles:
        steps = [f"{a} (line {','.join(str(e.line) + 'L' * e.lazy for e in graph.edges if (e.src, e.dst) == (a, b))})"
                 for a, b in zip(c, c[1:])]
        print("  " + " -> ".join(steps + [c[-1]]))
    return 1


if __name__ == "__main__":
    sys.exit(main())
