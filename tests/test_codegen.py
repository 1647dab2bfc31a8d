"""Compile tests: ``python -m fmoe2.codegen`` (or a script) in the compile child (``compile_child.py``: no
interpreter, no visible GPU, so the configs compiled are the shipped defaults on every machine), no GPU needed."""
import json

import pytest
from compile_child import run_codegen, run_script


# ``python -m fmoe2.codegen`` compiling only the launches named in KERNELS; each other launch is reported by name, M and
# config alone (the launches are fmoe2.codegen's own, looked up by codegen_report at each call).
SOME_KERNELS = """
import json
import fmoe2.codegen as codegen

every_launch = codegen.codegen_launches


def some_launches(named, shape, M, *args):
    launches = every_launch(named, shape, M, *args)
    for launch in launches:
        if launch.kernel not in KERNELS:
            config = {} if launch.config is None else {"config": launch.config.to_dict()}
            print(json.dumps({"kernel": launch.kernel, "M": M, **config}))
    return [launch for launch in launches if launch.kernel in KERNELS]


codegen.codegen_launches = some_launches
try:  # (the compile child serves the next requests with the module as it was)
    raise SystemExit(codegen.main(ARGV))
finally:
    codegen.codegen_launches = every_launch
"""


def codegen(target, shape="mixtral-8x7b", ms="1,4096", *flags, kernels=None):
    """The reports by (kernel, M). ``kernels``: the report names of the launches to compile, the others reported
    uncompiled (SOME_KERNELS): a test then pays for the kernels it reads, not for every launch of the forwards (the
    sorts, and the other path's launches, were half the cold compile time of the LoRA tests)."""
    argv = ["--target", target, "--shape", shape, "--m", ms, *flags]
    if kernels is None:
        proc = run_codegen(argv)
    else:
        proc = run_script(f"ARGV, KERNELS = {argv!r}, {set(kernels)!r}\n" + SOME_KERNELS)
    assert proc.returncode == 0, proc.stderr[-4000:]
    reports = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert reports, proc.stdout
    return {(r["kernel"], r["M"]): r for r in reports}


MAX_WEIGHT_ONLY_DECODE_SPILLS = 8  # the one-launch decode of weight-only formats on sm_90 with Triton 3.6
MAX_LORA_SPILLS = 32  # Triton 3.6: 30 for the tuned H200 Mixtral M=1024 config (BLOCK_M=64); Triton 3.9: 4


def no_spills(r):
    if "registers" in r:  # CUDA
        return r["spill_instructions"] == 0 and r["local_memory_bytes"] == 0
    return r["vgpr_spills"] == 0 and r["scratch_bytes"] == 0


@pytest.mark.parametrize("shape", ["mixtral-8x7b", "qwen3-30b-a3b"])
def test_sm90_wgmma_native_vector_atomics_no_spills(shape):
    r = codegen("sm_90", shape, "1,4096")
    assert r[("fused_moe", 4096)]["wgmma"], r[("fused_moe", 4096)]["matrix_instructions"]
    for key, rep in r.items():
        assert no_spills(rep), (key, rep)
        # (the SASS instruction count: every matrix instruction is one of them)
        assert rep["instructions"] > sum(rep["matrix_instructions"].values()) + rep["spill_instructions"], key
    assert ("moe_stage2", 4096) in r  # large batches use the two-stage path by default
    for (kernel, _), rep in r.items():
        if kernel not in ("fused_moe", "moe_stage2"):
            continue
        assert rep["atomic_instructions"] and not rep["cas_loop"], rep["atomic_instructions"]
        # The fused path adds into its float32 accumulator (accumulates_fp32), stage 2 into the bf16 output.
        width = "F32x4" if kernel == "fused_moe" else "BF16x"
        adds = {op: n for op, n in rep["atomic_instructions"].items() if op.startswith("RED")}
        assert adds and all(width in op for op in adds), (kernel, rep["atomic_instructions"])
        # The fused kernel's one integer atomic per program at M=1: the add counter of the rows it casts.
        others = {op: n for op, n in rep["atomic_instructions"].items() if op not in adds}
        casts = kernel == "fused_moe" and rep["M"] == 1
        assert others == ({"ATOMG.E.ADD.STRONG.GPU": 1} if casts else {}), (kernel, others)
        assert rep["registers"] <= 255
    # At M=1 the fused kernel casts its accumulator itself; at 4096 a cast launch follows it.
    assert ("cast", 1) not in r and not r[("cast", 4096)]["atomic_instructions"]
    # The K loops' pointer loads go through the software pipeline (cp.async into shared memory)
    assert r[("fused_moe", 1)]["async_copies"] >= 16 and r[("fused_moe_decode", 1)]["async_copies"] >= 16


@pytest.mark.parametrize("target", ["gfx942", "gfx950"])
def test_rocm_mfma_native_bf16_atomics_no_spills(target):
    r = codegen(target, "mixtral-8x7b", "1,4096")
    for key, rep in r.items():
        assert no_spills(rep), (key, rep)
        assert rep["lds_bytes"] <= (64 if target == "gfx942" else 160) * 1024
    for (kernel, M), rep in r.items():
        if kernel in ("moe_sorting", "cast"):
            continue
        assert rep["mfma"], rep
        if kernel != "fused_moe_stage1":
            assert rep["atomic_instructions"] and not rep["cas_loop"]
            # The fused path adds into its float32 accumulator (accumulates_fp32), stage 2 into the bf16 output.
            # (fused_moe_decode: the one-launch decode of eager one-token calls, the same kernel on the same adds.)
            fused = kernel in ("fused_moe", "fused_moe_decode")
            kind = "add_f32" if fused else "pk_add_bf16"
            adds = {op: n for op, n in rep["atomic_instructions"].items() if op != "global_atomic_add"}
            assert adds and all(kind in op for op in adds), (kernel, rep["atomic_instructions"])
            # The fused kernel's add counter of the rows it casts at M=1 (epilogues._cast_finished_rows).
            assert rep["atomic_instructions"].get("global_atomic_add", 0) == (fused and M == 1), rep
    assert (("fused_moe_decode", 1) in r) and ("fused_moe_decode", 4096) not in r


def test_sm80_lowers_bf16_atomics_to_a_cas_loop():
    # Documented: Ampere has no native bf16 atomic add; the report must say so, not hide it. Stage 2 adds
    # bf16; the fused path's float32 accumulator takes native float32 adds.
    r = codegen("sm_80", "qwen3-30b-a3b", "16,4096")
    assert r[("moe_stage2", 4096)]["cas_loop"]
    assert not r[("fused_moe", 16)]["cas_loop"] and r[("fused_moe", 16)]["atomic_instructions"]
    assert any(k.startswith("HMMA") for k in r[("fused_moe", 16)]["matrix_instructions"])


SM90_SHARED_MEMORY = 232448  # bytes per block on H100/H200
GEMM_KERNELS = ("fused_moe", "fused_moe_decode", "fused_moe_stage1", "moe_stage2")  # the launches that take a config
LORA_KERNELS = ("lora_shrink13", "lora_expand13", "lora_shrink2", "lora_expand2")  # the two-stage path's LoRA launches


def test_sm90_tma_configs_load_weights_through_the_copy_engine():
    # The shipped tma=True configs (the H200's tuned files: Qwen3-30B-A3B fused at M=16 and 128 and two-stage at
    # 4096, DeepSeek-V2-Lite fused at M=1, where the one-launch decode runs them too, and two-stage at 1024): gate/up
    # tiles, down tiles and stage 2's y tiles come through tensor descriptors (UTMALDG in the SASS), without spills
    # and within shared memory, under Triton 3.6 and 3.9. (--tma forced onto the default M=1 tiling, a config no
    # file ships, spilled 2 instructions under Triton 3.6.)
    expected = {("qwen3-30b-a3b", "16,128,4096"): {("fused_moe", 16), ("fused_moe", 128), ("fused_moe_stage1", 4096),
                                                   ("moe_stage2", 4096)},
                ("deepseek-v2-lite", "1,1024"): {("fused_moe", 1), ("fused_moe_decode", 1),
                                                 ("fused_moe_stage1", 1024), ("moe_stage2", 1024)}}
    for (shape, ms), keys in expected.items():
        r = codegen("sm_90", shape, ms, "--tuned-for", "NVIDIA_H200", kernels=GEMM_KERNELS)
        tma = {key for key, rep in r.items() if rep.get("config", {}).get("tma")}
        assert keys <= tma, (shape, sorted(tma))
        for key in tma:
            rep = r[key]
            assert rep["tensor_copy_instructions"], (key, rep)
            assert no_spills(rep) and rep["shared_memory_bytes"] <= SM90_SHARED_MEMORY, (key, rep)
    # The default rules (no tuned file, configs/defaults.json since 2026-11-28): the fused rule of M=1 keeps pointer
    # loads and plain launches; the two-stage rules take tensor descriptors and PDL.
    plain = codegen("sm_90", "qwen3-30b-a3b", "1,4096")
    assert not plain[("fused_moe", 1)]["tensor_copy_instructions"]
    assert not plain[("fused_moe", 1)]["grid_dependency_control"]
    for key in (("fused_moe_stage1", 4096), ("moe_stage2", 4096)):
        rep = plain[key]
        assert rep["tensor_copy_instructions"] and "griddepcontrol.wait" in rep["grid_dependency_control"], (key, rep)
        assert no_spills(rep) and rep["shared_memory_bytes"] <= SM90_SHARED_MEMORY, (key, rep)


def test_sm90_pdl_configs_wait_for_the_previous_launch():
    # pdl=True: every kernel launched as a programmatic dependent waits (griddepcontrol.wait) before it
    # reads its predecessor's results, and the sort and stage 1 let their dependents start early.
    r = codegen("sm_90", "qwen3-30b-a3b", "1,4096", "--pdl")
    wait, early = "griddepcontrol.wait", "griddepcontrol.launch_dependents"
    for key in (("fused_moe", 1), ("fused_moe", 4096), ("fused_moe_stage1", 4096), ("moe_stage2", 4096),
                ("moe_sorting", 4096)):
        assert wait in r[key]["grid_dependency_control"] and no_spills(r[key]), (key, r[key])
        # Nothing read from global memory before the wait (in the PTX's layout): a sort program that read
        # the count table first raced the count launch (and failed the GPU graph test).
        assert r[key]["global_loads_before_wait"] == 0, (key, r[key])
    for key in (("moe_sorting", 1), ("fused_moe_stage1", 4096)):
        assert early in r[key]["grid_dependency_control"], (key, r[key])
    # At M=4096 the sort takes two launches (sort_chunk_size): 64 programs count 512-entry chunks and
    # let the scatter launch start; its 64 chunk programs and 128 expert programs wait for the counts
    # (its 64 zeroing programs need not), and it lets the next launch start.
    count, scatter = r[("moe_sorting_count", 4096)], r[("moe_sorting", 4096)]
    assert count["grid"] == [64] and count["grid_dependency_control"] == [early] and no_spills(count), count
    assert scatter["chunk_size"] == 512 and scatter["grid"] == [64 + 128 + 64], scatter
    assert scatter["grid_dependency_control"] == [early, wait] and no_spills(scatter), scatter
    rocm = codegen("gfx942", "qwen3-30b-a3b", "4096", "--pdl")  # ignored on ROCm: still compiles
    assert ("moe_stage2", 4096) in rocm
    for kernel in ("moe_sorting_count", "moe_sorting"):  # tl.histogram, tl.sort and tl.gather in 64 KiB of LDS
        rep = rocm[(kernel, 4096)]
        assert no_spills(rep) and rep["lds_bytes"] <= 64 * 1024, rep
    # The one-launch sort as a GPU of the target runs it (sort_programs): 100 experts, top-8, M=600
    # (4800 entries, 2 scan steps, under sort_chunk_size's threshold) get 2 programs each, then 19
    # that zero the output, with 4 warps on 132 multiprocessors and 8 on 304.
    for target, warps in (("sm_90", 4), ("gfx942", 8)):
        rep = codegen(target, "100,256,128,8", "600", kernels=("moe_sorting",))[("moe_sorting", 600)]
        assert rep["chunk_size"] == 0 and rep["grid"] == [2 * 100 + 19] and rep["num_warps"] == warps, rep
    # With adapters the two-stage path's LoRA launches join the chain: each waits and signals early.
    r = codegen("sm_90", "qwen3-30b-a3b", "4096", "--pdl", "--lora-rank", "16",
                kernels=(*LORA_KERNELS, "fused_moe_stage1_lora", "moe_stage2"))
    for kernel in ("lora_shrink13", "lora_expand13", "fused_moe_stage1_lora", "lora_shrink2", "lora_expand2"):
        assert r[(kernel, 4096)]["grid_dependency_control"] == [early, wait], (kernel, r[(kernel, 4096)])
    assert r[("moe_stage2", 4096)]["grid_dependency_control"] == [wait]


@pytest.mark.parametrize("shape,rank", [("qwen3-30b-a3b", 16), ("mixtral-8x7b", 16), ("mixtral-8x7b", 64)])
def test_sm90_lora_kernel_spills_at_most_a_few_registers(shape, rank):
    # BLOCK_M=32 was what the defaults picked for Qwen3 at M=1024; per-adapter loops once spilled 182
    # instructions there (measured slow on the H200); the stacked adapter operands keep it. A handful
    # of spill instructions outside the loops is the cost of keeping the plain BLOCK_K (measured faster).
    reports = codegen("sm_90", shape, "1,16,128,1024", "--lora-rank", str(rank), kernels=("fused_moe_lora",))
    lora = [r for (kernel, _), r in reports.items() if kernel == "fused_moe_lora"]
    assert len(lora) == 4
    for r in lora:
        if rank == 16:  # the benchmarked rank; rank 64 spills 246 at Mixtral M=1024 (Triton 3.9; not measured on a GPU)
            assert r["spill_instructions"] <= MAX_LORA_SPILLS, r
        # Pipelined per-adapter loops once needed 266 KB at rank 64 (an out-of-resources launch).
        assert r["shared_memory_bytes"] <= SM90_SHARED_MEMORY, r
    plain = {M: r["config"] for (kernel, M), r in reports.items() if kernel == "fused_moe"}  # (not compiled)
    for r in lora:  # tiles keep their rows: halving BLOCK_M doubles the weight reads
        assert r["config"]["BLOCK_M"] == plain[r["M"]]["BLOCK_M"], r


@pytest.mark.parametrize("shape", ["deepseek-v2-lite", "mixtral-8x7b"])
def test_two_stage_lora_keeps_stage1_footprint_and_rocm_compiles(shape):
    # With adapters, stage 1 only adds ready deltas: it must keep the plain stage 1's shared memory
    # and (nearly) its registers, else tiles without adapters lose resident programs (measured
    # 1.3-1.4x slower on the H100 when a stacked expand inside stage 1 added 25 KB and 55 registers).
    reports = {**codegen("sm_90", shape, "1024", "--lora-rank", "0", kernels=("fused_moe_stage1",)),
               **codegen("sm_90", shape, "1024", "--lora-rank", "16", kernels=(*LORA_KERNELS, "fused_moe_stage1_lora"))}
    reports = {kernel: r for (kernel, _), r in reports.items()}
    plain, lora = reports["fused_moe_stage1"], reports["fused_moe_stage1_lora"]
    assert lora["shared_memory_bytes"] == plain["shared_memory_bytes"], (plain, lora)
    assert lora["registers"] <= plain["registers"] + 16 and no_spills(lora), (plain, lora)
    for kernel in LORA_KERNELS:
        rep = reports[kernel]
        assert rep["shared_memory_bytes"] <= SM90_SHARED_MEMORY, rep
        # 4 warps and 4 stages ran the four LoRA launches 1.4-1.5x faster than 8 warps and 2 stages on
        # the H100, though the gate/up expand then spills 10 instructions at 64-row tiles
        # (lora_kernel_options); nothing more may spill.
        max_spills = 16 if kernel == "lora_expand13" else 0
        assert rep["local_memory_bytes"] == 0 and rep["spill_instructions"] <= max_spills, rep
    with_lora = ("moe_sorting_lora", "fused_moe_lora", *LORA_KERNELS, "fused_moe_stage1_lora")
    reports = codegen("gfx942", shape, "1024", "--lora-rank", "16", kernels=with_lora)
    rocm = [r for (kernel, _), r in reports.items() if "lora" in kernel]
    assert {r["kernel"] for r in rocm} == set(with_lora)  # (launches not compiled are reported too)
    for rep in rocm:
        assert rep["lds_bytes"] <= 64 * 1024 and no_spills(rep), rep


def test_sm80_two_stage_lora_kernels_take_their_own_launch_settings():
    # lora_kernel_options picks per architecture: the sm_90 setting (4 warps, 4 stages at 64-row
    # tiles) spilled 280 instructions in the sm_80 down expand; sm_80 gets 8 warps, 2 stages.
    # Qwen3 M=1024: the defaults' 64-row tiles (128-row tiles: see lora_kernel_options).
    reports = codegen("sm_80", "qwen3-30b-a3b", "1024", "--lora-rank", "16", kernels=LORA_KERNELS)
    lora = {k: r for (k, _), r in reports.items() if k.startswith(("lora_shrink", "lora_expand"))}
    assert set(lora) == set(LORA_KERNELS)
    for rep in lora.values():
        assert (rep["num_warps"], rep["num_stages"]) == (8, 2) and no_spills(rep), rep
    sm90 = codegen("sm_90", "qwen3-30b-a3b", "1024", "--lora-rank", "16", kernels=("lora_shrink13",))
    assert (sm90[("lora_shrink13", 1024)]["num_warps"], sm90[("lora_shrink13", 1024)]["num_stages"]) == (4, 4)


def test_fused_lora_kernels_fit_the_shared_memory_of_their_target():
    # The LoRA loops' stages are fitted to the target's shared memory (fit_lora_config): on sm_80 the
    # Qwen3 M=128 defaults (BLOCK_N=128 x BLOCK_K=128) with 3 LoRA stages took 204800 bytes, more than an
    # A100 gives a program (166912), as did the 128-column slices M=16 takes with adapters. sm_90 keeps 3.
    from fmoe2.codegen import TARGET_SHARED_MEMORY

    for target, stages in (("sm_80", 2), ("sm_90", 3)):
        reports = codegen(target, "qwen3-30b-a3b", "1,16,128", "--lora-rank", "16", kernels=("fused_moe_lora",))
        for M in (1, 16, 128):
            rep = reports[("fused_moe_lora", M)]
            assert rep["shared_memory_bytes"] <= TARGET_SHARED_MEMORY[target], rep
            if M > 1:
                assert (rep["config"]["BLOCK_N"], rep["config"]["lora_num_stages"]) == (128, stages), rep
                # sm_90 (8 warps, like the H100 and H200 picks there): 8 spill instructions (Triton 3.9)
                assert no_spills(rep) if target == "sm_80" else rep["spill_instructions"] <= MAX_LORA_SPILLS, rep


SIGNATURE_CHECK = """
import torch
from fmoe2.codegen import _signature
from fmoe2.sorting import MoESortingResult
from fmoe2.sorting.moe_sorting import _moe_sorting_kernel, sorting_kernel_launch

M, topk, E = 64, 8, 128
ids = torch.empty(M, topk, dtype=torch.int32, device="meta")
weights = torch.empty(M, topk, dtype=torch.float32, device="meta")
sorting = MoESortingResult.allocate(M * topk, E, 16, M, "meta")
_, args, constexprs, _ = sorting_kernel_launch(ids, weights, E, None, sorting, torch.empty(M, 2048, device="meta"),
                                               num_parts=1)
assert args["num_zero_programs"] == 16 and args["num_parts"] == 1 and args["num_entries"] == 512, args
signature, attrs, constexprs = _signature(_moe_sorting_kernel, args, constexprs, "cuda")
index = {name: i for i, name in enumerate(_moe_sorting_kernel.arg_names)}
assert signature["num_zero_programs"] == "i32" and (index["num_zero_programs"],) not in attrs, attrs
assert signature["num_parts"] == "i32" and "num_parts" not in constexprs, signature
assert attrs[(index["num_entries"],)] == [["tt.divisibility", 16]], attrs

# A bundle (a NamedTuple argument) is typed element by element, as the JIT's own specialiser types it: its
# signature a tuple of the bundle's type, a None field and a stride of 1 constexprs by path, a tensor and an int
# divisible by 16 with the hint by path.
from triton.backends.compiler import BaseBackend
from triton.runtime.jit import native_specialize_impl
from fmoe2.codegen import _tuple_signature
from fmoe2.gemm.bundles import ExpertWeights

w = torch.zeros(4, 64, 32, dtype=torch.bfloat16)
bundle = ExpertWeights(w, None, None, None, *w.stride(), 48)
jit_types, jit_attrs = native_specialize_impl(BaseBackend, bundle, False, True, True)
i, attrs, constexprs = 3, {}, {}  # (the bundle as the kernel's fourth parameter)
types = _tuple_signature(bundle, (i,), attrs, constexprs, "cuda")
assert types == jit_types and type(types) is ExpertWeights, (types, jit_types)
assert {k: v for k, v in constexprs.items() if isinstance(k, tuple)} == {(i, 1): None, (i, 2): None, (i, 3): None,
                                                                          (i, 6): 1}, constexprs
assert {k for k, v in attrs.items() if k[0] == i} == {(i, j) for j, a in enumerate(jit_attrs) if a == "D"}, attrs
print("ok")
"""


def test_signature_specialises_ints_like_the_jit():
    # Ints divisible by 16 get the divisibility hint and ints equal to 1 become constants, except
    # for parameters marked do_not_specialize (the sort's zeroing-program count and parts), which
    # the JIT compiles once for every value, and bundles are typed field by field: the report must
    # compile what a GPU run compiles.
    proc = run_script(SIGNATURE_CHECK, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-4000:]


STAGE2_SPLIT_CHECK = """
import json, torch
from fmoe2 import FusedMoEConfig
from fmoe2.codegen import TARGETS, _compile_spec
from fmoe2.gemm.launches import MoEProblem, TwoStageWorkspace, stage2_kernel_launch
from fmoe2.sorting import MoESortingResult
from fmoe2.target import NAMED_TARGETS

M, E, H, I, topk = 16, 8, 4096, 14336, 2  # Mixtral decode, where the H100 search picked K shares
meta = dict(device="meta", dtype=torch.bfloat16)
x = torch.empty(M, H, **meta)
problem = MoEProblem(x, torch.empty(E, 2 * I, H, **meta), torch.empty(E, H, I, **meta), True, E, H, I, topk)
sorting = MoESortingResult.allocate(M * topk, E, 16, M, "meta")
for target, s2 in (("sm_90", (256, 128, 8, 3)), ("gfx942", (128, 64, 4, 2))):
    bn, bk, warps, stages = s2
    cfg = FusedMoEConfig(BLOCK_M=16, BLOCK_N=64, BLOCK_K=bk, BLOCK_H=128, path="two_stage", S2_BLOCK_N=bn,
                         S2_BLOCK_K=bk, S2_GROUP_M=1, s2_num_warps=warps, s2_num_stages=stages, S2_SPLIT_K=2)
    workspace = TwoStageWorkspace.allocate(problem, sorting, cfg, NAMED_TARGETS[target])
    spec = stage2_kernel_launch(problem, x, sorting, workspace, cfg, NAMED_TARGETS[target])
    assert spec.constexprs["SPLIT_K"] == 2 and spec.grid[0] == 2 * sorting.sorted_expert_ids.numel() * (H // bn)
    print(json.dumps({"target": target, **_compile_spec(spec, TARGETS[target])}))
"""


def test_stage2_k_shares_compile_without_spills():
    # The tuned H100/H200 files pick 2 K shares for stage 2 at decode sizes (compiled here for sm_90,
    # and for gfx942 with its 64 KiB of LDS, though the ROCm defaults do not use them).
    proc = run_script(STAGE2_SPLIT_CHECK, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    reports = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["target"] for r in reports] == ["sm_90", "gfx942"]
    for rep in reports:
        assert no_spills(rep), rep
        assert rep["atomic_instructions"], rep
    assert reports[1]["lds_bytes"] <= 64 * 1024


IN_STAGES_CHECK = """
import json, torch
from dataclasses import replace
from fmoe2 import FusedMoEConfig
from fmoe2.codegen import TARGET_MULTIPROCESSORS, TARGET_SHARED_MEMORY, TARGETS, _compile_spec, _meta_lora
from fmoe2.gemm.config import fit_lora_config_to_problem
from fmoe2.gemm.launches import (MoEProblem, TwoStageWorkspace, deltas_in_stages, fused_kernel_launch,
                                 stage2_kernel_launch)
from fmoe2.sorting import MoESortingResult
from fmoe2.target import NAMED_TARGETS

E, H, I, topk = 8, 4096, 14336, 2  # Mixtral decode: the tuned H100 / H200 picks (two-stage, K shares)
meta = dict(device="meta", dtype=torch.bfloat16)
picks = {"h100": FusedMoEConfig(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, BLOCK_H=128, num_stages=3, path="two_stage",
                                S2_BLOCK_N=128, S2_BLOCK_K=128, S2_GROUP_M=1, s2_num_warps=4, s2_num_stages=4,
                                S2_SPLIT_K=2),
         "h200": FusedMoEConfig(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, BLOCK_H=128, num_stages=4, tma=True,
                                path="two_stage", S2_BLOCK_N=128, S2_BLOCK_K=128, S2_GROUP_M=1, s2_num_warps=4,
                                s2_num_stages=4, S2_SPLIT_K=2)}
for target, pick, M in (("sm_90", "h100", 1), ("sm_90", "h200", 1), ("sm_90", "h200", 4), ("sm_80", "h100", 1),
                        ("gfx942", "h100", 1)):
    backend = TARGETS[target].backend
    cfg = picks[pick] if target == "sm_90" else replace(picks[pick], tma=False)
    if target == "gfx942":  # stage 2 as a ROCm pick would tile it (the LoRA fit leaves stage 2's loop alone)
        cfg = replace(cfg, S2_BLOCK_K=64, s2_num_stages=2)
    cfg = fit_lora_config_to_problem(cfg, M, E, H, I, topk, torch.bfloat16, TARGET_MULTIPROCESSORS[target], backend,
                                     TARGET_SHARED_MEMORY[target])
    x = torch.empty(M, H, **meta)
    problem = MoEProblem(x, torch.empty(E, 2 * I, H, **meta), torch.empty(E, H, I, **meta), True, E, H, I, topk)
    problem.lora = _meta_lora(4, E, H, I, 16, torch.bfloat16)
    problem.token_lora_ids = torch.empty(M, dtype=torch.int32, device="meta")
    assert deltas_in_stages(problem, cfg)
    sorting = MoESortingResult.allocate(M * topk, E, cfg.BLOCK_M, M, "meta", count_lora_tokens=True)
    named = NAMED_TARGETS[target]
    workspace = TwoStageWorkspace.allocate(problem, sorting, cfg, named)
    assert workspace.lora_delta13 is None and workspace.lora_shrink2.shape[0] == -(-I // cfg.BLOCK_N)
    for kernel, spec in (("stage1", fused_kernel_launch(problem, x, sorting, "silu", cfg, named, workspace)),
                         ("stage2", stage2_kernel_launch(problem, x, sorting, workspace, cfg, named))):
        if kernel == "stage1":  # the deltas computed here, the down shrinks stored
            assert spec.kernel.fn.__name__ == "_stage1_lora_kernel" and spec.args["lora_delta13_ptr"] is None
            assert spec.args["lora_shrink2_ptr"] is not None
        else:  # stage 2 sums and expands them
            assert spec.args["lora_shrink_ptr"] is not None
        print(json.dumps({"target": target, "pick": pick, "M": M, "kernel": kernel, "BLOCK_N": cfg.BLOCK_N,
                          "limit": TARGET_SHARED_MEMORY[target], **_compile_spec(spec, TARGETS[target])}))
"""


def test_two_stage_deltas_in_the_stages_compile_within_shared_memory():
    # Mixtral decode with adapters on the tuned two-stage picks: stage 1 computes the gate/up deltas and
    # stores down shrinks, stage 2 sums and expands them; fitted to each target's shared memory.
    proc = run_script(IN_STAGES_CHECK, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    reports = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(reports) == 10
    for rep in reports:
        assert rep["BLOCK_N"] == 128, rep  # stage 1's slices widened to LORA_MIN_BLOCK_N (the H200 pick has 64)
        used = rep.get("shared_memory_bytes", rep.get("lds_bytes"))
        assert used <= rep["limit"], rep
        if "registers" in rep:  # CUDA: stage 2 as clean as plain; stage 1 like the fused LoRA kernel
            limit = 0 if rep["kernel"] == "stage2" else MAX_LORA_SPILLS
            assert rep["spill_instructions"] <= limit, rep
        else:
            assert no_spills(rep), rep


def test_codegen_reports_the_stages_as_fused_moe_runs_them_with_adapters(monkeypatch):
    # With adapters the two-stage picks are fitted like fused_moe's (fit_lora_config_to_problem): at
    # Mixtral M=1 the H200's tuned pick (64-column stage 1, 4 stages) runs stage 1 at 128 columns and
    # 3 LoRA stages. Compilation is stubbed out: this checks the configs the report compiles.
    import torch

    import fmoe2.codegen as codegen
    import fmoe2.gemm.config as config_module
    from fmoe2 import FusedMoEConfig

    h200 = FusedMoEConfig(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, BLOCK_H=128, num_stages=4, tma=True, path="two_stage",
                          S2_BLOCK_N=128, S2_BLOCK_K=128, S2_GROUP_M=1, s2_num_warps=4, s2_num_stages=4, S2_SPLIT_K=2)
    real = config_module._plain_pick

    def pick(problem, target, path, *rest):  # as from a tuned file
        return h200 if path in ("auto", "two_stage") else real(problem, target, path, *rest)

    monkeypatch.setattr(config_module, "_plain_pick", pick)
    monkeypatch.setattr(codegen, "_compile", lambda *a, **k: {})
    reports = {r["kernel"]: r for r in codegen.codegen_report("sm_90", (8, 4096, 14336, 2), 1, lora_rank=16)}
    expected = config_module.get_config(1, 8, 4096, 14336, 2, torch.bfloat16, lora=True)
    assert (expected.BLOCK_N, expected.lora_num_stages) == (128, 3)
    for kernel in ("fused_moe_stage1_lora", "moe_stage2_lora"):  # the deltas in the stages: no LoRA launches
        assert reports[kernel]["config"] == expected.to_dict(), kernel
    assert not any(k.startswith("lora_") for k in reports)
    plain = {r["kernel"]: r for r in codegen.codegen_report("sm_90", (8, 4096, 14336, 2), 1)}
    assert plain["fused_moe_stage1"]["config"] == h200.to_dict()


GPT_OSS_CHECK = """
import json, torch
from fmoe2.codegen import TARGETS, _compile_spec
from fmoe2.gemm.config import ConfigMode, ConfigProblem, FusedMoEConfig, resolve_config
from fmoe2.gemm.launches import MoEProblem, TwoStageWorkspace, fused_kernel_launch, stage2_kernel_launch
from fmoe2.sorting import MoESortingResult
from fmoe2.target import NAMED_TARGETS

E, H, I, topk = 32, 2880, 2880, 4  # gpt-oss-20b, its weights as transformers stores them, read in place
meta = dict(device="meta", dtype=torch.bfloat16)
for target, tuned_for, ms in (("sm_90", "NVIDIA_H200", (1, 64, 512, 4096)), ("sm_90", None, (1, 64)),
                              ("gfx942", None, (1, 2048))):
    named = NAMED_TARGETS[target]
    for M in ms:
        x = torch.empty(M, H, **meta)
        w1 = torch.empty(E, H, 2 * I, **meta).transpose(1, 2)  # gate_up_proj [E, H, 2I], interleaved
        w2 = torch.empty(E, I, H, **meta).transpose(1, 2)  # down_proj [E, I, H]
        problem = MoEProblem(x, w1, w2, True, E, H, I, topk, w1_bias=torch.empty(E, 2 * I, **meta),
                             w2_bias=torch.empty(E, H, **meta), swiglu_alpha=1.702, swiglu_limit=7.0)
        shape = ConfigProblem(M, E, H, I, topk, torch.bfloat16)
        auto = resolve_config(shape, ConfigMode(), named, tuned_for=tuned_for).path
        for path in ("fused", "two_stage"):
            cfg = resolve_config(shape, ConfigMode(), named, path=path, tuned_for=tuned_for)
            sorting = MoESortingResult.allocate(M * topk, E, cfg.BLOCK_M, M, "meta")
            workspace = TwoStageWorkspace.allocate(problem, sorting, cfg, named) if path == "two_stage" else None
            specs = [fused_kernel_launch(problem, x, sorting, "swiglu_oai", cfg, named, workspace)]
            if workspace is not None:
                specs.append(stage2_kernel_launch(problem, x, sorting, workspace, cfg, named))
            assert specs[0].args["w1"].stride_k == 2 * I and specs[0].args["w1"].bias_ptr is not None
            if workspace is not None:
                assert specs[1].args["stride_b_k"] == H and specs[1].args["bias_ptr"] is not None
            for spec in specs:
                print(json.dumps({"target": target, "tuned_for": tuned_for, "M": M, "path": path,
                                  "auto": path == auto, "kernel": spec.name, **_compile_spec(spec, TARGETS[target])}))
# The H200's M=64 pick on 98a32ee (its tuned M=16 entry), pinned: the tiling whose stage 1 spilled 3662 instructions
# with these weights, whatever the tuned files now pick.
M, named = 64, NAMED_TARGETS["sm_90"]
given = FusedMoEConfig(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, BLOCK_H=128, GROUP_M=1, num_warps=4, num_stages=5, tma=True,
                       pdl=True, path="two_stage", S2_BLOCK_N=64, S2_BLOCK_K=128, S2_GROUP_M=1, s2_num_warps=4,
                       s2_num_stages=4, S2_SPLIT_K=1)
cfg = resolve_config(ConfigProblem(M, E, H, I, topk, torch.bfloat16), ConfigMode(), named, given)
x = torch.empty(M, H, **meta)
problem = MoEProblem(x, torch.empty(E, H, 2 * I, **meta).transpose(1, 2), torch.empty(E, I, H, **meta).transpose(1, 2),
                     True, E, H, I, topk, w1_bias=torch.empty(E, 2 * I, **meta), w2_bias=torch.empty(E, H, **meta),
                     swiglu_alpha=1.702, swiglu_limit=7.0)
sorting = MoESortingResult.allocate(M * topk, E, cfg.BLOCK_M, M, "meta")
workspace = TwoStageWorkspace.allocate(problem, sorting, cfg, named)
for spec in (fused_kernel_launch(problem, x, sorting, "swiglu_oai", cfg, named, workspace),
             stage2_kernel_launch(problem, x, sorting, workspace, cfg, named)):
    print(json.dumps({"target": "sm_90", "tuned_for": None, "M": M, "path": "two_stage", "auto": False,
                      "pinned": True, "kernel": spec.name, **_compile_spec(spec, TARGETS["sm_90"])}))
"""


def test_gpt_oss_kernels_compile():
    # gpt-oss-20b: transposed, interleaved weights read through their strides (N-contiguous), gate/up and down
    # biases, the clamped swiglu_oai; both paths, with the H200's tuned configs and the default rules, compile for
    # sm_90 and gfx942 with matrix instructions, the path "auto" picks without spills, the other path with a few at
    # most. Before the weight tiles were loaded in the dot's [K, N] orientation, the H200's M=64 pick spilled 3662
    # instructions in stage 1 with these weights and ran 37x slower than with K-contiguous ones (issue 55): that
    # tiling is compiled pinned (the tuned files have been retuned since) and must not spill; forced
    # two-stage at M=1, 171. (Forced fused at M=512, the H200's two-stage tiling refitted: 3 spill instructions with
    # Triton 3.9, none with 3.6.)
    proc = run_script(GPT_OSS_CHECK, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    reports = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(reports) == 8 * 3 + 2  # (each point: one fused kernel, two two-stage ones; the pinned pick's two)
    # the paths "auto" picks (the H200's tuned files since a67e7bd: two-stage at every M of gpt-oss-20b's shape)
    auto_paths = {(rep["target"], rep["tuned_for"], rep["M"]): rep["path"] for rep in reports if rep["auto"]}
    assert auto_paths == {**{("sm_90", "NVIDIA_H200", M): "two_stage" for M in (1, 64, 512, 4096)},
                          ("sm_90", None, 1): "fused", ("sm_90", None, 64): "fused",
                          ("gfx942", None, 1): "fused", ("gfx942", None, 2048): "two_stage"}, auto_paths
    # the pick that spilled (the H200's two-stage tiling at M=64 on 98a32ee), both stages compiled
    assert {rep["kernel"] for rep in reports if rep.get("pinned")} == {"stage1", "stage2"}
    for rep in reports:
        assert rep["matrix_instructions"], rep
        if rep["auto"] or rep.get("pinned"):
            assert no_spills(rep), rep
        else:
            assert rep.get("spill_instructions", rep.get("vgpr_spills")) <= 8, rep


@pytest.mark.parametrize("target,weights", [("sm_90", "int8"), ("sm_90", "mxfp4"), ("gfx942", "int8"),
                                            ("gfx950", "int4")])
def test_weight_only_formats_compile_to_16bit_matrix_instructions_without_spills(target, weights):
    # Weight-only formats (fmoe2/formats.py) run the 16-bit entries, their tiles dequantized in the operand loader
    # (the int8 weights' pointer type picks its branch); Qwen3-30B-A3B at decode and prefill sizes, both paths. No
    # spills, but in the one-launch decode with Triton 3.6 on sm_90 (2 spill instructions for mxfp4 and int8, none for
    # int4, H200 2026-11-29; none with Triton 3.9).
    reports = codegen(target, "qwen3-30b-a3b", "1,4096", "--weights", weights)
    assert {"fused_moe", "fused_moe_stage1", "moe_stage2"} <= {kernel for kernel, _ in reports}
    for (kernel, M), rep in reports.items():
        assert rep["weights"]["format"] == weights, (kernel, M)
        spills = rep.get("spill_instructions", rep.get("vgpr_spills"))
        if kernel == "fused_moe_decode":
            assert spills <= MAX_WEIGHT_ONLY_DECODE_SPILLS, (kernel, M, spills)
        else:
            assert no_spills(rep), (kernel, M, spills)
        if not kernel.startswith("moe_sorting") and kernel != "cast":
            assert rep["matrix_instructions"], (kernel, M)
        if target == "sm_90" and kernel in ("fused_moe", "fused_moe_decode", "fused_moe_stage1", "moe_stage2"):
            # The packed weight tiles go through the software pipeline, as 16-bit ones do (a loader that loaded
            # the next step's tile into registers by hand had none: 3-6 cp.async per kernel, for x and scales)
            assert rep["async_copies"] >= 9, (kernel, M, rep["async_copies"])
            if weights == "int8":  # (bf16 scales, as the report builds them: dequantized in bf16, no I2F; the F2FP
                # packs go too, but a kernel's longest loop can be its accumulator's cast, which has them)
                converts = [op for op in rep["loop_instructions"] if op.startswith("I2F")]
                assert not converts, (kernel, M, converts)


FP8_MATRIX = {"sm_90": "QGMMA", "gfx942": "v_mfma_f32_16x16x32_fp8_fp8", "gfx950": "v_mfma_f32_16x16x128_f8f6f4"}


@pytest.mark.parametrize("target", sorted(FP8_MATRIX))
def test_fp8_kernels_use_fp8_matrix_instructions_without_spills(target):
    # Block-scaled fp8 weights (e4m3fnuz on gfx942), Qwen3 shape at M=4096: the fused kernel, stage 1 (storing
    # fp8 y) and stage 2 on fp8 matrix instructions (sm_90: wgmma with e4m3 operands), the sort launch with
    # its x-quantizing programs; nothing spills.
    reports = codegen(target, "qwen3-30b-a3b", "4096", "--fp8", "block")
    assert {"fused_moe", "fused_moe_stage1", "moe_stage2", "moe_sorting"} <= {k for k, _ in reports}
    for (kernel, _), rep in reports.items():
        assert rep["fp8"]["weight_dtype"] == ("float8_e4m3fnuz" if target == "gfx942" else "float8_e4m3fn")
        assert no_spills(rep), rep
        if kernel != "moe_sorting" and kernel != "moe_sorting_count":
            assert any(name.startswith(FP8_MATRIX[target]) for name in rep["matrix_instructions"]), rep


@pytest.mark.parametrize("target,flags", [("sm_90", ()), ("gfx942", ()), ("gfx950", ()), ("sm_90", ("--lora-rank", "16")),
                                          ("gfx942", ("--lora-rank", "16")), ("sm_90", ("--fp8", "block"))])
def test_deterministic_launches_compile_without_atomics_or_spills(target, flags):
    # Deterministic mode: one writer per element everywhere (stage 2 stores slot rows, the combine sums them).
    reports = codegen(target, "qwen3-30b-a3b", "1,4096", "--deterministic", *flags)
    names = {kernel for kernel, _ in reports}
    assert {"deterministic_sort", "deterministic_stage1", "deterministic_stage2", "deterministic_combine"} <= names
    for (kernel, M), r in reports.items():
        assert not r["atomic_instructions"], (kernel, M, r["atomic_instructions"])
        assert no_spills(r), (kernel, M, r)
        if kernel in ("deterministic_stage1", "deterministic_stage2"):
            assert r["matrix_instructions"], (kernel, M)
    configs = [reports["deterministic_stage1", M]["config"] for M in (1, 4096)]
    assert all(c["path"] == "two_stage" and c["S2_SPLIT_K"] == 1 for c in configs)
    # One tiling for every M, but on sm_90 for 16-bit weights without adapters (resolve_config).
    assert (configs[0] == configs[1]) == (target != "sm_90" or bool(flags)), configs


@pytest.mark.parametrize("target", ["sm_90", "sm_80", "gfx942", "gfx950"])
def test_one_launch_decode_zeroes_its_accumulator_only_after_every_thread_read_it(target):
    # The one-token decode's last program casts the token's float32 row, then zeroes it for the next call. The
    # compiler lays the zeroing stores out over the threads its own way (sm_90: a thread reads and casts 8 columns
    # and zeroes 4 others), so zeroing without a barrier after the reads let a thread zero columns another had not
    # read yet:
    # gpt-oss-20b and DeepSeek-V3 decoded with relative errors of 0.2-0.4 (issue 44; docs/correctness.md).
    for shape in ("32,2880,2880,4", "256,7168,2048,8"):
        r = codegen(target, shape, "1", kernels=("fused_moe", "fused_moe_decode"))
        assert r[("fused_moe_decode", 1)]["accumulator_reset_after_reads"] is True, r[("fused_moe_decode", 1)]
        assert r[("fused_moe", 1)]["accumulator_reset_after_reads"] is None  # the sort path's cast zeroes nothing


@pytest.mark.parametrize("target,flags", [("sm_90", ("--tuned-for", "NVIDIA_H200", "--tma")), ("gfx942", ())])
def test_tail_tiles_compile_both_tile_heights_without_spills(target, flags):
    # gpt-oss-20b M=1024: the H200 pick is 128-row two-stage (tensor descriptors); ROCm's default 64-row tiles.
    tail = "64" if target == "sm_90" else "32"
    reports = codegen(target, "32,2880,2880,4", "1024", "--tail-m", tail, *flags,
                      kernels=("fused_moe_stage1", "moe_stage2"))
    for kernel in ("fused_moe_stage1", "moe_stage2"):
        rep = reports[(kernel, 1024)]
        assert rep["config"]["TAIL_M"] == int(tail) and no_spills(rep), rep
        if target == "sm_90":  # a 128-row and a 64-row tile: wgmma of both heights' shapes
            assert len(rep["matrix_instructions"]) == 2 and rep["wgmma"], rep


def test_sass_reports_are_read_back_for_the_same_code(tmp_path, monkeypatch):
    # Disassembling a kernel (cuobjdump) is most of a codegen run whose kernels Triton's cache holds: the report of a
    # kernel's code is kept beside that cache and read back for the same cubin, PTX and shared memory, never for
    # other code; an unreadable file is reported again.
    from types import SimpleNamespace

    import fmoe2.codegen as cg

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    made = []

    def sass_report(compiled):
        made.append(compiled)
        return {"registers": len(made)}

    monkeypatch.setattr(cg, "_sass_report", sass_report)

    def kernel(ptx, shared=0):
        return SimpleNamespace(asm={"cubin": b"\x7fELF cubin", "ptx": ptx}, metadata=SimpleNamespace(shared=shared))

    assert cg._report_cuda(kernel("a")) == {"registers": 1}
    assert cg._report_cuda(kernel("a")) == {"registers": 1} and len(made) == 1  # read back
    assert cg._report_cuda(kernel("b")) == {"registers": 2}  # other code
    assert cg._report_cuda(kernel("a", shared=1024)) == {"registers": 3}
    (stored,) = [p for p in (tmp_path / "fmoe2_sass_reports").iterdir() if p.read_text() == '{"registers": 1}']
    stored.write_text("{")  # (a torn file)
    assert cg._report_cuda(kernel("a")) == {"registers": 4} and len(made) == 4
    assert not list((tmp_path / "fmoe2_sass_reports").glob("*.tmp"))


def test_the_compile_child_answers_each_request_and_survives_a_crash():
    # Scripts print to stdout, write to descriptor 1 as a compiler's tool would, fail, or kill the child: each answer
    # belongs to its request, and a dead child is started again for the next one.
    ok = run_script("import os, sys; os.write(1, b'tool output\\n'); print('ok'); print('note', file=sys.stderr)")
    assert (ok.returncode, ok.stdout, ok.stderr) == (0, "ok\n", "note\n"), vars(ok)
    failed = run_script("raise ValueError('bad request')")
    assert failed.returncode == 1 and "ValueError: bad request" in failed.stderr, vars(failed)
    refused = run_codegen(["--target", "no-such-target"])
    assert refused.returncode == 2 and "--target" in refused.stderr, vars(refused)
    died = run_script("import os; os._exit(3)")
    assert died.returncode == 1 and "exit status 3" in died.stderr, vars(died)
    again = run_script("print('ok')")
    assert (again.returncode, again.stdout) == (0, "ok\n"), vars(again)

