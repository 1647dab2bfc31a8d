"""The shape of the code the GEMM-core redesign (issue 45) promised, read from the source.

* every entry kernel (a ``@triton.jit`` function named ``*_kernel`` in ``fmoe2/`` outside the benchmark, whose
  host-cost probe takes arguments on purpose) reads each parameter it takes: what a launch does not use, it does
  not take;
* the plain 16-bit fused entry kernel takes at most 40 parameters (constexprs included); every entry at most 48 and
  every helper at most 24 (issue 57);
* no function in ``fmoe2/`` outside ``fmoe2/bench/`` is longer than 150 lines;
* the benchmark's gathered-GEMM modes are in no product kernel;
* no call of a ``@triton.jit`` function passes a literal (``True``, ``None``, ``16``) positionally: a flag says
  its name at the call (``WITH_LORA=False``), so a reader need not count parameters (issue 57).
"""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "fmoe2"
MAX_FUNCTION_LINES = 150
MAX_PLAIN_FUSED_PARAMETERS = 40


def _modules(include_bench: bool):
    for path in sorted(ROOT.rglob("*.py")):
        if include_bench or "bench" not in path.relative_to(ROOT).parts:
            yield path, ast.parse(path.read_text())


def _is_jit(node: ast.FunctionDef) -> bool:
    return any("jit" in ast.unparse(d) for d in node.decorator_list)


def _entry_kernels(include_bench: bool = True):
    for path, tree in _modules(include_bench):
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and _is_jit(node) and node.name.endswith("_kernel"):
                yield path, node


def test_there_are_entry_kernels_to_check():
    names = {node.name for _, node in _entry_kernels()}
    assert {"_fused_kernel", "_fused_cast_kernel", "_stage1_kernel", "_stage2_kernel", "_combine_slots_kernel",
            "_cast_rows_kernel", "_moe_sorting_kernel"} <= names


@pytest.mark.parametrize("path,node", list(_entry_kernels(include_bench=False)), ids=lambda v: getattr(v, "name", ""))
def test_each_entry_kernel_reads_every_parameter_it_takes(path, node):
    read = {n.id for stmt in node.body for n in ast.walk(stmt) if isinstance(n, ast.Name)}
    unread = [a.arg for a in node.args.args if a.arg not in read]
    assert not unread, f"{path.name}:{node.name} takes {unread} and never reads them"


def test_the_plain_fused_entry_kernel_stays_small():
    (node,) = [n for _, n in _entry_kernels() if n.name == "_fused_kernel"]
    assert len(node.args.args) <= MAX_PLAIN_FUSED_PARAMETERS


def test_no_function_outside_the_benchmark_is_longer_than_150_lines():
    long = [f"{path.relative_to(ROOT)}:{node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path, tree in _modules(include_bench=False) for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, long


def test_no_product_kernel_keeps_a_benchmark_mode():
    # The vLLM-style baseline's gathered A, row divisor and routed-weight multiply live in fmoe2/bench/.
    for path, node in _entry_kernels(include_bench=False):
        names = {a.arg for a in node.args.args}
        assert not names & {"GATHER_A", "A_ROW_DIVISOR", "MUL_ROUTED_WEIGHT"}, (path.name, node.name)


def _jit_functions():
    return {node.name for _, tree in _modules(include_bench=True) for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef) and _is_jit(node)}


def test_no_jit_call_passes_a_literal_flag_positionally():
    jit = _jit_functions()
    found = [f"{path.relative_to(ROOT)}:{node.lineno} {node.func.id}({', '.join(map(ast.unparse, literal))})"
             for path, tree in _modules(include_bench=True) for node in ast.walk(tree)
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in jit
             for literal in [[a for a in node.args if isinstance(a, ast.Constant)
                              and (a.value is None or isinstance(a.value, (bool, int)))]] if literal]
    assert not found, found


MAX_ENTRY_PARAMETERS = 48
MAX_HELPER_PARAMETERS = 24


def _product_jit_functions():
    for path, tree in _modules(include_bench=False):
        for node in ast.walk(tree):  # (nested ones too: grid_dependency.py defines its helpers under an if)
            if isinstance(node, ast.FunctionDef) and _is_jit(node):
                yield path, node


def test_jit_functions_take_at_most_the_capped_parameters():
    """Entries (``*_kernel``) at most 48 parameters, helpers at most 24 (constexprs included): an entry bundles its
    operands (``fmoe2/gemm/bundles.py``: weights, adapters and the sort's x quantization travel as NamedTuples)."""
    over = {}
    for path, node in _product_jit_functions():
        cap = MAX_ENTRY_PARAMETERS if node.name.endswith("_kernel") else MAX_HELPER_PARAMETERS
        if len(node.args.args) > cap:
            over[f"{path.relative_to(ROOT)}:{node.name}"] = len(node.args.args)
    assert not over, over
