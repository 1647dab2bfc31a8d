"""Every config the grid of ``config_grid.py`` runs, pinned: the resolver (``fmoe2.gemm.config.resolve_config``)
and the plan build (``pick_config``) must give each entry of ``data/config_table.json`` exactly (config dict and
path run). A failure names the row and batch size; a deliberate change re-records the table
(``data/record_config_table.py``) and says so."""
import importlib
import json
import os

import pytest

from fmoe2.gemm.config import ConfigMode, ConfigProblem, resolve_config
from fmoe2.gemm.fused_moe import pick_config
from config_grid import BATCHES, GIVEN, TARGETS, meta_problem, outcome, rows

with open(os.path.join(os.path.dirname(__file__), "data", "config_table.json")) as f:
    TABLE = json.load(f)


def _expected(cell: str):
    digits = len(cell) - len(cell.lstrip("0123456789"))
    return TABLE["configs"][int(cell[:digits])], cell[digits:]


def test_the_table_covers_the_grid():
    assert TABLE["batches"] == list(BATCHES)
    assert sorted(TABLE["rows"]) == sorted("/".join(row) for row in rows())


@pytest.mark.parametrize("target_name", sorted(TARGETS))
def test_the_resolver_gives_every_recorded_config(target_name):
    target, tuned_for = TARGETS[target_name]
    wrong = []
    for row in rows():
        if row[0] != target_name:
            continue
        _, shape, mode, path, given = row
        for M, cell in zip(BATCHES, TABLE["rows"]["/".join(row)]):
            problem = meta_problem(shape, mode, M, target)
            request = ConfigProblem(M, problem.num_experts, problem.hidden_size, problem.intermediate_size,
                                    problem.topk, problem.x.dtype)
            kind = ConfigMode(problem.lora is not None, problem.fp8, problem.deterministic)
            got = outcome(problem, resolve_config(request, kind, target, GIVEN[given], path=path, tuned_for=tuned_for))
            config, ran = _expected(cell)
            if got != (config, ran):
                wrong.append(("/".join(row), M, got, (config, ran)))
    assert not wrong, f"{len(wrong)} picks changed, first: {wrong[:3]}"


def test_the_plan_build_asks_the_resolver(monkeypatch):
    # pick_config reads the tuned files of the GPU holding the tensors: named here for meta tensors.
    fused_moe_module = importlib.import_module("fmoe2.gemm.fused_moe")  # (the package's name is the function)
    for target_name in ("H200", "gfx942"):
        target, tuned_for = TARGETS[target_name]
        monkeypatch.setattr(fused_moe_module, "device_config_name", lambda device=None: tuned_for or "cpu")
        for row in rows():
            if row[0] != target_name or row[1] not in ("qwen3-30b-a3b", "odd-6x1000x520"):
                continue
            _, shape, mode, path, given = row
            for M, cell in zip(BATCHES, TABLE["rows"]["/".join(row)]):
                problem = meta_problem(shape, mode, M, target)
                assert outcome(problem, pick_config(problem, GIVEN[given], path, target)) == _expected(cell), (row, M)
