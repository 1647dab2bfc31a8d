"""The import layers of fmoe2 (issue 45, item 4): every module of ``fmoe2/`` sits on one floor, and imports only
from its own floor or the floors below, with no cycle among them, read from the source (``ast``: imports inside
functions count too, since they hold a cycle together as firmly as those at the top).

``fmoe2/bench/`` sits on the top floor with the tools (nothing below may import it), and its modules form no cycle
either: its shared helpers live in ``problems.py``, ``ceilings.py`` and ``timing.py``, not in its ``__main__``
(issue 57: the tuner and ten benchmark modules imported ``bench.__main__``, which imports them back).
"""
import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "fmoe2")

# Lowest first. A module's floor is that of the longest prefix of its dotted name listed here.
FLOORS = [
    # 0: facts and machinery every layer reads: the activation table, the weight formats' registry, fp8 constants
    #    and quantization, the 4-bit and int8 formats, argument checks, targets, launch binding and buffers, the
    #    deterministic switch, named shapes.
    ("facts", ["fmoe2.activations", "fmoe2.formats", "fmoe2.fp8", "fmoe2.quant4", "fmoe2.int8", "fmoe2._validation",
               "fmoe2.target", "fmoe2.launch", "fmoe2.buffers", "fmoe2.grid_dependency", "fmoe2.determinism",
               "fmoe2.shapes"]),
    # 1: routing -> expert-major tiles (its sort keys are read by the gemm kernels).
    ("sorting", ["fmoe2.sorting"]),
    # 2: weights' layouts, configs, kernels, launches, plans and the eager fused_moe.
    ("gemm", ["fmoe2.gemm"]),
    # 3: what users import: the package, the torch.library ops, the references, the integrations.
    ("api", ["fmoe2", "fmoe2.ops", "fmoe2.reference", "fmoe2.integrations"]),
    # 4: tools run from the command line (the benchmark's helpers among them).
    ("tools", ["fmoe2.codegen", "fmoe2.tune", "fmoe2.__main__", "fmoe2.bench"]),
]


def module_name(path):
    """``fmoe2/gemm/plan.py`` -> ``fmoe2.gemm.plan``; a package's ``__init__.py`` -> the package."""
    parts = os.path.splitext(os.path.relpath(path, ROOT))[0].split(os.sep)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules():
    """``{dotted name: file path}`` of every module under ``fmoe2/``, bench included."""
    found = {}
    for folder, _, files in os.walk(PACKAGE):
        for f in files:
            if f.endswith(".py"):
                found[module_name(os.path.join(folder, f))] = os.path.join(folder, f)
    return found


def imported_modules(name, path, modules):
    """The fmoe2 modules that ``name`` (at ``path``) imports, anywhere in its body: a ``from X import y`` counts as
    ``X.y`` where that is a module, else as ``X``."""
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    targets = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            source = node.module if not node.level else ".".join(p for p in (base, node.module) if p)
            for a in node.names:
                targets.add(f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source)
    return {t for t in targets if t == "fmoe2" or t.startswith("fmoe2.")}


def floor_of(name):
    """The index in :data:`FLOORS` of the longest listed prefix of ``name``; None if none is listed."""
    best, floor = -1, None
    for i, (_, prefixes) in enumerate(FLOORS):
        for p in prefixes:
            if (name == p or name.startswith(p + ".")) and len(p) > best:
                best, floor = len(p), i
    return floor


def import_graph(modules):
    """``{module: imported fmoe2 modules}`` of every module of ``modules``."""
    return {n: imported_modules(n, p, modules) for n, p in modules.items()}


def upward_imports(graph):
    """``"a (floor) -> b (floor)"`` for each import of a module on a higher floor."""
    return sorted(f"{a} ({FLOORS[floor_of(a)][0]}) -> {b} ({FLOORS[floor_of(b)][0]})"
                  for a, targets in graph.items() for b in targets if floor_of(b) > floor_of(a))


def import_cycles(graph):
    """The cycles of ``graph`` (one per strongly connected component of two or more modules, or a module
    importing itself), each as a sorted list of its modules (Tarjan's algorithm, iterative)."""
    index, low, stack, on_stack, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(root):
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
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
                if len(component) > 1 or node in graph.get(node, ()):
                    cycles.append(sorted(component))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return cycles


@pytest.fixture(scope="module")
def graph():
    return import_graph(package_modules())


def test_every_module_has_a_floor(graph):
    unplaced = sorted(n for n in graph if floor_of(n) is None)
    assert not unplaced, f"add these modules to FLOORS in tests/test_layers.py: {unplaced}"


def test_no_upward_import(graph):
    upward = upward_imports(graph)
    assert not upward, "imports from a higher floor:\n" + "\n".join(upward)


def test_no_import_cycle(graph):
    cycles = import_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_checks_catch_what_they_guard(tmp_path):
    """The reader and the checks on a made-up package: an upward import inside a function, a cycle through a
    relative import, and a package import."""
    fake = {"fmoe2.fp8": "def f():\n    from .gemm.plan import x\n",
            "fmoe2.gemm.plan": "from . import layout\n",
            "fmoe2.gemm.layout": "import fmoe2.gemm.plan\n"}
    modules = {}
    for name, text in fake.items():
        path = tmp_path / (name.replace(".", "_") + ".py")
        path.write_text(text)
        modules[name] = str(path)
    graph = {n: imported_modules(n, p, modules) for n, p in modules.items()}
    assert graph == {"fmoe2.fp8": {"fmoe2.gemm.plan"}, "fmoe2.gemm.plan": {"fmoe2.gemm.layout"},
                     "fmoe2.gemm.layout": {"fmoe2.gemm.plan"}}
    assert upward_imports(graph) == ["fmoe2.fp8 (facts) -> fmoe2.gemm.plan (gemm)"]
    assert import_cycles(graph) == [["fmoe2.gemm.layout", "fmoe2.gemm.plan"]]
    assert floor_of("fmoe2.bench.graph_ab") == len(FLOORS) - 1 and floor_of("fmoe2.gemm") == 2


def test_activation_table_matches_the_host_checks():
    """The table's properties are what ``fused_moe``'s argument check enforces: only the names listed, the limit
    only where ``takes_limit``, the alpha passed on only where ``reads_alpha``."""
    from fmoe2.activations import ACTIVATION_TABLE, ACTIVATIONS, SWIGLU_ALPHA
    from fmoe2.gemm.fused_moe import check_activation_args
    from fmoe2.reference import ACTIVATIONS as REFERENCE_ACTIVATIONS

    assert ACTIVATIONS == REFERENCE_ACTIVATIONS == tuple(ACTIVATION_TABLE)
    for name, entry in ACTIVATION_TABLE.items():
        alpha, _ = check_activation_args(name, 1.5, None)
        assert alpha == (1.5 if entry.reads_alpha else SWIGLU_ALPHA), name
        if entry.takes_limit:
            assert check_activation_args(name, 1.5, 7.0)[1] == 7.0
        else:
            with pytest.raises(ValueError, match="swiglu_limit"):
                check_activation_args(name, 1.5, 7.0)
    with pytest.raises(ValueError, match="activation must be one of"):
        check_activation_args("relu", SWIGLU_ALPHA, None)
