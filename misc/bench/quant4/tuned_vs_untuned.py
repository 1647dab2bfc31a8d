# Run on a GPU from the repository root: PYTHONPATH=. python misc/bench/quant4/tuned_vs_untuned.py
"""Weight-only tuned entries against the pick they replaced (the bf16 entry, fitted), same run, CUDA graphs."""
import sys, json, torch, fmoe2
from fmoe2.bench.quant4 import Weights
from fmoe2.bench.timing import time_graphs_in_turns
from fmoe2.bench.problems import rel_err
from fmoe2.gemm.config import ConfigProblem, ConfigMode, resolve_config, device_config_name
from fmoe2.target import target_of
gen = torch.Generator().manual_seed(0)
rows = []
for name in ("gpt-oss-20b", "qwen3-30b-a3b"):
    for fmt in ("mxfp4", "int4", "int8"):
        w = Weights(name, fmt, gen)
        for M in (1, 16, 128, 1024):
            p = ConfigProblem(M, w.E, w.H, w.I, w.topk, torch.bfloat16)
            t = target_of(); dev = device_config_name()
            tuned = resolve_config(p, ConfigMode(weight_format=fmt), t, tuned_for=dev)
            old = resolve_config(p, ConfigMode(weight_format=fmt), t, resolve_config(p, ConfigMode(), t, tuned_for=dev), tuned_for=dev)
            x = torch.randn(M, w.H, generator=gen).to("cuda", torch.bfloat16)
            tw, ti = torch.topk(torch.randn(M, w.E, generator=gen).softmax(-1), w.topk, dim=-1)
            tw, ti = tw.cuda(), ti.to("cuda", torch.int32)
            out = torch.empty_like(x)
            ref = fmoe2.fused_moe_reference(x, w.packed, None, tw, ti).float()
            fns = {"tuned": lambda: fmoe2.fused_moe(x, w.packed, None, tw, ti, out=out),
                   "old": lambda c=old: fmoe2.fused_moe(x, w.packed, None, tw, ti, config=c, out=out)}
            errs = {}
            for k, f in fns.items():
                out.fill_(float("nan")); errs[k] = rel_err(f().float(), ref)
            tm = time_graphs_in_turns(fns, 3, 10, 15)
            same = tuned == old
            print(f"{name:14s} {fmt:5s} M={M:5d} tuned {tm['tuned']:8.1f} old {tm['old']:8.1f} x{tm['old']/tm['tuned']:.2f}"
                  f" err {errs['tuned']:.1e}/{errs['old']:.1e} {'same' if same else ''}", flush=True)
            rows.append(dict(shape=name, fmt=fmt, M=M, us=tm, err=errs, tuned=tuned.to_dict(), old=old.to_dict()))
        del w; torch.cuda.empty_cache()
import os; json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "tvd.json"), "w"), indent=1)
