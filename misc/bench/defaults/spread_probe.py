"""Why one config timed under two labels comes out up to 8% apart at M=4096 (LOSO runs of 2026-11-29): time the
tuned entry as `auto` and as an explicit config under three more labels, in several capture orders, with the GPU's
clocks and power logged, and whether `auto` and the given config make the same plan. Usage, from the repository root:
PYTHONPATH=. python misc/bench/defaults/spread_probe.py gpt-oss-120b 4096 [rounds]. Output of 2026-11-30:
spread_probe_2026-11-30.txt (docs/configs.md, leave-one-shape-out). That output was taken with main bd7e029's
`time_graphs_in_turns`, which captured each graph once per call (one capture per label and order: a capture's own time
showed as one label apart in one order and another in the next); it now captures again every round, so a rerun
averages the captures."""
import subprocess
import sys
import time

import torch

import fmoe2
from fmoe2.bench.defaults import routed_inputs, shape_data
from fmoe2.bench.timing import time_graphs_in_turns
from fmoe2.gemm.fused_moe import plan_of

name, M = sys.argv[1], int(sys.argv[2])
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 4
gen = torch.Generator(device="cuda").manual_seed(0)
data = shape_data(name, "bf16", gen)
x, tw, ti = routed_inputs(M, data.E, data.H, data.topk, "uniform", gen)
out = torch.empty_like(x)
run = lambda cfg: (lambda: fmoe2.fused_moe(x, data.prepared, None, tw, ti, out=out, config=cfg, **data.options))  # noqa
run(None)()
pa = plan_of(x, data.prepared, None, tw, ti, out=out, **data.options)
cfg = pa.config
run(cfg)()
pc = plan_of(x, data.prepared, None, tw, ti, out=out, config=cfg, **data.options)
print(name, M, "same config:", pa.config == pc.config, "same plan:", pa is pc, "launches", pa.launch_names, pc.launch_names,
      "scratch", pa.scratch_bytes, pc.scratch_bytes, "chunk", pa.chunk_size, pc.chunk_size, flush=True)
if pa.config != pc.config:
    print({k: (getattr(pa.config, k), getattr(pc.config, k)) for k in pa.config.__dataclass_fields__
           if getattr(pa.config, k) != getattr(pc.config, k)})
log = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu",
                        "--format=csv,noheader", "-lms", "200"], stdout=subprocess.PIPE, text=True)
orders = {"auto first": ["auto", "cfg1", "cfg2", "cfg3"], "auto last": ["cfg1", "cfg2", "cfg3", "auto"],
          "auto middle": ["cfg1", "auto", "cfg2", "cfg3"]}
for title, order in orders.items():
    fns = {label: run(None if label == "auto" else cfg) for label in order}
    heavy = M * data.topk * data.H * data.I > 2 ** 36
    t = time_graphs_in_turns(fns, rounds, 3 if heavy else 10, 6 if heavy else 15)
    print(f"{title:12s} " + "  ".join(f"{k} {v:8.1f}" for k, v in t.items()) + f"  spread {max(t.values()) / min(t.values()):.3f}", flush=True)
    time.sleep(1)
log.terminate()
samples = [line.strip() for line in log.stdout.read().splitlines() if line.strip()]
print(f"{len(samples)} clock samples; first, middle, last:", samples[:1], samples[len(samples) // 2:len(samples) // 2 + 1], samples[-1:])
