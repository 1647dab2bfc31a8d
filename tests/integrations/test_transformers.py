"""fmoe2 as transformers' experts backend (fmoe2/integrations/transformers.py), against transformers' own
computation, on tiny random models of every MoE family in the installed transformers that has a recipe in
tiny_models.py: fmoe2's logits equal eager's; the families fmoe2 cannot compute fall back to grouped_mm, with
their reason; expert parallelism's sentinel ids are dropped. CPU: the Triton interpreter in fp32 (bf16 and
greedy decoding on the GPU: tests/test_gpu.py)."""
import importlib
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import fmoe2  # noqa: E402
import fmoe2.integrations.transformers as backend  # noqa: E402  (registers "fmoe2")
from helpers import DEVICE, rel_error  # noqa: E402
from tiny_models import FALLBACK, REQUIRED, SUPPORTED, available, build, experts_modules  # noqa: E402

INPUT_IDS = torch.tensor([[3, 17, 99, 5, 42, 8, 120], [7, 7, 64, 1, 88, 15, 2]])
FP32_TOL = 1e-4


def _families(names):
    return [pytest.param(n, marks=pytest.mark.skipif(not available(n), reason=f"{n} is not in this transformers"))
            for n in names]


def _logits(model, impl):
    model.set_experts_implementation(impl)
    with torch.no_grad():
        return model(INPUT_IDS.to(DEVICE)).logits.float()


@pytest.mark.parametrize("model_type", _families(SUPPORTED))
def test_family_logits_match_eager(model_type):
    model = build(model_type, device=DEVICE)
    experts = experts_modules(model)
    if not experts and model_type not in REQUIRED:
        # (aria_text in transformers 5.17: the family exists, its MoE layer is not yet an experts module)
        pytest.skip(f"{model_type} in transformers {transformers.__version__} has no experts module: its MoE layer "
                    "does not go through the experts backends")
    assert experts, f"{model_type}: no experts module"
    eager = _logits(model, "eager")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a supported family must not fall back
        ours = _logits(model, "fmoe2")
    assert rel_error(ours, eager) <= FP32_TOL, rel_error(ours, eager)
    for module in experts:
        spec = backend.experts_spec(module)
        assert not spec.fallback and spec.checked, (model_type, spec)
    # The experts matter: the same model without them gives other logits (the check above could not pass by
    # their output being negligible).
    for module in experts:
        module.down_proj.data.zero_()
        if getattr(module, "has_bias", False):
            module.down_proj_bias.data.zero_()
    assert rel_error(_logits(model, "eager"), eager) > 1e-2


@pytest.mark.parametrize("model_type", _families(list(FALLBACK)))
def test_families_fmoe2_cannot_compute_fall_back_with_their_reason(model_type):
    model = build(model_type, device=DEVICE)
    experts = experts_modules(model)
    for module in experts:
        spec = backend.classify(module)
        assert spec.fallback.startswith(FALLBACK[model_type]), (model_type, spec)
    eager = _logits(model, "eager")
    backend._warned.clear()
    with pytest.warns(UserWarning, match=f"runs transformers' grouped_mm instead: {FALLBACK[model_type]}"):
        ours = _logits(model, "fmoe2")
    assert rel_error(ours, eager) <= FP32_TOL


def test_required_families_are_supported():
    assert set(REQUIRED) <= set(SUPPORTED)


def _gpt_oss_experts():
    model = build("gpt_oss", device=DEVICE)
    return experts_modules(model)[0]


def test_gpt_oss_reads_its_clamped_swiglu_from_the_module():
    module = _gpt_oss_experts()
    spec = backend.experts_spec(module)
    assert (spec.activation, spec.gate_up_interleaved, spec.swiglu_alpha, spec.swiglu_limit) == (
        "swiglu_oai", True, pytest.approx(module.alpha), pytest.approx(module.limit))
    # Another limit on the module (not in the config): read from the module, checked against its gate.
    module.limit = 3.5
    del module._fmoe2_spec
    assert backend.experts_spec(module).swiglu_limit == 3.5


def test_a_gate_that_does_not_match_falls_back():
    # A module whose _apply_gate is swapped for something else: the check catches it, whatever the
    # attributes say.
    module = _gpt_oss_experts()
    module.limit = 7.0

    class Odd(type(module)):
        def _apply_gate(self, gate_up):
            return super()._apply_gate(gate_up) * 2  # not an activation fmoe2 computes

    Odd.__qualname__ = "GptOssExperts"  # even named like gpt-oss's own class
    module.__class__ = Odd
    Odd._apply_gate.__qualname__ = "GptOssExperts._apply_gate"
    spec = backend.experts_spec(module)
    assert spec.fallback.startswith("its gate") and "differs from fmoe2's swiglu_oai" in spec.fallback


def _experts_call(module, T=9, k=2, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    H = module.config.hidden_size
    hidden = torch.randn(T, H, generator=gen).to(DEVICE)
    E = module.gate_up_proj.shape[0]
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).to(DEVICE)
    weights = torch.rand(T, k, generator=gen).softmax(-1).to(DEVICE)
    return hidden, ids, weights


@pytest.mark.parametrize("model_type", _families(["qwen3_moe", "gpt_oss"]))
def test_expert_parallel_sentinels_are_dropped(model_type):
    # Under transformers' expert parallelism a rank's experts module holds its local experts and gets the ids
    # of experts on other ranks as ids >= num_experts with weight 0. A shard built by hand (the last 2 of 4
    # experts), its sentinel entries given a nonzero weight so an entry not dropped would show, against
    # transformers' eager computation of the same shard on the kept entries.
    model = build(model_type, device=DEVICE)
    module = experts_modules(model)[0]
    E = module.gate_up_proj.shape[0]
    shard = type(module)(module.config).to(DEVICE).eval()
    with torch.no_grad():
        for name, p in module.named_parameters(recurse=False):
            getattr(shard, name).data = p.data[E // 2:].clone()
    shard.num_experts = E // 2
    shard._is_expert_parallel = True
    hidden, ids, weights = _experts_call(module, T=11, k=2, seed=3)
    local = ids - E // 2
    sentinel = local < 0
    local = torch.where(sentinel, E // 2, local)  # the sentinel id: the local expert count
    shard.config._experts_implementation = "fmoe2"
    with torch.no_grad():
        ours = shard(hidden, local, torch.where(sentinel, torch.full_like(weights, 5.0), weights))
        shard.config._experts_implementation = "eager"
        kept = ~sentinel.any(dim=1)  # transformers' eager (5.17) cannot take sentinels: compare the kept rows
        reference = shard(hidden[kept], local[kept], weights[kept])
        single = sentinel.sum(dim=1) == 1  # rows with one local entry: their other slot must add nothing
        for row in torch.nonzero(single).flatten().tolist():
            slot = int(torch.nonzero(~sentinel[row])[0])
            one = shard(hidden[row:row + 1], local[row:row + 1, slot:slot + 1], weights[row:row + 1, slot:slot + 1])
            assert rel_error(ours[row:row + 1], one) <= FP32_TOL
    assert rel_error(ours[kept], reference) <= FP32_TOL
    assert (ours[sentinel.all(dim=1)] == 0).all()


@pytest.mark.parametrize("model_type", _families(["qwen3_moe", "gpt_oss"]))
def test_the_backend_follows_the_deterministic_switch(model_type, deterministic_off, monkeypatch):
    # With fmoe2.set_deterministic(True) the backend's calls run deterministic mode: the launches end with the
    # combine, and a token's row is bitwise the same alone as in a batch of 9 (what the mode promises).
    fm = importlib.import_module("fmoe2.gemm.launches")  # the launch descriptions

    names = []
    real = fm.forward_specs
    monkeypatch.setattr(fm, "forward_specs", lambda *a: (lambda specs: names.extend(s.name for s in specs) or specs)(
        real(*a)))
    module = experts_modules(build(model_type, device=DEVICE))[0]
    module.config._experts_implementation = "fmoe2"
    hidden, ids, weights = _experts_call(module, T=9, k=2, seed=4)
    fmoe2.set_deterministic(True)
    with torch.no_grad():
        batch = module(hidden, ids, weights)
        alone = [module(hidden[t:t + 1], ids[t:t + 1], weights[t:t + 1]) for t in (0, 8)]
        module.config._experts_implementation = "eager"
        reference = module(hidden, ids, weights)
    assert names and names[-1] == "combine" and "fused" not in names
    assert torch.equal(batch[0:1], alone[0]) and torch.equal(batch[8:9], alone[1])
    assert rel_error(batch, reference) <= FP32_TOL


def test_ids_and_weights_reach_the_kernels_as_they_come(monkeypatch):
    # int64 ids and bf16/fp32 routing weights: no cast (no extra launch) before fused_moe.
    import fmoe2.integrations.transformers as t

    seen = []
    real = t.fused_moe
    monkeypatch.setattr(t, "fused_moe", lambda *a, **k: seen.append((a[3].dtype, a[4].dtype)) or real(*a, **k))
    model = build("mixtral", device=DEVICE)
    _logits(model, "fmoe2")
    assert seen and all(ids == torch.int64 for _, ids in seen)
    weights_dtype = {w for w, _ in seen}
    assert weights_dtype == {torch.float32}


def test_no_lasting_copy_of_the_weights(monkeypatch):
    # fused_moe gets the module's parameters themselves (views of their storage), never a prepared copy.
    import fmoe2.integrations.transformers as t

    storages = []
    real = t.fused_moe
    monkeypatch.setattr(t, "fused_moe", lambda *a, **k: storages.append(
        (a[1].untyped_storage().data_ptr(), a[2].untyped_storage().data_ptr())) or real(*a, **k))
    model = build("gpt_oss", device=DEVICE)
    _logits(model, "fmoe2")
    params = {(m.gate_up_proj.untyped_storage().data_ptr(), m.down_proj.untyped_storage().data_ptr())
              for m in experts_modules(model)}
    assert set(storages) == params


def test_gradients_fall_back_to_transformers():
    model = build("qwen3_moe", device=DEVICE)
    model.set_experts_implementation("fmoe2")
    backend._warned.clear()
    with pytest.warns(UserWarning, match="fmoe2 is inference-only"):
        logits = model(INPUT_IDS.to(DEVICE)).logits
    logits.sum().backward()
    assert all(m.gate_up_proj.grad is not None for m in experts_modules(model))


@pytest.mark.parametrize("model_type,trained", [("qwen3_moe", "mlp.gate.weight"), ("gpt_oss", "experts.down_proj_bias")])
def test_a_gradient_through_the_routing_weights_or_a_bias_alone_falls_back(model_type, trained):
    # Frozen experts weights and a hidden state that needs no gradient (frozen embeddings), but a trained router
    # (its gradient reaches it through the routing weights only) or a trained expert bias: fmoe2 must not run
    # (its output would be detached: no gradient, silently), transformers' experts must.
    model = build(model_type, device=DEVICE)
    model.requires_grad_(False)
    params = [p for n, p in model.named_parameters() if n.endswith(trained)]
    assert params, trained
    grads = {}
    for impl in ("eager", "fmoe2"):
        for p in params:
            p.requires_grad_(True)
            p.grad = None
        model.set_experts_implementation(impl)
        backend._warned.clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model(INPUT_IDS.to(DEVICE)).logits.float().square().mean().backward()
        ours = [str(w.message) for w in caught if "fmoe2 experts backend" in str(w.message)]
        assert len(ours) == (impl == "fmoe2"), ours
        assert all(p.grad is not None for p in params), impl
        grads[impl] = torch.cat([p.grad.flatten() for p in params])
    assert "fmoe2 is inference-only" in ours[0]
    assert rel_error(grads["fmoe2"], grads["eager"]) <= FP32_TOL


def test_registration_is_idempotent_and_validated_by_transformers():
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    assert backend.register() == "fmoe2" and backend.register() == "fmoe2"
    assert ALL_EXPERTS_FUNCTIONS["fmoe2"] is backend.fmoe2_experts_forward
    model = build("mixtral", impl="fmoe2", device=DEVICE)  # from_config validates the name
    assert model.config._experts_implementation == "fmoe2"
    assert backend.register("fmoe2_other") == "fmoe2_other"
    model.set_experts_implementation("fmoe2_other")


@pytest.mark.parametrize("model_type", _families(["mixtral", "gpt_oss"]))
def test_compiled_model_traces_the_backend_without_graph_breaks(model_type):
    # The first fmoe2 call is the traced one: the module's spec is read from its attributes under tracing.
    torch._dynamo.reset()
    model = build(model_type, device=DEVICE)
    eager = _logits(model, "eager")
    model.set_experts_implementation("fmoe2")
    with torch.no_grad():
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")(INPUT_IDS.to(DEVICE), use_cache=False)
    assert rel_error(compiled.logits.float(), eager) <= FP32_TOL


def _fp8_experts(block_size, seed=0):
    """transformers' own fine-grained fp8 experts module (what DeepSeek-V3-style fp8 checkpoints load into),
    tiny, with e4m3 weights quantized from random ones and set to the fmoe2 backend."""
    finegrained = pytest.importorskip("transformers.integrations.finegrained_fp8")
    from transformers import Qwen3MoeConfig
    from transformers.integrations.moe import use_experts_implementation

    config = Qwen3MoeConfig(hidden_size=256, moe_intermediate_size=128, num_experts=4, num_experts_per_tok=2)
    config._experts_implementation = "fmoe2"
    cls = use_experts_implementation(experts_class=finegrained.FP8Experts,
                                     experts_interface=finegrained.ALL_FP8_EXPERTS_FUNCTIONS, has_bias=False,
                                     has_gate=True)
    module = cls(config=config, block_size=block_size)
    gen = torch.Generator().manual_seed(seed)
    if block_size is None:  # (its scales' layout fits no fmoe2 scheme: left as allocated)
        return module.to(DEVICE)
    with torch.no_grad():
        for name, fan_in in (("gate_up_proj", 256), ("down_proj", 128)):
            weight = getattr(module, name)
            q, scale = fmoe2.quantize_fp8_weights(torch.randn(weight.shape, generator=gen) / fan_in ** 0.5, "block",
                                                  tuple(block_size))
            assert scale.shape == getattr(module, f"{name}_scale_inv").shape
            setattr(module, name, torch.nn.Parameter(q, requires_grad=False))
            setattr(module, f"{name}_scale_inv", torch.nn.Parameter(scale, requires_grad=False))
    return module.to(DEVICE)


@pytest.mark.parametrize("block_size", [[128, 128], [64, 256]], ids=["128x128", "64x256"])
def test_fp8_experts_of_transformers_run_on_fmoe2(block_size):
    from fmoe2.fp8 import dequantize_weights, weight_scale_view

    module = _fp8_experts(block_size)
    if torch.float8_e4m3fn not in backend.target_of(DEVICE).fp8_dtypes:
        pytest.skip("no fp8 matrix instructions here")
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float16
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(11, 256, generator=gen).to(DEVICE, dtype)
    weights, ids = torch.topk(torch.randn(11, 4, generator=gen).softmax(-1), 2)
    weights, ids = weights.to(DEVICE), ids.to(DEVICE)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback to grouped_mm would warn
        with torch.no_grad():
            out = module(x, ids, weights)
    block = tuple(block_size)
    scales = dict(w1_scale=module.gate_up_proj_scale_inv, w2_scale=module.down_proj_scale_inv, block_shape=block)
    same = fmoe2.fused_moe_reference(x, module.gate_up_proj, module.down_proj, weights, ids, **scales)
    assert rel_error(out, same) <= 1e-2
    # transformers' own semantics: its dequantized weights in the gated MLP (no activation quantization).
    w1 = dequantize_weights(module.gate_up_proj, *weight_scale_view("s", scales["w1_scale"], 4, 256, 256, block)[:3])
    w2 = dequantize_weights(module.down_proj, *weight_scale_view("s", scales["w2_scale"], 4, 256, 128, block)[:3])
    assert rel_error(out, fmoe2.fused_moe_reference(x.float(), w1, w2, weights, ids)) <= 0.1


def test_fp8_experts_fall_back_where_fmoe2_cannot_run_them():
    module = _fp8_experts([128, 128])
    x = torch.randn(3, 256, device=DEVICE, dtype=torch.float16)
    module.activation_scheme = "static"
    assert "activation_scheme='static'" in backend.fp8_call_fallback_reason(module, x)
    module.activation_scheme = "dynamic"
    module.block_size = [128, 64]
    assert "multiple of 128" in backend.fp8_call_fallback_reason(module, x)
    # Without a block size transformers keeps one scale per half of gate_up_proj ([E, 2, 1]): no fmoe2 scheme.
    per_half = _fp8_experts(None)
    assert "gate_up_proj_scale_inv has shape (4, 2, 1)" in backend.fp8_call_fallback_reason(per_half, x)
