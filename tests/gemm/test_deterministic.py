"""Deterministic mode (``fused_moe(..., deterministic=True)``, ``fmoe2.set_deterministic``): its results
against the float64 reference, its launches and config, the combine kernel's order of additions, bitwise
batch invariance (CPU interpreter in fp16/fp32, the GPU in bf16), and on the GPU bitwise reproducibility
over repeated calls and CUDA-graph replays, for the batch sizes where the default takes the fused and the
two-stage path, with and without adapters and with an expert map."""
import json
import math
from dataclasses import replace

import pytest
import torch
import triton

import fmoe2
from fmoe2 import FusedMoEConfig, fused_moe, get_config, prepare_weights
from fmoe2.bench.timing import capture_graph
from fmoe2.gemm.combine_kernel import _combine_slots_kernel
from fmoe2.gemm.config import CONFIG_DIR, _load_json
from fmoe2.target import target_of
from fmoe2.gemm.fused_moe import forward_launches, plan_of
from helpers import (DEVICE, SMALL_PROBLEMS, assert_matches_reference, make_lora, make_problem, make_token_lora_ids,
                     poisoned)

gpu_only = pytest.mark.skipif(DEVICE != "cuda", reason="bitwise reproducibility of GPU atomics and graphs: GPU only")
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float16
TILING_FREE_CUDA_ARCHS = _load_json(f"{CONFIG_DIR}/defaults.json")["deterministic"]["tiling_free_cuda_archs"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("prepared", [False, True], ids=["plain", "prepared"])
@pytest.mark.parametrize("M,E,H,I,topk", SMALL_PROBLEMS)
def test_matches_reference(M, E, H, I, topk, dtype, prepared):
    x, w1, w2, tw, ti = make_problem(M, E, H, I, topk, dtype, seed=M + E)
    out = poisoned(M, H, dtype)  # the combine launch writes every element (the sort zeroes nothing here)
    weights = (prepare_weights(w1, w2), None) if prepared else (w1, w2)
    assert fused_moe(x, *weights, tw, ti, out=out, deterministic=True) is out
    assert_matches_reference(out, x, w1, w2, tw, ti)


def test_launches_store_rows_per_slot_and_sum_them_last():
    x, w1, w2, tw, ti = make_problem(9, 4, 32, 32, 3, torch.float16)
    launches = dict(forward_launches(x, w1, w2, tw, ti, deterministic=True))
    assert list(launches) == ["sort", "stage1", "stage2", "combine"]
    sort, stage1, stage2 = launches["sort"].spec, launches["stage1"].spec, launches["stage2"].spec
    assert sort.constexprs["EXPANDED_IDS"] and not sort.constexprs["ZERO_OUT"]
    assert stage1.constexprs["IDS_PER_TOKEN"] == 3
    assert not stage2.constexprs["ATOMIC_OUTPUT"] and stage2.constexprs["SPLIT_K"] == 1
    assert stage2.args["c_ptr"].shape == (9 * 3, 32)
    default = dict(forward_launches(x, w1, w2, tw, ti, path="two_stage"))
    assert default["stage2"].spec.constexprs["ATOMIC_OUTPUT"] and "combine" not in default


def test_config_is_the_same_for_every_batch_size_but_where_tilings_were_measured_alike():
    shape = (60, 2048, 768, 8)
    batches = (1, 7, 64, 1000, 65536)
    for cuda_arch in (80, 100):  # GPUs whose tilings were not measured
        picked = {get_config(M, *shape, torch.bfloat16, deterministic=True, backend="cuda", cuda_arch=cuda_arch)
                  for M in batches}
        assert len(picked) == 1, cuda_arch
        (cfg,) = picked
        assert cfg.path == "two_stage" and cfg.S2_SPLIT_K == 1
    for arch in ("gfx942", "gfx950"):
        assert len({get_config(M, *shape, torch.bfloat16, deterministic=True, backend="hip", arch=arch)
                    for M in batches}) == 1
    assert len({get_config(M, *shape, torch.bfloat16, deterministic=True, lora=True) for M in (1, 1000, 65536)}) == 1
    # sm_90: a row's bits were measured not to depend on the tiling; the two-stage pick for M, without K shares.
    for M in batches:
        cfg = get_config(M, *shape, torch.bfloat16, deterministic=True, backend="cuda", cuda_arch=90)
        assert cfg == replace(get_config(M, *shape, torch.bfloat16, backend="cuda", cuda_arch=90, path="two_stage"),
                              S2_SPLIT_K=1)
        assert cfg.S2_SPLIT_K == 1 and cfg.path == "two_stage"
    assert len({get_config(M, *shape, torch.bfloat16, deterministic=True, backend="cuda", cuda_arch=90, lora=True)
                for M in batches}) == 1
    assert len({get_config(M, *shape, torch.float16, deterministic=True, backend="cuda", cuda_arch=90)
                for M in (1, 16, 128, 1024, 4096)}) == 1  # fp16: not measured, one tiling
    assert len({get_config(M, *shape, torch.bfloat16, deterministic=True, backend="cuda", cuda_arch=90, fp8=True)
                for M in batches}) == 1
    with pytest.raises(ValueError, match="two-stage"):
        get_config(1, *shape, torch.bfloat16, deterministic=True, path="fused")


def test_tuned_entries_for_deterministic_mode_and_the_plain_ones_by_nearest_batch(tmp_path):
    import json

    from fmoe2.gemm.config import device_config_name, shape_file_name

    E, H, I, topk = 16, 256, 128, 2
    plain = FusedMoEConfig(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, BLOCK_H=64, S2_SPLIT_K=2, path="two_stage")
    decode = FusedMoEConfig(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, BLOCK_H=128, path="two_stage", S2_BLOCK_K=128)
    d = tmp_path / device_config_name(torch.device("cpu"))
    d.mkdir()
    (d / shape_file_name(E, H, I, topk, torch.bfloat16)).write_text(json.dumps(
        {"1": replace(decode, path="fused").to_dict(), "4096": plain.to_dict(),
         "deterministic": {"1": decode.to_dict(), "16": replace(decode, BLOCK_N=64).to_dict()}}))

    def pick(M, **kw):
        return get_config(M, E, H, I, topk, torch.bfloat16, deterministic=True, backend="cuda", cuda_arch=90,
                          config_dir=str(tmp_path), device=torch.device("cpu"), **kw)

    assert pick(1).BLOCK_N == 32 and pick(20).BLOCK_N == 64  # the deterministic entries
    assert pick(3000) == replace(plain, S2_SPLIT_K=1)  # the plain entry, without its K shares
    assert pick(1, tuned=False) == replace(get_config(1, E, H, I, topk, torch.bfloat16, backend="cuda",
                                                      path="two_stage", tuned=False), S2_SPLIT_K=1)
    assert pick(1, lora=True) == pick(3000, lora=True)  # one tiling with adapters


def test_a_callers_config_runs_without_k_shares():
    x, w1, w2, tw, ti = make_problem(12, 4, 48, 64, 2, torch.float16)
    cfg = FusedMoEConfig(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, BLOCK_H=16, path="fused", S2_SPLIT_K=4, S2_BLOCK_K=16)
    out = fused_moe(x, w1, w2, tw, ti, config=cfg, deterministic=True)
    assert_matches_reference(out, x, w1, w2, tw, ti)
    plan = plan_of(x, w1, w2, tw, ti, config=cfg, deterministic=True)
    assert plan.config.path == "two_stage" and plan.config.S2_SPLIT_K == 1


def test_combine_adds_the_slots_left_to_right_in_float32():
    # (1e8 + 1) - 1e8 is 0 in float32 left to right; other orders (or a float64 sum) give 1.
    M, topk, H = 3, 3, 16
    slot_rows = torch.tensor([1e8, 1.0, -1e8]).repeat(M).view(M * topk, 1).expand(M * topk, H).contiguous()
    slot_rows = slot_rows.to(DEVICE)
    ids = torch.tensor([[0, 1, 2], [0, 1, 2], [0, 5, 2]], dtype=torch.int32, device=DEVICE)  # token 2: slot 1 dropped
    out = torch.full((M, H), float("nan"), device=DEVICE)
    _combine_slots_kernel[(1, 1)](slot_rows, out, ids, None, M, H, 3, H, H, TOPK=topk, NUM_EXPERTS=3,
                                  BLOCK_T=4, BLOCK_H=16)
    assert out[0].eq(0.0).all() and out[1].eq(0.0).all()
    assert out[2].eq(0.0).all()  # 1e8 + (dropped) - 1e8
    slot_rows[7] = 5.0  # the dropped slot's row is never read
    _combine_slots_kernel[(1, 1)](slot_rows, out, ids, None, M, H, 3, H, H, TOPK=topk, NUM_EXPERTS=3,
                                  BLOCK_T=4, BLOCK_H=16)
    assert out[2].eq(0.0).all()


def _batch_invariance(M_list, E, H, I, topk, dtype, lora_args=None, expert_map=None, seed=0, prepared=True):
    """Rows of 5 probe tokens computed in batches of each M with other companions: bitwise equal."""
    x, w1, w2, tw, ti = make_problem(max(M_list) + 5, E * (2 if expert_map is not None else 1), H, I, topk, dtype,
                                     seed=seed)
    if expert_map is not None:  # E local experts of 2E: the global weights' first half
        w1, w2 = w1[:E], w2[:E]
    weights = (prepare_weights(w1, w2), None) if prepared else (w1, w2)
    lora, token_lora_ids = lora_args if lora_args is not None else (None, None)
    probes = torch.arange(5, device=x.device)
    results = []
    for i, M in enumerate(M_list):
        n_probe = min(5, M)
        gen = torch.Generator().manual_seed(100 + i)
        companions = 5 + torch.randperm(x.shape[0] - 5, generator=gen)[:M - n_probe].to(x.device)
        rows = torch.cat([probes[:n_probe], companions])
        rows = rows[torch.randperm(M, generator=gen).to(x.device)]  # probes anywhere in the batch
        extra = {}
        if lora is not None:
            extra = dict(lora=lora, token_lora_ids=token_lora_ids[rows])
        out = fused_moe(x[rows], *weights, tw[rows], ti[rows], expert_map=expert_map, deterministic=True, **extra)
        position = {int(r): p for p, r in enumerate(rows.tolist())}
        results.append({p: out[position[p]] for p in range(n_probe)})
    for got in results[:-1]:
        for p, row in got.items():
            assert torch.equal(row, results[-1][p]), f"probe {p}: bits differ between batch sizes"
    return results


def test_batch_invariance_under_the_interpreter():
    _batch_invariance([1, 3, 7, 40], 6, 40, 24, 3, torch.float16)


def test_batch_invariance_with_adapters_and_an_expert_map():
    E, H, I, topk = 4, 32, 32, 2
    lora = make_lora(2, E, H, I, 16, torch.float16)
    token_lora_ids = make_token_lora_ids(45, 2)
    expert_map = torch.full((2 * E,), -1, dtype=torch.int32)
    expert_map[::2] = torch.arange(E, dtype=torch.int32)  # even global experts are local
    _batch_invariance([1, 7, 40], E, H, I, topk, torch.float16, (lora, token_lora_ids), expert_map.to(DEVICE))


def test_adapters_biases_and_an_expert_map_match_the_reference():
    M, E, H, I, topk = 13, 4, 40, 24, 3
    x, w1, w2, tw, ti = make_problem(M, E, H, I, topk, torch.float16, seed=3)
    lora = make_lora(2, E, H, I, 8, torch.float16)
    token_lora_ids = make_token_lora_ids(M, 2)
    out = fused_moe(x, w1, w2, tw, ti, lora=lora, token_lora_ids=token_lora_ids, deterministic=True,
                    out=poisoned(M, H, torch.float16))
    assert_matches_reference(out, x, w1, w2, tw, ti, lora=lora, token_lora_ids=token_lora_ids)
    gen = torch.Generator().manual_seed(4)
    b1 = (torch.randn(E, 2 * I, generator=gen) * 0.1).to(DEVICE, torch.float16)
    b2 = (torch.randn(E, H, generator=gen) * 0.1).to(DEVICE, torch.float16)
    out = fused_moe(x, w1, w2, tw, ti, w1_bias=b1, w2_bias=b2, activation="swiglu_oai", swiglu_limit=7.0,
                    deterministic=True)
    assert_matches_reference(out, x, w1, w2, tw, ti, w1_bias=b1, w2_bias=b2, activation="swiglu_oai",
                             swiglu_limit=7.0)
    expert_map = torch.tensor([-1, 0, -1, 1, 2, -1, 3, -1], dtype=torch.int32, device=DEVICE)
    ids = torch.randint(0, 8, (M, topk), generator=gen).to(DEVICE, torch.int32)
    ids[0] = torch.tensor([0, 2, 5])  # a token whose experts are all on other ranks: a zero row
    out = fused_moe(x, w1, w2, tw, ids, expert_map=expert_map, deterministic=True, out=poisoned(M, H, torch.float16))
    assert out[0].eq(0).all()
    assert_matches_reference(out, x, w1, w2, tw, ids, expert_map=expert_map)


def test_global_switches_and_argument_checks(deterministic_off):
    x, w1, w2, tw, ti = make_problem(5, 4, 32, 32, 2, torch.float16)
    fused_moe(x, w1, w2, tw, ti)
    assert plan_of(x, w1, w2, tw, ti, deterministic=False) is not None
    fmoe2.set_deterministic(True)
    assert fmoe2.deterministic_enabled()
    fused_moe(x, w1, w2, tw, ti)  # follows the switch: a plan of its own
    assert plan_of(x, w1, w2, tw, ti, deterministic=True).launch_names in ([], ["sort", "stage1", "stage2", "combine"])
    assert plan_of(x, w1, w2, tw, ti, deterministic=True).config.path == "two_stage"
    fmoe2.set_deterministic(False)
    torch.use_deterministic_algorithms(True)
    assert fmoe2.deterministic_enabled()
    torch.use_deterministic_algorithms(False)
    assert not fmoe2.deterministic_enabled()
    with pytest.raises(ValueError, match="two-stage"):
        fused_moe(x, w1, w2, tw, ti, path="fused", deterministic=True)
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        fused_moe(x, w1, w2, tw, ti, deterministic="yes")
    with pytest.raises(TypeError, match="enabled must be a bool"):
        fmoe2.set_deterministic(1)


def test_an_explicit_fused_path_under_the_global_switch(deterministic_off):
    # The switch cannot make the fused kernel deterministic: fmoe2's switch or torch's flag raise, naming the switch;
    # torch's warn_only flag alone warns and runs the fused path, as torch's own ops without a deterministic form do.
    x, w1, w2, tw, ti = make_problem(5, 4, 32, 32, 2, torch.float16)
    fmoe2.set_deterministic(True)
    with pytest.raises(ValueError, match="deterministic mode is on"):
        fused_moe(x, w1, w2, tw, ti, path="fused")
    out = fused_moe(x, w1, w2, tw, ti, path="fused", deterministic=False)  # an explicit False wins
    assert_matches_reference(out, x, w1, w2, tw, ti)
    fmoe2.set_deterministic(False)
    torch.use_deterministic_algorithms(True)
    with pytest.raises(ValueError, match="deterministic mode is on"):
        fused_moe(x, w1, w2, tw, ti, path="fused")
    torch.use_deterministic_algorithms(True, warn_only=True)
    with pytest.warns(UserWarning, match="not deterministic"):
        out = fused_moe(x, w1, w2, tw, ti, path="fused")
    assert_matches_reference(out, x, w1, w2, tw, ti)
    assert plan_of(x, w1, w2, tw, ti, path="fused", deterministic=False) is not None
    assert plan_of(x, w1, w2, tw, ti, deterministic=True) is None  # (warn_only still turns the mode on for auto)


def test_switching_the_mode_back_and_forth_takes_each_modes_launches(deterministic_off):
    x, w1, w2, tw, ti = make_problem(9, 4, 32, 32, 2, torch.float16, seed=2)
    names = {}
    for deterministic in (True, False, True, False):
        fmoe2.set_deterministic(deterministic)
        out = fused_moe(x, w1, w2, tw, ti)
        assert_matches_reference(out, x, w1, w2, tw, ti)
        launches = [n for n, _ in forward_launches(x, w1, w2, tw, ti, deterministic=deterministic)]
        names.setdefault(deterministic, launches)
        assert launches == names[deterministic]
    assert names[True][-1] == "combine" and "combine" not in names[False]


def test_a_callers_fused_config_runs_on_the_two_stage_path():
    x, w1, w2, tw, ti = make_problem(9, 4, 32, 32, 2, torch.float16, seed=3)
    cfg = FusedMoEConfig(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, BLOCK_H=32, path="fused")
    out = fused_moe(x, w1, w2, tw, ti, config=cfg, deterministic=True)
    assert_matches_reference(out, x, w1, w2, tw, ti)
    plan = plan_of(x, w1, w2, tw, ti, config=cfg, deterministic=True)
    assert plan is None or (plan.config.path == "two_stage" and plan.config.BLOCK_M == 16)
    launches = [n for n, _ in forward_launches(x, w1, w2, tw, ti, config=cfg, deterministic=True)]
    assert launches == ["sort", "stage1", "stage2", "combine"]


def test_a_config_dir_without_a_deterministic_section_takes_fmoe2s(tmp_path):
    defaults = _load_json(f"{CONFIG_DIR}/defaults.json")
    (tmp_path / "defaults.json").write_text(json.dumps({k: v for k, v in defaults.items() if k != "deterministic"}))
    mine = get_config(64, 8, 256, 128, 2, torch.float16, deterministic=True, backend="cuda", cuda_arch=80,
                      config_dir=str(tmp_path))
    assert mine == get_config(64, 8, 256, 128, 2, torch.float16, deterministic=True, backend="cuda", cuda_arch=80)


def test_the_op_takes_the_mode(deterministic_off):
    x, w1, w2, tw, ti = make_problem(6, 4, 32, 32, 2, torch.float16)
    args = (x, w1, w2, tw, ti, "silu", None, "auto", "", 0, 0, None, None, None, None, None, 0, None, None, None,
            False, 1.702, None, None, None, None, True)
    out = torch.ops.fmoe2.fused_moe(*args)
    assert torch.equal(out, fused_moe(x, w1, w2, tw, ti, deterministic=True))
    torch.library.opcheck(torch.ops.fmoe2.fused_moe.default, args, test_utils=("test_schema", "test_faketensor"))


# ---------------------------------------------------------------------------------------------
# GPU: bitwise reproducibility and batch invariance at the benchmark shapes' sizes
# ---------------------------------------------------------------------------------------------

QWEN3 = (128, 2048, 768, 8)


def _qwen3_inputs(M, seed=0):
    E, H, I, topk = QWEN3
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, H, device="cuda", dtype=torch.bfloat16, generator=gen)
    tw, ti = torch.topk(torch.randn(M, E, device="cuda", generator=gen).softmax(-1), topk, dim=-1)
    return x, tw, ti.to(torch.int32)


@pytest.fixture(scope="module")
def qwen3_weights():
    E, H, I, topk = QWEN3
    gen = torch.Generator(device="cuda").manual_seed(1)
    w1 = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16, generator=gen) / math.sqrt(H)
    w2 = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16, generator=gen) / math.sqrt(I)
    return w1, w2, prepare_weights(w1, w2)


@gpu_only
@pytest.mark.parametrize("M", [1, 16, 1000], ids=lambda m: f"M{m}")  # the default picks fused at 1 and 16
@pytest.mark.parametrize("variant", ["plain", "lora", "expert_map"])
def test_repeated_calls_and_graph_replays_are_bitwise_equal(qwen3_weights, M, variant):
    w1, w2, prepared = qwen3_weights
    E, H, I, topk = QWEN3
    x, tw, ti = _qwen3_inputs(M)
    extra = {}
    if variant == "lora":
        extra = dict(lora=fmoe2.prepare_lora(make_lora(4, E, H, I, 16, torch.bfloat16)),
                     token_lora_ids=make_token_lora_ids(M, 4))
    if variant == "expert_map":
        extra = dict(expert_map=torch.arange(E, dtype=torch.int32, device="cuda").roll(3))
        extra["expert_map"][::5] = -1
    out = torch.empty_like(x)
    run = lambda: fused_moe(x, prepared, None, tw, ti, out=out, deterministic=True, **extra)  # noqa: E731
    first = run().clone()
    ref = fmoe2.fused_moe_reference(x.float(), w1.float(), w2.float(), tw, ti, **extra)
    assert ((first.float() - ref).norm() / ref.norm()).item() < 1e-2
    for _ in range(19):
        assert torch.equal(run(), first)
    graph = capture_graph(run)
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, first)


@gpu_only
@pytest.mark.parametrize("variant", ["plain", "lora", "expert_map"])
def test_a_tokens_row_is_the_same_in_batches_of_1_7_64_and_1000(qwen3_weights, variant):
    w1, w2, prepared = qwen3_weights
    E, H, I, topk = QWEN3
    x, tw, ti = _qwen3_inputs(1005, seed=2)
    lora_args = None
    expert_map = None
    if variant == "lora":
        lora_args = (fmoe2.prepare_lora(make_lora(4, E, H, I, 16, torch.bfloat16)), make_token_lora_ids(1005, 4))
    if variant == "expert_map":
        expert_map = torch.arange(E, dtype=torch.int32, device="cuda")
        expert_map[1::3] = -1
    probes = torch.arange(5, device="cuda")
    results = []
    for i, M in enumerate((1, 7, 64, 1000)):
        gen = torch.Generator().manual_seed(10 + i)
        n_probe = min(5, M)
        companions = 5 + torch.randperm(1000, generator=gen)[:M - n_probe].cuda()
        rows = torch.cat([probes[:n_probe], companions])[torch.randperm(M, generator=gen).cuda()]
        extra = {} if lora_args is None else dict(lora=lora_args[0], token_lora_ids=lora_args[1][rows])
        out = fused_moe(x[rows], prepared, None, tw[rows], ti[rows], expert_map=expert_map, deterministic=True,
                        **extra)
        where = {int(r): p for p, r in enumerate(rows.tolist())}
        results.append({p: out[where[p]].clone() for p in range(n_probe)})
    for got in results[:-1]:
        for p, row in got.items():
            assert torch.equal(row, results[-1][p]), f"probe {p}: bits differ between batch sizes"


def test_grid_of_the_combine_launch_covers_every_token_and_column():
    x, w1, w2, tw, ti = make_problem(37, 3, 1100, 16, 2, torch.float16)
    combine = dict(forward_launches(x, w1, w2, tw, ti, deterministic=True))["combine"].spec
    t, h = combine.constexprs["BLOCK_T"], combine.constexprs["BLOCK_H"]
    assert combine.grid == (triton.cdiv(37, t), triton.cdiv(1100, h))


@gpu_only
@pytest.mark.skipif(target_of(DEVICE).cuda_arch not in TILING_FREE_CUDA_ARCHS,
                    reason="deterministic mode keeps one tiling on this GPU")
def test_a_rows_bits_do_not_depend_on_the_tiling_where_picks_vary_with_m(qwen3_weights):
    # The claim behind tiling_free_cuda_archs (defaults.json): checked on every run, on the GPU it names.
    _, _, prepared = qwen3_weights
    E, H, I, topk = QWEN3

    def cfg(bm, bn, bk, warps, s2n, s2k, s2warps, group=8):
        return FusedMoEConfig(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, BLOCK_H=128, GROUP_M=group, num_warps=warps,
                              num_stages=3, path="two_stage", S2_BLOCK_N=s2n, S2_BLOCK_K=s2k, S2_GROUP_M=group,
                              s2_num_warps=s2warps, s2_num_stages=3)

    tilings = [cfg(64, 64, 64, 8, 128, 64, 8), cfg(16, 64, 128, 4, 128, 128, 4, 1), cfg(128, 128, 64, 8, 256, 64, 8),
               cfg(32, 64, 64, 4, 128, 64, 4), cfg(64, 64, 32, 4, 64, 32, 4), cfg(16, 32, 64, 2, 64, 64, 2, 1)]
    tilings += [get_config(M, E, H, I, topk, torch.bfloat16, deterministic=True) for M in (1, 16, 128, 1024, 4096)]
    for M in (5, 300):
        x, tw, ti = _qwen3_inputs(M, seed=M)
        outs = [fused_moe(x, prepared, None, tw, ti, config=c, deterministic=True) for c in tilings]
        for c, o in zip(tilings, outs):
            assert torch.equal(o, outs[0]), c
