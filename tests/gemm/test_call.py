"""The call description (fmoe2/gemm/call.py): one field per argument of ``fused_moe``, from which the checks, the
op's schema and packing, and the plan's inputs are read; ``call_key`` (hand-written for speed) writes its
addresses in the order the description gives. No kernel runs here."""
import inspect
from dataclasses import MISSING, replace
from types import SimpleNamespace

import pytest
import torch

from fmoe2 import fused_moe, prepare_lora, prepare_weights
from fmoe2.activations import SWIGLU_ALPHA
from fmoe2.gemm.call import (INPUT_SOURCES, KEYWORDS, LEAVES, OP_ORDER, OUT_SOURCE, REQUIRED_SOURCES, MoECall,
                             checked_sources, op_schema)
from fmoe2.gemm.fused_moe import BASE_KEY_ALIGNED, call_key, key_aligned
from helpers import make_lora, make_problem, make_token_lora_ids


def test_the_description_has_one_field_per_keyword_of_fused_moe():
    public = inspect.signature(fused_moe).parameters
    assert tuple(public) == KEYWORDS
    assert tuple(inspect.signature(call_key).parameters) == KEYWORDS  # (positional on the hot path)
    assert set(LEAVES) == set(KEYWORDS) and sorted(OP_ORDER) == sorted(KEYWORDS)
    for name, p in public.items():
        default = LEAVES[name].default
        assert (default is MISSING) == (p.default is inspect.Parameter.empty), name
        if name == "deterministic":  # fused_moe's None (the global switch) is resolved before the description
            assert p.default is None and default is False
        elif default is not MISSING:
            assert default == p.default, name


def test_bind_and_arguments_round_trip():
    x, w1, w2, tw, ti = make_problem(3, 4, 32, 16, 2, torch.float16)
    call = MoECall.bind(x, w1, w2, tw, ti, "gelu", path="two_stage", swiglu_limit=None)
    args = call.arguments()
    assert tuple(args) == KEYWORDS
    assert args["activation"] == "gelu" and args["path"] == "two_stage" and args["swiglu_alpha"] == SWIGLU_ALPHA
    assert call.routing.topk_ids is ti and call.weights.w2 is w2 and call.options.deterministic is False
    assert MoECall.bind(**args) == call
    with pytest.raises(TypeError, match="unexpected keyword"):
        MoECall.bind(x, w1, w2, tw, ti, bias=None)
    with pytest.raises(TypeError, match="missing required"):
        MoECall.bind(x, w1, w2, tw)
    with pytest.raises(TypeError, match="multiple values"):
        MoECall.bind(x, w1, w2, tw, ti, "silu", activation="gelu")


@pytest.mark.parametrize("prepared", [False, True])
def test_the_op_packing_round_trips(prepared):
    x, w1, w2, tw, ti = make_problem(5, 4, 32, 16, 2, torch.float16)
    b1, b2 = (torch.randn(4, 32, dtype=torch.float16, device=x.device) for _ in range(2))
    lora = prepare_lora(make_lora(2, 4, 32, 16, 8, torch.float16))
    ids = make_token_lora_ids(5, 2)
    weights = (dict(w1=prepare_weights(w1, w2, w1_bias=b1, w2_bias=b2), w2=None) if prepared else
               dict(w1=w1, w2=w2, w1_bias=b1, w2_bias=b2))
    call = MoECall.bind(x, topk_weights=tw, topk_ids=ti, activation="swiglu_oai", swiglu_limit=7.0, lora=lora,
                        token_lora_ids=ids, deterministic=True, **weights)
    values = call.op_values()
    assert len(values) == len(op_schema().split(", ")) == 27
    back = MoECall.from_op(values).arguments()
    for name, value in call.arguments().items():
        if name == "w1" and prepared:
            for part in ("w13", "w2", "b13", "b2", "hidden_size", "intermediate_size"):
                assert getattr(back["w1"], part) is getattr(value, part)
        elif name == "lora":
            for part in ("a13", "b13", "a2", "b2", "scaling", "rank", "hidden_size", "intermediate_size"):
                assert getattr(back["lora"], part) is getattr(value, part)
        else:
            assert back[name] is value or back[name] == value, name


def test_call_key_writes_each_address_in_the_slot_the_description_names():
    # Every source given, each its own tensor: call_key's list of addresses must be checked_sources' (the
    # addresses the first, checked call binds the launches to), slot by slot.
    x, w1, w2, tw, ti = make_problem(5, 4, 32, 16, 2, torch.float16)
    lora = prepare_lora(make_lora(2, 4, 32, 16, 8, torch.float16))
    given = dict(out=torch.empty_like(x), expert_map=torch.arange(4, dtype=torch.int32),
                 token_lora_ids=make_token_lora_ids(5, 2), w1_bias=torch.randn(4, 32, dtype=torch.float16),
                 w2_bias=torch.randn(4, 32, dtype=torch.float16), w1_scale=torch.ones(4), w2_scale=torch.ones(4))
    call = MoECall.bind(x, w1, w2, tw, ti, lora=lora, **given)
    key, addresses = call_key(**call.arguments())
    problem = SimpleNamespace(x=x, w1=w1, w2=w2, lora=lora, **{k: v for k, v in given.items()
                                                               if k not in ("out", "expert_map")})
    tensors = checked_sources(problem, tw, ti, given["out"], given["expert_map"])
    assert all(t is not None for t in tensors) and len({t.data_ptr() for t in tensors}) == len(INPUT_SOURCES)
    assert addresses == [t.data_ptr() for t in tensors], INPUT_SOURCES
    assert INPUT_SOURCES[OUT_SOURCE] == "out" and REQUIRED_SOURCES == 5  # (call_key's base key covers the first 5)
    assert set(INPUT_SOURCES[:REQUIRED_SOURCES]) == {"hidden_states", "w1", "w2", "topk_weights", "topk_ids"}
    assert key[BASE_KEY_ALIGNED] is True and key_aligned(key)


def _off_16_bytes(tensor):
    """A copy of ``tensor`` whose address is one element (2 or 4 bytes) past a 16-byte boundary."""
    off = torch.empty(tensor.numel() + 1, dtype=tensor.dtype)[1:].view(tensor.shape)
    return off.copy_(tensor)


def _every_source_given():
    x, w1, w2, tw, ti = make_problem(5, 4, 32, 16, 2, torch.float16)
    return dict(MoECall.bind(
        x, w1, w2, tw, ti, lora=prepare_lora(make_lora(2, 4, 32, 16, 8, torch.float16)),
        out=torch.empty_like(x), expert_map=torch.arange(4, dtype=torch.int32),
        token_lora_ids=make_token_lora_ids(5, 2),
        w1_bias=torch.randn(4, 32, dtype=torch.float16), w2_bias=torch.randn(4, 32, dtype=torch.float16),
        w1_scale=torch.ones(4), w2_scale=torch.ones(4)).arguments())


@pytest.mark.parametrize("source", INPUT_SOURCES)
def test_call_key_reads_a_call_with_any_pointer_off_16_bytes_as_unaligned(source):
    # Only a call whose every pointer is 16-byte aligned may run launches bound to another call's pointers (the
    # JIT specialises alignment): any one input or output 2 or 4 bytes off must read as unaligned.
    arguments = _every_source_given()
    assert key_aligned(call_key(**arguments)[0])
    if source.startswith("lora."):
        part = source.split(".")[1]
        lora = arguments["lora"]
        moved = dict(arguments, lora=replace(lora, **{part: _off_16_bytes(getattr(lora, part))}))
    else:
        moved = dict(arguments, **{source: _off_16_bytes(arguments[source])})
    key = call_key(**moved)[0]
    assert not key_aligned(key), source
    # (the five every call has: at the fixed place BASE_KEY_ALIGNED)
    assert key[BASE_KEY_ALIGNED] is (INPUT_SOURCES.index(source) >= REQUIRED_SOURCES), source


@pytest.mark.parametrize("given", [(), ("out",), ("expert_map",), ("out", "expert_map")])
def test_call_key_of_fewer_optional_tensors_reads_alignment_alike(given):
    x, w1, w2, tw, ti = make_problem(5, 4, 32, 16, 2, torch.float16)
    extra = {"out": torch.empty_like(x), "expert_map": torch.arange(4, dtype=torch.int32)}
    arguments = dict(MoECall.bind(x, w1, w2, tw, ti, **{k: extra[k] for k in given}).arguments())
    assert key_aligned(call_key(**arguments)[0])
    for name in ("hidden_states", "w2", "topk_ids") + tuple(given):
        assert not key_aligned(call_key(**dict(arguments, **{name: _off_16_bytes(arguments[name])}))[0]), name
