"""fused_moe with multi-LoRA against the float64 reference (CPU interpreter in fp16/fp32, or the
GPU), on the fused and the two-stage path: mixed adapters, tokens without one, every rank,
adapters on some experts only, odd sizes, layouts, and the argument checks."""
import importlib
from dataclasses import replace

import pytest
import torch
import triton

import fmoe2
from fmoe2 import FusedMoEConfig, MoELoRA, fused_moe, prepare_lora, prepare_weights
from helpers import DEVICE, assert_matches_reference, make_lora, make_problem, make_token_lora_ids, poisoned, rel_error

SMALL = FusedMoEConfig(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, BLOCK_H=16)
SMALL_TWO_STAGE = FusedMoEConfig(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, BLOCK_H=16, path="two_stage", S2_BLOCK_N=16,
                                 S2_BLOCK_K=16)
# "two_stage": the adapter deltas by the LoRA shrink/expand launches before each stage;
# "two_stage_in_stages": inside the two stages (fmoe2.gemm.config.lora_in_stages). Tests parametrized by
# ``path`` get that choice pinned (the _pin_two_stage_lora fixture), whatever the batch size.
CONFIGS = {"fused": SMALL, "two_stage": SMALL_TWO_STAGE, "two_stage_in_stages": SMALL_TWO_STAGE}
PATHS = list(CONFIGS)
IN_STAGES_MAX_TOKENS_PER_EXPERT = {"two_stage": -1, "two_stage_in_stages": float("inf")}
fm = importlib.import_module("fmoe2.gemm.launches")  # the launch descriptions and their rules
config_module = importlib.import_module("fmoe2.gemm.config")


@pytest.fixture(autouse=True)
def _pin_two_stage_lora(request, monkeypatch):
    callspec = getattr(request.node, "callspec", None)
    path = callspec.params.get("path") if callspec else None
    if path in IN_STAGES_MAX_TOKENS_PER_EXPERT:
        limit = IN_STAGES_MAX_TOKENS_PER_EXPERT[path]
        monkeypatch.setattr(config_module, "LORA_IN_STAGES_MAX_TOKENS_PER_EXPERT", limit)


def launch_names(monkeypatch) -> list:
    """The names of the launches of every following fused_moe call (that describes its launches: the
    first of a plan, and every call under the interpreter), appended in order."""
    names = []
    real = fm.forward_specs
    monkeypatch.setattr(fm, "forward_specs", lambda *a: (lambda specs: names.extend(s.name for s in specs) or specs)(
        real(*a)))
    return names


def run_and_check(M, E, H, I, topk, rank, dtype, *, num_loras=3, lora_ids=None, experts=None, prepared=True,
                  prepared_lora=True, config=SMALL, seed=0, path="auto"):
    x, w1, w2, tw, ti = make_problem(M, E, H, I, topk, dtype, seed=seed)
    lora = make_lora(num_loras, E, H, I, rank, dtype, seed=seed, experts=experts)
    if lora_ids is None:
        lora_ids = make_token_lora_ids(M, num_loras, seed=seed)
    weights = (prepare_weights(w1, w2), None) if prepared else (w1, w2)
    out = fused_moe(x, *weights, tw, ti, lora=prepare_lora(lora) if prepared_lora else lora,
                    token_lora_ids=lora_ids, config=config, out=poisoned(M, H, dtype), path=path)
    err = assert_matches_reference(out, x, w1, w2, tw, ti, lora=lora, token_lora_ids=lora_ids)
    # The deltas are O(1): leaving any of them out cannot pass the check above.
    base = fmoe2.fused_moe_reference(x.double(), w1.double(), w2.double(), tw, ti)
    if (lora_ids >= 0).any() and experts is None:
        assert rel_error(base, fmoe2.fused_moe_reference(x.double(), w1.double(), w2.double(), tw, ti, lora=lora,
                                                         token_lora_ids=lora_ids)) > 0.05
    return err


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("prepared", [False, True], ids=["plain", "prepared"])
@pytest.mark.parametrize("M,E,H,I,topk", [
    (1, 4, 64, 32, 2),
    (13, 5, 40, 24, 2),  # H, I not multiples of 16, E not a power of two
    (37, 3, 24, 56, 3),  # several tiles per expert, tiles mixing adapters
])
def test_mixed_adapters_match_reference(M, E, H, I, topk, dtype, prepared):
    run_and_check(M, E, H, I, topk, 16, dtype, prepared=prepared, seed=M)


@pytest.mark.parametrize("path", ["two_stage", "two_stage_in_stages"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("M,E,H,I,topk,prepared", [
    (1, 4, 64, 32, 2, True),
    (13, 5, 40, 24, 2, False),
    (37, 3, 24, 56, 3, True),
])
def test_two_stage_mixed_adapters_match_reference(M, E, H, I, topk, prepared, dtype, path, monkeypatch):
    # "two_stage": LoRA deltas by _lora_shrink_kernel + _lora_expand_kernel, gate/up into a workspace
    # before stage 1, down into out before stage 2; "two_stage_in_stages": no LoRA launch.
    names = launch_names(monkeypatch)
    run_and_check(M, E, H, I, topk, 16, dtype, prepared=prepared, config=SMALL_TWO_STAGE, seed=M)
    lora_launches = ["lora_shrink13", "lora_expand13", "lora_shrink2", "lora_expand2"] if path == "two_stage" else []
    assert [n for n in names if n.startswith("lora")] == lora_launches


@pytest.mark.parametrize("path", ["two_stage_in_stages"])
@pytest.mark.parametrize("I,S2_SPLIT_K", [(300, 1), (300, 2), (40, 1)])
def test_in_stages_sum_the_down_shrinks_of_every_slice(I, S2_SPLIT_K, path, monkeypatch):
    # Stage 1 stores one down shrink per I slice, stage 2 sums them, LORA_SPLITS_PER_STEP (16 here) per
    # load. 16-column slices (no widening): I = 300 gives 19 slices, a full step and a tail; I = 40, 3.
    monkeypatch.setattr(config_module, "LORA_MIN_BLOCK_N", 16)
    splits = []
    real = fm.stage2_kernel_launch
    monkeypatch.setattr(fm, "stage2_kernel_launch", lambda *a, **k: (
        lambda spec: splits.append((spec.args["num_shrink_splits"], spec.constexprs["LORA_SPLITS_PER_STEP"])) or spec)(
        real(*a, **k)))
    run_and_check(5, 4, 40, I, 2, 16, torch.float16, config=replace(SMALL_TWO_STAGE, S2_SPLIT_K=S2_SPLIT_K), seed=I)
    assert splits == [(-(-I // 16), 16)]


@pytest.mark.parametrize("path", ["two_stage_in_stages"])
@pytest.mark.parametrize("M,S2_SPLIT_K", [(1, 2), (9, 3), (26, 2)])
def test_in_stages_down_deltas_over_stage_2_shares(M, S2_SPLIT_K, path):
    # Stage 2 in shares of I (S2_SPLIT_K): only the first share adds the down deltas (a second add, or
    # none, fails the check). I = 72: 5 steps of 16, so the last share is shorter.
    cfg = replace(SMALL_TWO_STAGE, S2_SPLIT_K=S2_SPLIT_K)
    run_and_check(M, 5, 40, 72, 3, 16, torch.float16, config=cfg, seed=M)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("rank", [8, 16, 32, 64, 5])
def test_every_rank(rank, path):
    run_and_check(11, 4, 48, 40, 2, rank, torch.float16, config=CONFIGS[path], seed=rank)


@pytest.mark.parametrize("path", PATHS)
def test_one_adapter_for_all_tokens_and_unprepared_lora(path):
    M = 19
    run_and_check(M, 4, 40, 32, 2, 16, torch.float16, lora_ids=torch.full((M,), 2, dtype=torch.int32, device=DEVICE),
                  prepared_lora=False, config=CONFIGS[path])


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("M", [17, 1])  # M=1: one-slot decode tiles, which skip numbering slots
def test_no_token_has_an_adapter_gives_the_plain_result(path, M):
    E, H, I, topk = 4, 40, 32, 2
    x, w1, w2, tw, ti = make_problem(M, E, H, I, topk, torch.float16, seed=3)
    lora = prepare_lora(make_lora(2, E, H, I, 16, torch.float16))
    assert (fm.lora_constexprs(lora, num_rows=M * topk, num_experts=E)["LORA_SLOTS"] == 1) == (M == 1)
    # -1 and ids outside [0, max_loras) both mean "no adapter".
    lora_ids = torch.tensor(([-1, 2, 7, -5] * 5)[:M], dtype=torch.int32, device=DEVICE)
    out = fused_moe(x, w1, w2, tw, ti, lora=lora, token_lora_ids=lora_ids, config=CONFIGS[path])
    plain = fused_moe(x, w1, w2, tw, ti, config=CONFIGS[path])
    if DEVICE == "cpu":  # the interpreter adds in a fixed order: bitwise equal
        torch.testing.assert_close(out, plain, rtol=0, atol=0)
    else:  # GPU atomics add in a run-dependent order: equal to rounding
        assert rel_error(out, plain) < 2e-3


@pytest.mark.parametrize("path", PATHS)
def test_adapters_on_some_experts_only(path):
    run_and_check(23, 6, 40, 24, 2, 16, torch.float16, experts=[1, 4], config=CONFIGS[path], seed=4)


@pytest.mark.parametrize("num_loras,rank,dtype,prepared,path", [
    (8, 16, torch.float16, True, "fused"), (16, 8, torch.float16, True, "fused"), (5, 64, torch.float16, True, "fused"),
    (3, 32, torch.float16, True, "fused"), (2, 16, torch.float16, True, "fused"), (8, 16, torch.float32, False, "fused"),
    (5, 64, torch.float32, False, "fused"), (8, 16, torch.float16, True, "two_stage"),
    (16, 8, torch.float32, False, "two_stage"), (5, 64, torch.float16, True, "two_stage"),
    (8, 16, torch.float16, True, "two_stage_in_stages"), (16, 8, torch.float32, False, "two_stage_in_stages"),
    (5, 64, torch.float16, True, "two_stage_in_stages")])
def test_many_adapters_one_expert_tile(num_loras, rank, dtype, prepared, path):
    # All tokens on one expert, every tile mixes many adapters: with more adapters in a tile than
    # the kernel stacks into one operand (LORA_SLOTS), further slot groups take extra passes.
    M = 40
    ids = torch.zeros(M, 1, dtype=torch.int32)
    lora_ids = (torch.arange(M, dtype=torch.int32) % (num_loras + 1) - 1).to(DEVICE)  # -1, 0..L-1
    x, w1, w2, tw, ti = make_problem(M, 2, 32, 40, 1, dtype, ids=ids)
    lora = make_lora(num_loras, 2, 32, 40, rank, dtype)
    cfg = FusedMoEConfig(BLOCK_M=32, BLOCK_N=16, BLOCK_K=16, BLOCK_H=32, path=CONFIGS[path].path, S2_BLOCK_N=16,
                         S2_BLOCK_K=16)
    weights = (prepare_weights(w1, w2), None) if prepared else (w1, w2)
    out = fused_moe(x, *weights, tw, ti, lora=lora, token_lora_ids=lora_ids, config=cfg, out=poisoned(M, 32, dtype))
    assert_matches_reference(out, x, w1, w2, tw, ti, lora=lora, token_lora_ids=lora_ids)


@pytest.mark.parametrize("activation,path", [("silu", "fused"), ("gelu_tanh", "fused"), ("silu", "two_stage"),
                                             ("silu", "two_stage_in_stages")])
def test_one_slot_tile_mixing_adapters(activation, path):
    # Fewer routed rows than experts gives one slot (LORA_SLOTS=1), yet a tile may still mix
    # adapters: here 3 tokens with adapters 0, 1, 2 all on expert 0 of 8 take two further passes.
    M, E, H, I = 3, 8, 40, 24
    ids = torch.zeros(M, 1, dtype=torch.int32)
    lora_ids = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)
    x, w1, w2, tw, ti = make_problem(M, E, H, I, 1, torch.float16, ids=ids)
    lora = make_lora(3, E, H, I, 16, torch.float16)
    assert fm.lora_constexprs(prepare_lora(lora), num_rows=M, num_experts=E)["LORA_SLOTS"] == 1
    out = fused_moe(x, w1, w2, tw, ti, activation=activation, lora=lora, token_lora_ids=lora_ids,
                    config=CONFIGS[path], out=poisoned(M, H, torch.float16))
    assert_matches_reference(out, x, w1, w2, tw, ti, activation=activation, lora=lora, token_lora_ids=lora_ids)


@pytest.mark.parametrize("path", ["two_stage", "two_stage_in_stages"])
@pytest.mark.parametrize("out_of_range_ids", [False, True])
def test_two_stage_lora_workspaces_need_no_initial_values(monkeypatch, out_of_range_ids, path):
    # Every workspace row that stage 1 and stage 2 read is written first (delta rows of tokens
    # without an adapter, -1 or an id outside [0, max_loras), are never read): NaN-filled
    # workspaces must give the same result.
    real = fm.TwoStageWorkspace.from_views.__func__

    def from_views_poisoned(cls, views, intermediate_size):
        ws = real(cls, views, intermediate_size)
        for t in (ws.y, ws.lora_shrink13, ws.lora_shrink2, ws.lora_delta13):
            if t is not None:
                t.fill_(float("nan"))
        return ws

    monkeypatch.setattr(fm.TwoStageWorkspace, "from_views", classmethod(from_views_poisoned))
    monkeypatch.setattr(config_module, "LORA_MIN_BLOCK_N", 16)  # in the stages: 4 slices' down shrinks
    M = 37
    lora_ids = None  # run_and_check's mix: adapters 0..2 and -1
    if out_of_range_ids:  # 3 adapters: 5, 7 and -3 mean none too
        lora_ids = torch.tensor(([0, -1, 5, 1, -3, 2, 7] * 6)[:M], dtype=torch.int32, device=DEVICE)
    run_and_check(M, 3, 24, 56, 3, 16, torch.float16, lora_ids=lora_ids, config=SMALL_TWO_STAGE, seed=5)


def test_two_stage_lora_splits_the_shrink_and_the_expand_over_programs(monkeypatch):
    # Few tiles: each tile's shrink (K = H, then I) and expand (N = I, then H) are shared by several
    # programs; the expand sums the partial shrinks. Down: I = 600 is 5 steps of 128 over 4 splits
    # (2, 2, 1 and an empty share, whose zeros must still count as written).
    from fmoe2.target import INTERPRETER_TARGET as cpu

    assert fm.lora_splits(2, 600, 128, 1, cpu) == 4 and fm.lora_splits(2, 160, 128, 1, cpu) == 2
    assert fm.lora_splits(64, 600, 128, 1, cpu) == 1
    assert fm.lora_shrink_splits(1, 10**6, cpu) == 8
    monkeypatch.setattr(fm, "LORA_MAX_SHRINK_SPLITS", 3)
    assert fm.lora_shrink_splits(1, 10**6, cpu) == 3
    monkeypatch.undo()
    # 1 routed row per expert: pin the LoRA launches
    monkeypatch.setattr(config_module, "LORA_IN_STAGES_MAX_TOKENS_PER_EXPERT", -1)
    monkeypatch.setattr(fm, "LORA_BLOCK_K", 128)
    monkeypatch.setattr(fm, "lora_expand_block_n", lambda *a: 64)  # expand: I = 600 in 10 column steps, H = 160 in 3
    grids = {}
    real = fm.forward_specs
    monkeypatch.setattr(fm, "forward_specs", lambda *a: (lambda specs: grids.update(
        (s.name, s.grid) for s in specs if s.name.startswith("lora")) or specs)(real(*a)))
    run_and_check(2, 2, 160, 600, 1, 16, torch.float16, config=SMALL_TWO_STAGE, seed=6,
                  lora_ids=torch.tensor([0, 1], dtype=torch.int32, device=DEVICE))
    if DEVICE != "cpu":  # a GPU splits for its multiprocessor count
        return
    assert grids == {"lora_shrink13": (2, 2), "lora_expand13": (2, 4), "lora_shrink2": (2, 4), "lora_expand2": (2, 3)}


def test_lora_slots_stack_adapters_up_to_the_stack_width():
    for (num_loras, rank), slots in {(4, 16): 4, (16, 16): 4, (3, 8): 4, (2, 16): 2, (4, 32): 2, (16, 64): 1}.items():
        lora = prepare_lora(make_lora(num_loras, 2, 16, 16, rank, torch.float16))
        c = fm.lora_constexprs(lora, num_rows=64, num_experts=8)
        assert c["LORA_SLOTS"] == slots and c["LORA_IDS"] == triton.next_power_of_2(num_loras), (num_loras, rank, c)
        # Fewer rows than experts: tiles hold about one row, one slot.
        assert fm.lora_constexprs(lora, num_rows=7, num_experts=8)["LORA_SLOTS"] == 1
        assert fm.lora_constexprs(lora, num_rows=8, num_experts=8)["LORA_SLOTS"] == slots


def test_gelu_with_lora():
    M, E, H, I, topk = 9, 3, 32, 24, 2
    x, w1, w2, tw, ti = make_problem(M, E, H, I, topk, torch.float16)
    lora = make_lora(2, E, H, I, 16, torch.float16)
    lora_ids = make_token_lora_ids(M, 2)
    out = fused_moe(x, w1, w2, tw, ti, activation="gelu", lora=lora, token_lora_ids=lora_ids, config=SMALL)
    assert_matches_reference(out, x, w1, w2, tw, ti, activation="gelu", lora=lora, token_lora_ids=lora_ids)


def test_prepared_lora_round_trips():
    lora = make_lora(3, 4, 40, 24, 5, torch.float16)
    back = prepare_lora(lora).unprepare()
    for name in ("gate_a", "gate_b", "up_a", "up_b", "down_a", "down_b", "scaling"):
        torch.testing.assert_close(getattr(back, name), getattr(lora, name), rtol=0, atol=0)
    assert prepare_lora(lora).padded_rank == 16


def test_prepared_lora_in_another_layout_is_refused():
    # B in vLLM's [..., rank] layout (what an older or hand-built object may hold) would be read
    # as the wrong elements: refused with the expected shape.
    import dataclasses
    good = prepare_lora(make_lora(2, 4, 40, 24, 16, torch.float16))
    old_b13 = good.b13[..., :24].transpose(2, 3).contiguous()  # [L, E, 2I, R_pad]
    with pytest.raises(ValueError, match=r"lora\.b13 must have shape"):
        dataclasses.replace(good, b13=old_b13)
    old_b2 = good.b2[..., :40].transpose(2, 3).contiguous()  # [L, E, H, R_pad]
    with pytest.raises(ValueError, match=r"lora\.b2 must have shape"):
        dataclasses.replace(good, b2=old_b2)
    with pytest.raises(ValueError, match="contiguous"):
        dataclasses.replace(good, b2=good.b2.transpose(2, 3).contiguous().transpose(2, 3))
    with pytest.raises(ValueError, match=r"lora\.a13 must have shape"):
        dataclasses.replace(good, rank=32)


def _lora_tensors(L=2, E=4, R=16, H=32, I=24, dtype=torch.float16):
    z = dict(dtype=dtype, device=DEVICE)
    return dict(gate_a=torch.zeros(L, E, R, H, **z), gate_b=torch.zeros(L, E, I, R, **z),
                up_a=torch.zeros(L, E, R, H, **z), up_b=torch.zeros(L, E, I, R, **z),
                down_a=torch.zeros(L, E, R, I, **z), down_b=torch.zeros(L, E, H, R, **z))


@pytest.mark.parametrize("change,error,match", [
    (dict(up_a=torch.zeros(2, 4, 16, 31, dtype=torch.float16)), ValueError, r"lora\.up_a must have shape"),
    (dict(down_b=torch.zeros(2, 4, 32, 16, dtype=torch.float32)), TypeError, r"lora\.down_b must have dtype"),
    (dict(gate_a=torch.zeros(17, 4, 16, 32, dtype=torch.float16)), ValueError, "max_loras must be in"),
    (dict(scaling=[1.0, 2.0, 3.0]), ValueError, r"scaling must be a float or have shape \[max_loras\]"),
    (dict(scaling="x"), TypeError, "scaling"),
])
def test_moelora_checks(change, error, match):
    t = _lora_tensors()
    t["scaling"] = 1.0
    for k, v in change.items():
        t[k] = v.to(DEVICE) if isinstance(v, torch.Tensor) else v
    with pytest.raises(error, match=match):
        MoELoRA(**t)


def test_rank_above_limit_is_refused():
    with pytest.raises(ValueError, match="rank"):
        MoELoRA(**_lora_tensors(R=128))


def test_fused_moe_lora_argument_checks():
    M, E, H, I, topk = 4, 4, 32, 24, 2
    x, w1, w2, tw, ti = make_problem(M, E, H, I, topk, torch.float16)
    lora = MoELoRA(**_lora_tensors())
    ids = torch.zeros(M, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="token_lora_ids is None"):
        fused_moe(x, w1, w2, tw, ti, lora=lora)
    with pytest.raises(ValueError, match="lora is None"):
        fused_moe(x, w1, w2, tw, ti, token_lora_ids=ids)
    with pytest.raises(TypeError, match="token_lora_ids must have dtype int32"):
        fused_moe(x, w1, w2, tw, ti, lora=lora, token_lora_ids=ids.long())
    with pytest.raises(ValueError, match=r"token_lora_ids must have shape \[M\]"):
        fused_moe(x, w1, w2, tw, ti, lora=lora, token_lora_ids=ids[:3])
    with pytest.raises(TypeError, match="lora weights have dtype"):
        fused_moe(x, w1, w2, tw, ti, lora=MoELoRA(**_lora_tensors(dtype=torch.float32)), token_lora_ids=ids)
    with pytest.raises(ValueError, match="lora is for E=4, H=32, I=16"):
        fused_moe(x, w1, w2, tw, ti, lora=MoELoRA(**_lora_tensors(I=16)), token_lora_ids=ids)
    with pytest.raises(TypeError, match="lora must be a fmoe2.MoELoRA"):
        fused_moe(x, w1, w2, tw, ti, lora=object(), token_lora_ids=ids)


def test_auto_path_with_lora_runs_the_picked_two_stage_path(monkeypatch):
    M, E, H, I, topk = 40, 2, 32, 24, 2  # 40 tokens per expert: the defaults pick two-stage
    assert fmoe2.get_config(M, E, H, I, topk, torch.float16, backend="cuda").path == "two_stage"
    names = launch_names(monkeypatch)
    run_and_check(M, E, H, I, topk, 16, torch.float16, config=None)
    expands = ["lora_expand13", "lora_expand2"]  # the gate/up and down delta launches of the two-stage LoRA path
    assert [n for n in names if n.startswith("lora_expand")] == expands
    run_and_check(M, E, H, I, topk, 16, torch.float16, config=None, path="fused")
    assert [n for n in names if n.startswith("lora_expand")] == expands


def test_auto_path_with_lora_at_decode_computes_the_deltas_in_the_two_stages(monkeypatch):
    M, E, H, I, topk = 2, 4, 32, 24, 2  # 1 routed row per expert (LORA_IN_STAGES_MAX_TOKENS_PER_EXPERT)
    real_pick = config_module._plain_pick

    def two_stage_pick(problem, target, path, *rest):  # like a tuned file's
        picked = real_pick(problem, target, path, *rest)
        return replace(picked, path="two_stage") if path == "auto" else picked

    monkeypatch.setattr(config_module, "_plain_pick", two_stage_pick)
    assert fmoe2.get_config(M, E, H, I, topk, torch.float16, lora=True).path == "two_stage"
    names = launch_names(monkeypatch)
    run_and_check(M, E, H, I, topk, 16, torch.float16, config=None)
    assert names == ["sort", "stage1", "stage2"]  # adapters present: no delta launches, no LoRA workspace
    names.clear()
    run_and_check(M, E, H, I, topk, 16, torch.float16, config=None, path="fused")
    assert names == ["sort", "fused", "cast"]  # a forced path stays forced (its float32 accumulator cast last)
    names.clear()
    run_and_check(3, E, H, I, topk, 16, torch.float16, config=None)  # 1.5 rows per expert: the delta launches
    assert names == ["sort", "lora_shrink13", "lora_expand13", "stage1", "lora_shrink2", "lora_expand2", "stage2"]


def test_two_stage_lora_expand_columns_per_architecture():
    # sm_90: 128 columns at every tile height (at 128-row tiles 128 columns ran the four LoRA launches of
    # Mixtral M=1024 in 153 instead of 168 us on the H100; fmoe2.bench.lora_settings). sm_80 spilled with
    # 128 columns from 64-row tiles, gfx942 at 32 rows.
    from fmoe2.gemm.launches import lora_expand_block_n
    from fmoe2.target import INTERPRETER_TARGET, NAMED_TARGETS

    assert [lora_expand_block_n(m, NAMED_TARGETS["sm_90"]) for m in (16, 64, 128)] == [128, 128, 128]
    assert lora_expand_block_n(128, INTERPRETER_TARGET) == 128  # no GPU (the interpreter) takes sm_90's rule
    assert [lora_expand_block_n(m, NAMED_TARGETS["sm_80"]) for m in (32, 64, 128)] == [128, 64, 64]
    assert [lora_expand_block_n(m, NAMED_TARGETS["gfx942"]) for m in (16, 128)] == [64, 64]


@pytest.mark.parametrize("path", PATHS)
def test_adapters_with_the_chunked_sort(path, monkeypatch):
    # Where sort_chunk_size picks the two-launch sort (large batches of many experts), the count of tokens
    # with an adapter moves to its second launch: 16-entry chunks here, mixed adapters, then none.
    monkeypatch.setattr(importlib.import_module("fmoe2.sorting.moe_sorting"), "sort_chunk_size",
                        lambda num_keys, num_entries: 16)
    run_and_check(21, 5, 40, 24, 3, 16, torch.float16, config=CONFIGS[path], seed=8)
    M, E, H, I, topk = 9, 4, 40, 32, 2
    x, w1, w2, tw, ti = make_problem(M, E, H, I, topk, torch.float16, seed=3)
    lora = prepare_lora(make_lora(2, E, H, I, 16, torch.float16))
    none = torch.full((M,), -1, dtype=torch.int32, device=DEVICE)
    out = fused_moe(x, w1, w2, tw, ti, lora=lora, token_lora_ids=none, config=CONFIGS[path])
    assert rel_error(out, fused_moe(x, w1, w2, tw, ti, config=CONFIGS[path])) < 2e-3
