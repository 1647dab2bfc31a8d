"""Writes ``config_table.json``: the config and path each forward of the grid (``tests/gemm/config_grid.py``)
runs, as picked by ``fused_moe``'s plan build.

    python tests/gemm/data/record_config_table.py

The table pins behaviour: rerun this only for a deliberate change of a pick, and say which entries changed.
First recorded with the code of f6d48c7 (``pick_config`` of ``fmoe2/gemm/fused_moe.py``, the device read
through patched ``target_of`` / ``device_config_name``)."""
import json
import os
import sys
from unittest import mock

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import fmoe2.gemm.config as config_module  # noqa: E402
from fmoe2.gemm.fused_moe import pick_config  # noqa: E402
from config_grid import BATCHES, GIVEN, TARGETS, meta_problem, outcome, rows  # noqa: E402


def pick(target_name, shape, mode, path, given, M):
    target, tuned_name = TARGETS[target_name]
    problem = meta_problem(shape, mode, M, target)
    with mock.patch.object(config_module, "target_of", lambda device=None: target), \
            mock.patch.object(config_module, "current_backend", lambda: target.backend), \
            mock.patch.object(config_module, "device_config_name", lambda device=None: tuned_name or "cpu"):
        return outcome(problem, pick_config(problem, GIVEN[given], path, target))


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
