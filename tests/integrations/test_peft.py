"""PEFT LoRA adapters of MoE experts served by fmoe2 (fmoe2/integrations/peft.py), against PEFT itself.

Tiny random transformers models (tiny_models.py); four adapters made by PEFT (``target_parameters``,
random factors: ``init_lora_weights=False``), ranks 8 and 16, one with rsLoRA, one of down_proj only and
one that also targets attention projections (kept as PEFT's layers),
saved by PEFT and loaded from the folder (one from its state dict). The reference of each adapter is PEFT's
own forward of the float32 model (the experts computed eagerly on ``W + dW``).

CPU: the model in float32 under the interpreter, within 1e-4 of it. GPU: the model in bf16, each sequence
within 5e-2 of the float32 forward, or within 1.5x of the error of PEFT's own bf16 forward on transformers'
``eager`` or ``grouped_mm`` experts where that is larger: on the GPU, tiny Mixtral's last sequence under
``attn_r8`` routes one token to another expert in bf16 on ``grouped_mm`` as in fmoe2 (0.32 from float32 in
both), which compares rounding luck, not adapters.
"""
import importlib.util
from typing import NamedTuple

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("transformers")

import fmoe2.integrations.transformers  # noqa: E402,F401  (registers "fmoe2")
from fmoe2.integrations.peft import load_adapters  # noqa: E402
from helpers import DEVICE, rel_error  # noqa: E402
from tiny_models import available, build  # noqa: E402

DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
# fp32: summation order only. bf16: PEFT rounds W + dW to bf16, fmoe2 adds the delta in its kernels.
TOL = 3e-2 if DTYPE == torch.bfloat16 else 1e-4
# Against the float32 forward: bf16 logits of these models are 1-3.5e-2 from it per sequence in every backend.
FLOAT32_TOL = 5e-2 if DTYPE == torch.bfloat16 else 1e-4
BF16_SLACK = 1.5  # x the error of PEFT's own bf16 forward, where a backend's rounding flips a token's experts
BOTH = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
ADAPTERS = {  # name -> LoraConfig arguments
    "r8": dict(r=8, lora_alpha=16, target_parameters=BOTH),
    "r16_rslora": dict(r=16, lora_alpha=8, use_rslora=True, target_parameters=BOTH),
    "down_r8": dict(r=8, lora_alpha=8, target_parameters=["mlp.experts.down_proj"]),
    # also attention: those parts stay PEFT's own layers, selected per sequence by PEFT's mixed-batch forward
    "attn_r8": dict(r=8, lora_alpha=8, target_modules=["q_proj", "v_proj"], target_parameters=BOTH),
}
INPUT_IDS = torch.tensor([[3, 17, 99, 5, 42, 8, 120], [7, 7, 64, 1, 88, 15, 2], [11, 90, 33, 4, 4, 61, 100],
                          [127, 0, 56, 23, 9, 77, 31]])
MODEL_TYPES = [pytest.param(n, marks=pytest.mark.skipif(not available(n), reason=f"{n} is not in this transformers"))
               for n in ("qwen3_moe", "mixtral", "gpt_oss")]


def _logits(model, input_ids=INPUT_IDS):
    with torch.no_grad():
        return model(input_ids.to(DEVICE)).logits.float()


class Reference(NamedTuple):
    """The float32 forward's logits ``[B, S, V]`` and the relative error allowed per sequence (module docstring)."""
    logits: torch.Tensor
    row_tol: list

    def check(self, ours, rows=None, context=()):
        for row in range(self.logits.shape[0]) if rows is None else rows:
            error = rel_error(ours[row], self.logits[row])
            assert error <= self.row_tol[row], (*context, row, error, self.row_tol[row])


def _reference(model) -> Reference:
    """``model`` (a float32 transformers model or PeftModel on DEVICE): its logits; on the GPU also the
    allowance of PEFT's / transformers' own bf16 forwards (``model`` is cast to bf16 for them)."""
    truth = _logits(model)
    rows = truth.shape[0]
    if DTYPE == torch.float32:
        return Reference(truth, [FLOAT32_TOL] * rows)
    low = model.to(DTYPE)
    inner = low.get_base_model() if hasattr(low, "get_base_model") else low
    worst = [0.0] * rows
    for implementation in ("eager", "grouped_mm"):
        inner.set_experts_implementation(implementation)
        theirs = _logits(low)
        worst = [max(w, rel_error(theirs[r], truth[r])) for r, w in enumerate(worst)]
    return Reference(truth, [max(FLOAT32_TOL, BF16_SLACK * w) for w in worst])


def _peft_adapter(model_type, name, seed):
    from peft import LoraConfig, get_peft_model

    base = build(model_type, dtype=torch.float32, device=DEVICE)
    torch.manual_seed(seed)
    config = LoraConfig(**{"target_modules": [], **ADAPTERS[name]}, init_lora_weights=False)
    return get_peft_model(base, config).eval()


@pytest.fixture(scope="module", params=MODEL_TYPES)
def adapters(request, tmp_path_factory):
    """PEFT's adapters of one tiny model (float32 factors): name -> (saved folder, state dict and config, the
    Reference of PEFT's forward), and the base model's Reference."""
    from peft import get_peft_model_state_dict

    model_type = request.param
    made = {}
    for seed, name in enumerate(ADAPTERS):
        peft_model = _peft_adapter(model_type, name, seed)
        folder = tmp_path_factory.mktemp(f"{model_type}_{name}")
        peft_model.save_pretrained(folder)
        pair = (get_peft_model_state_dict(peft_model), peft_model.peft_config["default"])
        made[name] = (folder, pair, _reference(peft_model))
    return model_type, made, _reference(build(model_type, dtype=torch.float32, device=DEVICE))


def _fmoe2_model(model_type):
    model = build(model_type, dtype=DTYPE, device=DEVICE)
    model.set_experts_implementation("fmoe2")
    return model


def _load(model, made, from_state_dict=("down_r8",)):
    sources = {name: (pair if name in from_state_dict else folder) for name, (folder, pair, _) in made.items()}
    return load_adapters(model, sources)


def test_each_adapter_matches_peft(adapters):
    model_type, made, base = adapters
    model = _fmoe2_model(model_type)
    loaded = _load(model, made)
    assert loaded.names == list(ADAPTERS)
    for name, (_, _, reference) in made.items():
        assert rel_error(reference.logits, base.logits) > 0.15, name  # the adapter changes the logits
        with loaded.use([name] * INPUT_IDS.shape[0]):
            ours = _logits(model)
        reference.check(ours, context=(model_type, name))


def test_mixed_batch_equals_each_adapter_row_by_row(adapters):
    model_type, made, base = adapters
    model = _fmoe2_model(model_type)
    plain = _logits(model)
    loaded = _load(model, made)
    assert torch.equal(_logits(model), plain)  # outside use(): the base model, no LoRA work
    mixed = ["attn_r8", None, "down_r8", "r16_rslora"]
    with loaded.use(mixed):
        ours = _logits(model)
    for row, name in enumerate(mixed):
        (base if name is None else made[name][2]).check(ours, rows=[row], context=(model_type, name))
    with loaded.use([-1, 0, -1, 2]):  # indices: -1 the base model
        by_index = _logits(model)
    made["r8"][2].check(by_index, rows=[1], context=(model_type, 0))
    made["down_r8"][2].check(by_index, rows=[3], context=(model_type, 2))
    assert torch.equal(_logits(model), plain)  # after use(): the base model again, PEFT's layers included
    base.check(by_index, rows=[0, 2], context=(model_type, -1))


def test_generate_mixes_adapters_per_sequence(adapters):
    model_type, made, _ = adapters
    if model_type != "qwen3_moe":
        pytest.skip("one family is enough for generate")
    model = _fmoe2_model(model_type)
    loaded = _load(model, made)
    prompts = INPUT_IDS[:3].to(DEVICE)
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad(), loaded.use(["attn_r8", None, "r16_rslora"]):
        mixed = model.generate(prompts, **kwargs)
    for row, name in enumerate(["attn_r8", None, "r16_rslora"]):
        with torch.no_grad(), loaded.use([name]):
            alone = model.generate(prompts[row:row + 1], **kwargs)
        assert torch.equal(mixed[row], alone[0]), (row, name)


def test_refused_adapters_and_selections(adapters, tmp_path):
    from peft import LoraConfig, get_peft_model

    model_type, made, _ = adapters
    model = _fmoe2_model(model_type)
    folder, (state, config), _ = made["r8"]
    with pytest.raises(ValueError, match="not a LoRA factor of a linear layer"):
        norm = {"model.layers.0.input_layernorm.lora_A.weight": torch.zeros(8, 4)}
        load_adapters(model, {"a": (dict(state, **norm), dict(config.to_dict(), target_modules=["input_layernorm"]))})
    attention_state, attention_config = made["attn_r8"][1]
    only_q = dict(attention_config.to_dict(), target_modules=["q_proj"])  # its v_proj factors: named by no target
    with pytest.raises(ValueError, match="v_proj.lora_A.weight is not a LoRA factor"):
        load_adapters(model, {"a": (attention_state, only_q)})
    q_key = next(k for k in attention_state if "q_proj.lora_A" in k)
    wrong_q = dict(attention_state, **{q_key: attention_state[q_key][:4]})
    with pytest.raises(ValueError, match="q_proj.lora_A.weight has shape"):
        load_adapters(model, {"a": (wrong_q, attention_config)})
    no_q = {k: v for k, v in attention_state.items() if "layers.1.self_attn.q_proj" not in k}
    with pytest.raises(ValueError, match="no model.layers.1.self_attn.q_proj.lora_A.weight"):
        load_adapters(model, {"a": (no_q, attention_config)})
    with pytest.raises(ValueError, match="modules_to_save"):
        load_adapters(model, {"a": (state, dict(config.to_dict(), modules_to_save=["lm_head"]))})
    with pytest.raises(ValueError, match="without dots"):
        load_adapters(model, {"a.b": folder})
    with pytest.raises(ValueError, match="use_dora"):
        load_adapters(model, {"a": (state, dict(config.to_dict(), use_dora=True))})
    with pytest.raises(ValueError, match="rank_pattern"):
        load_adapters(model, {"a": (state, dict(config.to_dict(), rank_pattern={"layers.0": 4}))})
    with pytest.raises(ValueError, match="not found"):
        load_adapters(model, {"a": tmp_path})
    wrong_rank = dict(config.to_dict(), r=4)  # factors of rank 8 read as rank 4: shapes do not match
    with pytest.raises(ValueError, match=r"\[E\*r, in\]"):
        load_adapters(model, {"a": (state, wrong_rank)})
    extra = dict(state, **{"model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(8, 4)})
    with pytest.raises(ValueError, match="match no experts module"):
        load_adapters(model, {"a": (extra, config)})
    missing = {k: v for k, v in state.items() if ".layers.1." not in k}
    with pytest.raises(ValueError, match="no model.layers.1"):
        load_adapters(model, {"a": (missing, config)})
    with pytest.raises(ValueError, match="PEFT layer fmoe2 did not load"):
        from peft import inject_adapter_in_model

        users_own = _fmoe2_model(model_type)
        inject_adapter_in_model(LoraConfig(r=4, target_modules=["q_proj"]), users_own, adapter_name="own")
        load_adapters(users_own, {"a": folder})
    with pytest.raises(ValueError, match="PeftModel|ParamWrapper"):
        load_adapters(get_peft_model(build(model_type), LoraConfig(r=4, target_modules=[], target_parameters=BOTH)),
                      {"a": folder})
    assert not any(hasattr(m, "fmoe2_adapters") for m in model.modules())  # nothing loaded by a refused call
    loaded = load_adapters(model, {"a": folder})
    with pytest.raises(ValueError, match="no adapter named"):
        with loaded.use(["b"]):
            pass
    for selection in (["a", None, "a"], ["a", None, "a", "a"]):  # 2 sequences: neither 3 nor 4 adapters fit
        with pytest.raises(ValueError, match="a batch of 2 sequences"):
            with loaded.use(selection):
                _logits(model, INPUT_IDS[:2])
    model.set_experts_implementation("eager")  # a backend that would ignore the adapters
    with pytest.raises(ValueError, match="ignores fmoe2's adapters"):
        with loaded.use(["a"]):
            pass
    model.set_experts_implementation("fmoe2")
    with loaded.use(["a", "a"]):
        model.set_experts_implementation("grouped_mm")  # switched inside the block: the forward raises
        with pytest.raises(ValueError, match="ignores fmoe2's adapters"):
            _logits(model, INPUT_IDS[:2])
    model.set_experts_implementation("fmoe2")
    later = load_adapters(model, {"b": folder})  # replaces the first set: selecting it is an error, not a no-op
    with pytest.raises(ValueError, match="no longer on the model"):
        with loaded.use(["a"]):
            pass
    later.unload()
    assert not any(hasattr(m, "fmoe2_adapters") for m in model.modules()) and not hasattr(model, "peft_config")
    with_attention = load_adapters(model, {"c": made["attn_r8"][0]})
    q_proj = model.model.layers[0].self_attn.q_proj
    assert type(q_proj).__module__.startswith("peft") and "c" in q_proj.lora_A
    with_attention.unload()  # PEFT's layers go too: the model's own modules are back
    assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    with pytest.raises(ValueError, match="no longer on the model"):
        with later.use(["b"]):
            pass


def test_selected_adapters_are_never_dropped_by_a_fallback(adapters):
    # A call transformers' grouped_mm would have to run (here: gradients) cannot carry fmoe2's adapters: it raises.
    model_type, made, _ = adapters
    model = _fmoe2_model(model_type)
    loaded = _load(model, made)
    model.requires_grad_(True)
    with loaded.use(["r8"] * 2), pytest.raises(RuntimeError, match="LoRA adapters selected"):
        model(INPUT_IDS[:2].to(DEVICE))


@pytest.mark.skipif(importlib.util.find_spec("safetensors") is None, reason="safetensors missing")
def test_saved_keys_are_read_as_peft_nests_them(adapters):
    # PEFT nests one ParamWrapper per targeted parameter in the order the experts module registers them: with
    # both targeted, ".base_layer.lora_*" is gate_up_proj and the outer "lora_*" down_proj. The factors' own
    # shapes say which is which ([E*r, H] against [E*r, I]).
    from safetensors.torch import load_file

    model_type, made, _ = adapters
    state = load_file(str(made["r8"][0] / "adapter_model.safetensors"))
    experts = [m for m in build(model_type).modules() if hasattr(m, "gate_up_proj")][0]
    E, H = experts.gate_up_proj.shape[0], build(model_type).config.hidden_size
    inner = [v for k, v in state.items() if "layers.0.mlp.experts.base_layer.lora_A" in k]
    outer = [v for k, v in state.items() if k.endswith("layers.0.mlp.experts.lora_A.weight")]
    assert inner[0].shape == (E * 8, H) and outer[0].shape[0] == E * 8 and outer[0].shape[1] != H


BENCH_IDS = torch.tensor([[3, 17, 99, 5], [7, 7, 64, 1], [11, 90, 33, 4]])


# The PEFT decode benchmark (fmoe2/bench/peft_decode.py) without a GPU: its adapters made by PEFT on one copy
# of the model and loaded into fmoe2 on a second copy with the same weights, as its main() does; and its report.
def test_the_benchmarks_adapters_run_through_fmoe2_as_through_peft():
    from fmoe2.bench.peft_decode import make_adapters

    peft_model, pairs = make_adapters(build("qwen3_moe", dtype=DTYPE, device=DEVICE), 3, 4)
    with torch.no_grad():
        references = {}
        for name in pairs:
            peft_model.set_adapter(name)
            references[name] = peft_model(BENCH_IDS.to(DEVICE)).logits.float()
    model = _fmoe2_model("qwen3_moe")
    loaded = load_adapters(model, pairs)
    names = loaded.names
    with torch.no_grad(), loaded.use([names[b % len(names)] for b in range(3)]):  # the "mixed" selection
        mixed = model(BENCH_IDS.to(DEVICE)).logits.float()
    for b in range(3):
        assert rel_error(mixed[b], references[names[b]][b]) <= TOL


def test_the_benchmarks_report_has_each_variant_and_both_ratios():
    from fmoe2.bench.peft_decode import VARIANTS, markdown

    rows = [dict(variant=v, batch=b, decode_tokens_per_s=r) for b in (1, 8)
            for v, r in zip(VARIANTS, (100.0, 95.0, 90.0, 20.0))]
    rows.append(dict(variant="peft", batch=64, error="OutOfMemoryError: CUDA out of memory"))
    rows.append(dict(variant="base", batch=64, decode_tokens_per_s=1000.0))
    result = dict(device="GPU", date="2026-11-26", torch="2.11", triton="3.6", command="python -m fmoe2.bench.peft_decode",
                  model="qwen3-30b-a3b", layers=4, adapters=4, rank=16, peft_backend="grouped_mm", prompt=64,
                  new_tokens=32, rows=rows)
    text = markdown(result)
    assert "| 1 | 100.0 | 95.0 | 90.0 | 20.0 | 1.11x | 4.75x |" in text
    assert "| 64 | 1000.0 | - | - | OutOfMemoryError" in text


def test_layer_specific_targets_follow_peft_matching(tmp_path):
    # target_parameters naming one layer: PEFT matches the whole path or its end after a dot, so only that
    # layer's experts get factors (a plain suffix test would take "1.mlp..." for layer 11 too).
    from fmoe2.integrations.peft import _targets

    assert _targets("model.layers.1.mlp.experts.gate_up_proj", "1.mlp.experts.gate_up_proj")
    assert not _targets("model.layers.11.mlp.experts.gate_up_proj", "1.mlp.experts.gate_up_proj")
    from peft import LoraConfig, get_peft_model

    base = build("qwen3_moe", dtype=DTYPE, device=DEVICE)
    torch.manual_seed(7)
    targets = ["layers.1.mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=[], target_parameters=targets,
                                                 init_lora_weights=False)).eval()
    reference = _logits(peft_model)
    peft_model.save_pretrained(tmp_path)
    model = _fmoe2_model("qwen3_moe")
    loaded = load_adapters(model, {"a": tmp_path})
    assert loaded.modules[0].fmoe2_adapters.lora.a13[..., :4, :].abs().sum() == 0  # layer 0: no gate/up factors
    with loaded.use(["a"] * INPUT_IDS.shape[0]):
        assert rel_error(_logits(model), reference) <= TOL


@pytest.mark.skipif(DEVICE != "cpu", reason="a float32 model cast to float16 under the interpreter")
def test_factors_follow_the_model_to_another_dtype(adapters):
    model_type, made, _ = adapters
    model = _fmoe2_model(model_type)
    loaded = _load(model, made)
    model.to(torch.float16)
    with loaded.use(["r8"] * INPUT_IDS.shape[0]):
        ours = _logits(model)
    assert rel_error(ours, made["r8"][2].logits) <= 1e-2


@pytest.mark.skipif(not available("qwen2_moe"), reason="qwen2_moe is not in this transformers")
def test_adapters_of_shared_experts_get_each_tokens_adapter(tmp_path):
    # Qwen2-MoE's shared expert sees the batch flattened to tokens ([B*S, H]): PEFT's layer there gets one
    # adapter name per token, the sequence's.
    from peft import LoraConfig, get_peft_model

    targets = dict(target_modules=["shared_expert.gate_proj", "q_proj"], target_parameters=BOTH)
    references, folders = {}, {}
    for seed, name in enumerate(("s1", "s2")):
        torch.manual_seed(seed)
        peft_model = get_peft_model(build("qwen2_moe", dtype=DTYPE, device=DEVICE),
                                    LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **targets)).eval()
        references[name] = _logits(peft_model)
        folders[name] = tmp_path / name
        peft_model.save_pretrained(folders[name])
    model = build("qwen2_moe", dtype=DTYPE, device=DEVICE)
    model.set_experts_implementation("fmoe2")
    base = _logits(model)
    loaded = load_adapters(model, folders)
    with loaded.use(["s2", None, "s1", "s2"]):
        ours = _logits(model)
    for row, name in enumerate(["s2", None, "s1", "s2"]):
        reference = base if name is None else references[name]
        assert rel_error(ours[row], reference[row]) <= TOL, (row, name)
