"""Writes ``config_table.json``: the config and path each forward of the grid (``tests/gemm/config_grid.py``)
runs, as picked by ``fused_moe``'s plan build.

    python tests/gemm/data/record_config_table.py

The table pins behaviour: rerun this only for a deliberate change of a pick, and say which entries changed.
First recorded with the code of f6d48c7 (its ``pick_config`` of ``fmoe2/gemm/fused_moe.py``, the device read
through patched ``target_of`` / ``current_backend`` / ``device_config_name``); since then it asks
``resolve_config``, which every caller asks."""
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(HERE))))  # this checkout's fmoe2, not an installed one

from fmoe2.gemm.config import ConfigMode, ConfigProblem, resolve_config  # noqa: E402
from config_grid import BATCHES, GIVEN, TARGETS, meta_problem, outcome, rows  # noqa: E402


def pick(target_name, shape, mode, path, given, M):
    target, tuned_name = TARGETS[target_name]
    problem = meta_problem(shape, mode, M, target)
    request = ConfigProblem(M, problem.num_experts, problem.hidden_size, problem.intermediate_size, problem.topk,
                            problem.x.dtype)
    kind = ConfigMode(problem.lora is not None, problem.fp8, problem.deterministic)
    return outcome(problem, resolve_config(request, kind, target, GIVEN[given], path=path, tuned_for=tuned_name))


def main():
    configs, index, table = [], {}, {}
    for row in rows():
        cells = []
        for M in BATCHES:
            cfg, ran = pick(*row, M)
            key = json.dumps(cfg, sort_keys=True)
            if key not in index:
                index[key] = len(configs)
                configs.append(cfg)
            cells.append(f"{index[key]}{ran}")
        table["/".join(row)] = cells
    with open(os.path.join(HERE, "config_table.json"), "w") as f:
        # One config and one row a line: small diffs when a pick changes.
        f.write('{"batches": %s,\n"configs": [\n' % json.dumps(list(BATCHES)))
        f.write(",\n".join(json.dumps(c, sort_keys=True) for c in configs))
        f.write('\n],\n"rows": {\n')
        f.write(",\n".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in table.items()))
        f.write("\n}}\n")
    print(f"{len(table)} rows, {len(configs)} configs")


if __name__ == "__main__":
    main()
