"""scripts/import_graph.py: mtpspec has no import cycles (function-level imports counted), no import against the
package layers and no cycle between packages, and the script resolves the import forms it claims to and names a
cycle as a path."""

import importlib.util
import sys
from pathlib import Path

spec = importlib.util.spec_from_file_location("import_graph", Path(__file__).parents[1] / "scripts" / "import_graph.py")
graph_mod = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = graph_mod  # its dataclasses look their module up there
spec.loader.exec_module(graph_mod)


def test_mtpspec_has_no_import_cycles(capsys):
    code = graph_mod.main(["--quiet"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "no import cycles" in out


def test_the_package_view_runs_and_every_package_has_a_layer(capsys):
    graph = graph_mod.build_graph()
    for a, b in graph_mod.package_edges(graph):  # raises KeyError naming a package that is in no layer
        graph_mod.layer_of(a), graph_mod.layer_of(b)
    assert graph_mod.main(["--packages"]) == 0
    assert "# layer violations" in capsys.readouterr().out


# Module imports that still go against the layers, each with why it stays. Every one must still exist (a fixed one is
# deleted here), and nothing else may go against them.
LAYER_EXCEPTIONS: frozenset = frozenset()


def test_no_import_goes_against_the_layers():
    graph = graph_mod.build_graph()
    bad = [e for edges in graph_mod.layer_violations(graph).values() for e in edges]
    unexpected = [graph_mod._edge_text(e) for e in bad if (e.src, e.dst) not in LAYER_EXCEPTIONS]
    assert not unexpected, ("imports of a higher layer or between application packages (move the shared piece down "
                            "to the layer both can import; see LAYERS in scripts/import_graph.py):\n" + "\n".join(unexpected))
    stale = LAYER_EXCEPTIONS - {(e.src, e.dst) for e in bad}
    assert not stale, f"listed in LAYER_EXCEPTIONS but no longer against the layers (delete them there): {sorted(stale)}"


def test_no_cycle_between_packages():
    graph = graph_mod.build_graph()
    adj: dict[str, set[str]] = {}
    for (a, b), edges in graph_mod.package_edges(graph).items():
        adj.setdefault(a, set()), adj.setdefault(b, set())
        if any((e.src, e.dst) not in LAYER_EXCEPTIONS for e in edges):  # an edge made only of exceptions is left out
            adj[a].add(b)
    cycles = graph_mod.find_cycles(adj)
    assert cycles == [], "package cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_a_layer_violation_and_a_package_cycle_are_found(tmp_path):
    root = _tree(tmp_path, {
        "__init__.py": "",
        "models/__init__.py": "",
        "models/a.py": "def f():\n    from ..drafters import b\n",  # models -> drafters: up a layer (lazy counts)
        "drafters/__init__.py": "",
        "drafters/b.py": "from ..models import a\n",
        "bench/__init__.py": "",
        "bench/x.py": "from ..train import y\n",  # sideways between application packages
        "train/__init__.py": "",
        "train/y.py": "",
    })
    graph = graph_mod.build_graph(root)
    bad = graph_mod.layer_violations(graph)
    assert sorted(bad) == [("bench", "train"), ("models", "drafters")]
    assert [(e.src, e.dst, e.lazy) for e in bad[("models", "drafters")]] == [("mtpspec.models.a", "mtpspec.drafters.b", True)]
    adj = {}
    for a, b in graph_mod.package_edges(graph):
        adj.setdefault(a, set()).add(b)
        adj.setdefault(b, set())
    assert graph_mod.find_cycles(adj) == [["drafters", "models", "drafters"]]
    sideways = _tree(tmp_path / "v", {"__init__.py": "", "bench/__init__.py": "", "bench/x.py": "from ..train import y\n",
                                      "train/__init__.py": "", "train/y.py": ""})
    assert graph_mod.main(["--quiet", "--root", str(sideways)]) == 1  # a layer violation alone fails the script


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / "mtpspec" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_relative_lazy_and_submodule_imports_resolve(tmp_path):
    root = _tree(tmp_path, {
        "__init__.py": "",
        "types.py": "",
        "models/__init__.py": "from . import common\n",  # from . import <submodule>
        "models/common.py": "from ..types import X\n",  # relative, two dots: a name in a module
        "bench/__init__.py": "",
        "bench/cli.py": "def run():\n    from .batch import go\n",  # lazy
        "bench/batch.py": "import mtpspec.models.common\nfrom mtpspec import types\n",  # absolute, dotted; from a package
    })
    graph = graph_mod.build_graph(root)
    edges = {(e.src, e.dst, e.lazy) for e in graph.edges}
    assert edges == {
        ("mtpspec.models", "mtpspec.models.common", False),
        ("mtpspec.models.common", "mtpspec.types", False),
        ("mtpspec.bench.cli", "mtpspec.bench.batch", True),
        ("mtpspec.bench.batch", "mtpspec.models.common", False),
        ("mtpspec.bench.batch", "mtpspec.types", False),
    }
    assert graph_mod.find_cycles(graph.adjacency()) == []


def test_a_cycle_through_a_lazy_import_is_named_as_a_path(tmp_path, capsys):
    root = _tree(tmp_path, {
        "__init__.py": "",
        "a.py": "from .b import f\n",
        "b.py": "from .c import g\n",
        "c.py": "def g():\n    from . import a\n",
        "d.py": "from . import e\n",
        "e.py": "import mtpspec.d\n",
    })
    assert graph_mod.find_cycles(graph_mod.build_graph(root).adjacency()) == [
        ["mtpspec.d", "mtpspec.e", "mtpspec.d"],
        ["mtpspec.a", "mtpspec.b", "mtpspec.c", "mtpspec.a"],
    ]
    assert graph_mod.main(["--quiet", "--root", str(root)]) == 1
    out = capsys.readouterr().out
    assert "2 import cycle(s)" in out
    assert "mtpspec.a (line 1) -> mtpspec.b (line 1) -> mtpspec.c (line 2L) -> mtpspec.a" in out
