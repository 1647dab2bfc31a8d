"""fmoe2's torch.library ops (fmoe2/ops.py): registration checked by torch.library.opcheck, and
torch.compile(fullgraph=True) tracing through fmoe2.fused_moe and fmoe2.moe_sorting without a graph
break. On the CPU the compiled graph runs under aot_eager (the kernels under the Triton interpreter);
Inductor and CUDA graphs are checked on the GPU (tests/test_gpu.py)."""
import importlib
import pytest
import torch

import fmoe2
from fmoe2 import FusedMoEConfig, fused_moe, prepare_lora, prepare_weights
from helpers import DEVICE, assert_matches_reference, make_lora, make_problem, make_token_lora_ids, poisoned

SMALL = FusedMoEConfig(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, BLOCK_H=16)
NO_LORA = (None, None, None, None, None, 0, None)
PLAIN = (None, None, False, 1.702, None)  # no biases, concatenated gate/up, no clamp


@pytest.mark.parametrize("prepared", [False, True], ids=["plain", "prepared"])
@pytest.mark.parametrize("path", ["fused", "two_stage"])
def test_fused_moe_op_passes_opcheck(path, prepared):
    x, w1, w2, tw, ti = make_problem(9, 4, 40, 24, 2, torch.float16)
    w13, w2t, sizes = (w1, w2, (0, 0))
    if prepared:
        p = prepare_weights(w1, w2)
        w13, w2t, sizes = p.w13, p.w2, (40, 24)
    torch.library.opcheck(torch.ops.fmoe2.fused_moe.default,
                          (x, w13, w2t, tw, ti, "silu", None, path, SMALL.to_json(), *sizes, *NO_LORA, *PLAIN))


def test_fused_moe_op_with_lora_and_expert_map_passes_opcheck():
    x, w1, w2, tw, ti = make_problem(9, 4, 40, 24, 2, torch.float16)
    lora = prepare_lora(make_lora(2, 4, 40, 24, 16, torch.float16))
    ids = make_token_lora_ids(9, 2)
    expert_map = torch.tensor([0, -1, 1, 2], dtype=torch.int32, device=DEVICE)
    args = (x, w1, w2, tw, ti, "gelu", expert_map, "auto", "", 0, 0, lora.a13, lora.b13, lora.a2, lora.b2,
            lora.scaling, lora.rank, ids, *PLAIN)
    # opcheck compares the eager and the traced op's outputs with fp16's tolerance of 1e-3: the atomic down
    # projection sums each row's partial products in arrival order, so two runs may differ by an ulp (seen on
    # an H200 at 2.09: 0.002). The check runs deterministically (one summation order); the atomic path is
    # checked against the reference.
    deterministic = (None, None, None, True)  # w1_scale, w2_scale, block_shape, deterministic
    torch.library.opcheck(torch.ops.fmoe2.fused_moe.default, args + deterministic)
    for run in (args, args + deterministic):
        out = torch.ops.fmoe2.fused_moe(*run)
        assert_matches_reference(out, x, w1, w2, tw, ti, activation="gelu", expert_map=expert_map, lora=lora,
                                 token_lora_ids=ids)


@pytest.mark.parametrize("with_out", [False, True])
def test_moe_sorting_op_passes_opcheck(with_out):
    _, _, _, tw, ti = make_problem(13, 6, 32, 16, 2, torch.float16)
    out = torch.ones(13, 32, dtype=torch.float16, device=DEVICE) if with_out else None
    torch.library.opcheck(torch.ops.fmoe2.moe_sorting.default, (ti, tw, 6, 16, out, None))
    ids, weights, experts, padded, tiles = torch.ops.fmoe2.moe_sorting(ti, tw, 6, 16, out, None)
    expected = fmoe2.moe_sorting(ti, tw, 6, 16)
    for got, want in zip((ids, weights, experts, padded, tiles),
                         (expected.sorted_token_ids, expected.sorted_weights, expected.sorted_expert_ids,
                          expected.num_tokens_post_padded, expected.num_sorted_tiles)):
        assert torch.equal(got, want)
    if with_out:
        assert (out == 0).all()


class MoEBlock(torch.nn.Module):
    """Router + top-k + fmoe2.fused_moe + residual, as a model layer would call it."""

    def __init__(self, E=4, H=40, I=24, topk=2, prepared=True, lora=False):
        super().__init__()
        x, w1, w2, _, _ = make_problem(1, E, H, I, topk, torch.float16, seed=E)
        self.topk, self.w1, self.w2 = topk, w1, w2
        self.router = torch.nn.Linear(H, E, bias=False).to(device=DEVICE, dtype=torch.float16)
        self.weights = (prepare_weights(w1, w2), None) if prepared else (w1, w2)
        self.lora = prepare_lora(make_lora(2, E, H, I, 16, torch.float16)) if lora else None

    def routing(self, x):
        return torch.topk(self.router(x).float().softmax(-1), self.topk, dim=-1)

    def forward(self, x, lora_ids=None):
        weights, ids = self.routing(x)
        extra = dict(lora=self.lora, token_lora_ids=lora_ids) if self.lora is not None else {}
        return x + fused_moe(x, *self.weights, weights, ids, config=SMALL, **extra)


@pytest.mark.parametrize("prepared,lora", [(True, False), (False, False), (True, True)])
def test_compiled_module_traces_fused_moe_without_graph_breaks(prepared, lora):
    torch._dynamo.reset()
    block = MoEBlock(prepared=prepared, lora=lora)
    x = make_problem(11, 4, 40, 24, 2, torch.float16, seed=3)[0]
    lora_ids = make_token_lora_ids(11, 2) if lora else None
    with torch.no_grad():
        eager = block(x, lora_ids)
        compiled = torch.compile(block, fullgraph=True, backend="aot_eager")(x, lora_ids)  # raises on a graph break
    # The interpreter adds in a fixed order: the same bits. On a GPU the order of the atomic adds varies from call to
    # call (seen: 1 of 440 fp16 elements one step apart, H200), so the last bits may differ.
    tol = 0 if DEVICE == "cpu" else 2e-3
    torch.testing.assert_close(compiled, eager, rtol=tol, atol=tol)
    weights, ids = block.routing(x)
    extra = dict(lora=block.lora, token_lora_ids=lora_ids) if lora else {}
    assert_matches_reference(compiled - x, x, block.w1, block.w2, weights, ids, **extra)


def test_compiled_call_fills_out_and_sorts():
    torch._dynamo.reset()
    x, w1, w2, tw, ti = make_problem(9, 4, 40, 24, 2, torch.float16, seed=4)

    def f(x, tw, ti, out):
        fused_moe(x, w1, w2, tw, ti, out=out, config=SMALL)
        sorting = fmoe2.moe_sorting(ti, tw, 4, 16)
        return out, sorting.sorted_token_ids, sorting.num_sorted_tiles

    out = poisoned(9, 40, torch.float16)
    with torch.no_grad():
        got, token_ids, tiles = torch.compile(f, fullgraph=True, backend="aot_eager")(x, tw, ti, out)
    assert_matches_reference(out, x, w1, w2, tw, ti)
    expected = fmoe2.moe_sorting(ti, tw, 4, 16)
    assert torch.equal(token_ids, expected.sorted_token_ids) and torch.equal(tiles, expected.num_sorted_tiles)


def test_compiled_module_takes_the_deterministic_switch_when_traced(deterministic_off, monkeypatch):
    # fmoe2.set_deterministic(True) before torch.compile traces a module that calls fused_moe without the
    # argument: the traced op runs deterministic mode (its launches end with the combine), bitwise as eagerly.
    fm = importlib.import_module("fmoe2.gemm.launches")  # the launch descriptions

    names = []
    real = fm.forward_specs
    monkeypatch.setattr(fm, "forward_specs", lambda *a: (lambda specs: names.extend(s.name for s in specs) or specs)(
        real(*a)))
    torch._dynamo.reset()
    block = MoEBlock()
    x = make_problem(11, 4, 40, 24, 2, torch.float16, seed=5)[0]
    fmoe2.set_deterministic(True)
    with torch.no_grad():
        compiled = torch.compile(block, fullgraph=True, backend="aot_eager")(x)
        assert names and names[-1] == "combine" and "fused" not in names
        weights, ids = block.routing(x)
        eager = x + fused_moe(x, *block.weights, weights, ids, config=SMALL, deterministic=True)
    assert torch.equal(compiled, eager)
    assert_matches_reference(compiled - x, x, block.w1, block.w2, weights, ids)


def test_a_dict_mutated_before_the_call_breaks_no_graph():
    """A traced step that mutates a dict before calling fused_moe (transformers' Qwen2-MoE and OLMoE decode steps do)
    still compiles as one graph: packing the op's arguments reads no dataclass field's metadata (a mappingproxy, which
    Dynamo will not read after a dict mutation)."""
    x, w1, w2, tw, ti = make_problem(5, 4, 40, 24, 2, torch.float16)
    state = {"calls": 0}

    def step(x, tw, ti):
        state["calls"] = state["calls"] + 1
        return fused_moe(x, w1, w2, tw, ti, config=SMALL)

    out = torch.compile(step, fullgraph=True, backend="aot_eager")(x, tw, ti)
    assert state["calls"] == 1
    assert_matches_reference(out, x, w1, w2, tw, ti)


@pytest.mark.parametrize("name", ["16bit", "int8"])
def test_prepared_weights_rebuilt_from_buffers_inside_a_compiled_forward(name):
    # A module keeping prepared tensors as buffers rebuilds its PreparedMoEWeights in forward (from_prepared: checked
    # against its format there): one graph, the same answer.
    torch._dynamo.reset()
    x, w1, w2, tw, ti = make_problem(7, 4, 40, 24, 2, torch.float16, seed=6)
    if name == "int8":
        from fmoe2 import int8

        (q1, s1), (q2, s2) = int8.quantize_int8(w1), int8.quantize_int8(w2)
        prepared = prepare_weights(q1, q2, w1_scale=s1, w2_scale=s2)
    else:
        prepared = prepare_weights(w1, w2)

    def step(x, tw, ti):
        experts = fmoe2.PreparedMoEWeights.from_prepared(prepared.w13, prepared.w2, 40, 24, s13=prepared.s13,
                                                         s2=prepared.s2, scale_block=prepared.scale_block)
        return fused_moe(x, experts, None, tw, ti, config=SMALL)

    with torch.no_grad():
        out = torch.compile(step, fullgraph=True, backend="aot_eager")(x, tw, ti)
    tol = 0 if DEVICE == "cpu" else 2e-3
    torch.testing.assert_close(out, fused_moe(x, prepared, None, tw, ti, config=SMALL), rtol=tol, atol=tol)
