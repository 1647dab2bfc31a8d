"""Sweep of the LoRA launch settings.

    python -m fmoe2.bench.lora_settings [--out-dir misc/bench/lora]

The measurements behind ``fit_lora_config`` (``fmoe2/gemm/config.py``) and the two-stage LoRA
launch settings (``lora_kernel_options``, ``lora_expand_block_n`` in ``fmoe2/gemm/launches.py``),
on this GPU, rank 16, 4 adapters uniform over the tokens with 20% of tokens without one, bf16:

* ``fused``: at every point of this device's ``--lora`` table (``misc/bench/lora``) that runs the
  fused path at M <= 128 (at least one token with an adapter, also at M=1), the table's LoRA
  config at 4 and 8 warps x 2-4 LoRA stages (configs that do not fit shared memory are skipped),
  each with mixed adapters and with every token -1, against the plain forward, the variants
  taking turns over 5 rounds (``time_interleaved``);
* ``two_stage``: at Mixtral and DeepSeek-V2-Lite M=1024 (128-row tiles in the tuned files), the
  table's two-stage config with the LoRA kernels at several warps x stages x expand columns x
  shrink steps: the four LoRA launches each timed alone, and the whole forward.

Every setting's mixed-adapter forward is checked against the float32 reference. Writes
``<out-dir>/settings_<device>.json``.
"""
from __future__ import annotations

import argparse
import dataclasses
import contextlib
import importlib
import json
import math
import os
import sys
from unittest import mock

import torch
from triton.runtime.errors import OutOfResources

import fmoe2
from fmoe2.gemm.config import FusedMoEConfig, device_config_name
from fmoe2.shapes import SHAPES

from .lora import BF16_TOL, make_adapters, make_token_lora_ids
from .provenance import run_record
from .timing import time_in_graph, time_interleaved

# The modules whose config fit (fused_moe: the module; the attribute fmoe2.gemm.fused_moe is the function) and
# launch settings (launches) are patched below.
FUSED_MODULE = importlib.import_module("fmoe2.gemm.fused_moe")
CONFIG_MODULE = importlib.import_module("fmoe2.gemm.config")  # (the resolver fits the adapters' steps)
LAUNCHES_MODULE = importlib.import_module("fmoe2.gemm.launches")
ROUNDS = 5
# (num_warps, num_stages, expand BLOCK_N, shrink BLOCK_K) of the two-stage LoRA kernels, on the table's tiles
# (128 rows at both points in the 2026-11-24 tables; each row records its config)
TWO_STAGE_SETTINGS = [(8, 4, 64, 64), (8, 3, 64, 64), (8, 2, 64, 64), (8, 4, 128, 64), (8, 3, 128, 64),
                      (4, 4, 64, 64), (4, 3, 64, 64), (4, 2, 64, 64), (8, 3, 64, 128)]


def _point(name, M, gen):
    from .problems import make_inputs

    E, H, I, topk = SHAPES[name]
    w1 = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16, generator=gen) / math.sqrt(H)
    w2 = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16, generator=gen) / math.sqrt(I)
    lora = make_adapters(4, E, H, I, 16, gen)
    x, tw, ti = make_inputs(M, E, H, I, topk, gen)
    ids = make_token_lora_ids(M, 4, gen, 0.2)
    ref = fmoe2.fused_moe_reference(x.float(), w1.float(), w2.float(), tw, ti, lora=lora, token_lora_ids=ids)
    return dict(weights=fmoe2.prepare_weights(w1, w2), lora=fmoe2.prepare_lora(lora), x=x, tw=tw, ti=ti, ids=ids,
                ref=ref, out=torch.empty_like(x))


def _forward(point, cfg, ids="mixed"):
    """One forward on ``cfg`` as given (no LoRA fit: the caller patches ``fit_lora_config_to_problem``
    out)."""
    args = (point["x"], point["weights"], None, point["tw"], point["ti"])
    if ids is None:
        return lambda: fmoe2.fused_moe(*args, out=point["out"], config=cfg)
    lora_ids = point["ids"] if ids == "mixed" else torch.full_like(point["ids"], -1)
    return lambda: fmoe2.fused_moe(*args, out=point["out"], config=cfg, lora=point["lora"], token_lora_ids=lora_ids)


def _rel_err(point, cfg):
    out = _forward(point, cfg)().float()
    return ((out - point["ref"]).norm() / point["ref"].norm()).item()


@contextlib.contextmanager
def _patched(patch):
    """``patch`` applied, with the cached plans (which hold the unpatched settings) dropped on both sides."""
    fmoe2.clear_plan_cache()
    try:
        with patch:
            yield
    finally:
        fmoe2.clear_plan_cache()


def lora_configs_as_given():
    """Context: ``fused_moe`` runs a given LoRA config's warps and stages instead of fitting them."""
    return _patched(mock.patch.object(CONFIG_MODULE, "fit_lora_config_to_problem", lambda cfg, *_, **__: cfg))


def two_stage_lora_settings(num_warps: int, num_stages: int, expand_block_n: int, shrink_block_k: int):
    """Context: the two-stage LoRA kernels launch with these settings (see ``lora_kernel_options``)."""
    return _patched(mock.patch.multiple(LAUNCHES_MODULE, LORA_BLOCK_K=shrink_block_k,
                                        lora_kernel_options=lambda *_: {"num_warps": num_warps,
                                                                        "num_stages": num_stages},
                                        lora_expand_block_n=lambda *_: expand_block_n))


def table_rows(table_dir: str, name: str) -> list:
    """This device's ``--lora`` results for one shape (their configs are the ones swept)."""
    path = os.path.join(table_dir, f"{device_config_name()}__{name}.json")
    if not os.path.exists(path):
        raise SystemExit(f"no --lora results for this GPU at {path}: run `python -m fmoe2.bench --lora` first "
                         "(or pass --table-dir)")
    with open(path) as f:
        return json.load(f)["results"]


def sweep_fused(table_dir, gen):
    rows = []
    for name in SHAPES:
        for r in table_rows(table_dir, name):
            lora_cfg = FusedMoEConfig.from_dict(r["fmoe2_lora_config"])
            if lora_cfg.path != "fused" or r["M"] > 128:
                continue
            point = _point(name, r["M"], gen)
            fns, errs = {"plain": _forward(point, FusedMoEConfig.from_dict(r["fmoe2_config"]), ids=None)}, {}
            with lora_configs_as_given():
                for warps in (8, 4):
                    for stages in (2, 3, 4):
                        cfg = dataclasses.replace(lora_cfg, num_warps=warps, lora_num_stages=stages)
                        key = f"w{warps}s{stages}"
                        try:
                            errs[key] = _rel_err(point, cfg)
                        except OutOfResources:
                            continue
                        fns[key + "_mixed"], fns[key + "_none"] = _forward(point, cfg), _forward(point, cfg, ids="none")
                t = time_interleaved(fns, rounds=ROUNDS)
            rows.append(dict(shape=name, M=r["M"], plain_config=r["fmoe2_config"],
                             lora_config=r["fmoe2_lora_config"], times_us=t, rel_err=errs))
            print(f"{name} M={r['M']} plain {t['plain']:.1f} us, LoRA config w{lora_cfg.num_warps} "
                  f"s{lora_cfg.lora_num_stages}; mixed / none over plain: " + ", ".join(
                      f"{k} {t[k + '_mixed'] / t['plain']:.3f} / {t[k + '_none'] / t['plain']:.3f}" for k in errs),
                  flush=True)
    return rows


def sweep_two_stage(table_dir, gen):
    from .ceilings import stage_times

    rows = []
    for name in ("mixtral-8x7b", "deepseek-v2-lite"):
        r = next(r for r in table_rows(table_dir, name) if r["M"] == 1024)
        cfg = FusedMoEConfig.from_dict(r["fmoe2_lora_config"])
        if cfg.path != "two_stage":
            print(f"{name} M=1024: the table's LoRA config is not two-stage; skipped")
            continue
        point = _point(name, 1024, gen)
        for warps, stages, block_n, block_k in TWO_STAGE_SETTINGS:
            with two_stage_lora_settings(warps, stages, block_n, block_k):
                err = _rel_err(point, cfg)
                launches = stage_times(point["x"], point["weights"], point["tw"], point["ti"], cfg, point["out"],
                                       lora=point["lora"], token_lora_ids=point["ids"])
                total = time_in_graph(_forward(point, cfg))
            lora_us = sum(us for k, us in launches.items() if k.startswith("lora"))
            rows.append(dict(shape=name, M=1024, config=r["fmoe2_lora_config"], num_warps=warps, num_stages=stages,
                             expand_block_n=block_n, shrink_block_k=block_k, rel_err=err, launches_us=launches,
                             lora_launches_us=lora_us, forward_us=total))
            print(f"{name} M=1024 warps {warps} stages {stages} expand columns {block_n} shrink step {block_k}: "
                  f"LoRA launches {lora_us:.1f} us, forward {total:.1f} us", flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--out-dir", default=os.path.join("misc", "bench", "lora"))
    parser.add_argument("--table-dir", default=os.path.join("misc", "bench", "lora"),
                   help="where this device's --lora tables are (their configs are swept)")
    parser.add_argument("--seed", type=int, default=0)
    a = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the LoRA settings sweep needs a CUDA or ROCm GPU")
    gen = torch.Generator(device="cuda").manual_seed(a.seed)
    result = dict(**run_record("python -m fmoe2.bench.lora_settings", argv), rank=16, num_loras=4, rounds=ROUNDS)
    result["fused"] = sweep_fused(a.table_dir, gen)
    result["two_stage"] = sweep_two_stage(a.table_dir, gen)
    bad = [r for r in result["fused"] for e in r["rel_err"].values() if not e <= BF16_TOL]
    bad += [r for r in result["two_stage"] if not r["rel_err"] <= BF16_TOL]
    os.makedirs(a.out_dir, exist_ok=True)
    path = os.path.join(a.out_dir, f"settings_{device_config_name()}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")
    if bad:
        raise SystemExit(f"{len(bad)} variants off the reference (tolerance {BF16_TOL})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
