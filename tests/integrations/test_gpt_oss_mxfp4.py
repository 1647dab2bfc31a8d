"""gpt-oss from an mxfp4 checkpoint with its experts kept in 4 bits (fmoe2/integrations/gpt_oss_mxfp4.py), against
transformers' own loading of the same checkpoint (which, without the ``kernels`` package, dequantizes the experts):
a tiny random gpt-oss saved locally in the published layout (``*_blocks`` [E, N, K // 32, 16] and ``*_scales``
[E, N, K // 32] uint8, quantization_config quant_method mxfp4). CPU: the interpreter in float32; a GPU runs bf16."""
import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from fmoe2.integrations import transformers as backend  # noqa: E402
from fmoe2.integrations.gpt_oss_mxfp4 import experts_bytes, load_gpt_oss_mxfp4, save_mxfp4_checkpoint  # noqa: E402
from helpers import DEVICE, rel_error  # noqa: E402
from tiny_models import available, build  # noqa: E402

pytestmark = pytest.mark.skipif(not available("gpt_oss"), reason="gpt_oss is not in this transformers")

INPUT_IDS = torch.tensor([[3, 17, 99, 5, 42, 8, 120], [7, 7, 64, 1, 88, 15, 2]])
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny random gpt-oss (2 layers, 4 experts, H = I = 64) saved as the published mxfp4 checkpoints are."""
    folder = str(tmp_path_factory.mktemp("gpt_oss_mxfp4"))
    save_mxfp4_checkpoint(build("gpt_oss", sizes=dict(hidden_size=64, intermediate_size=64)), folder)
    return folder


def test_the_experts_stay_in_4_bits_and_compute_what_transformers_dequantized_forward_does(checkpoint):
    ours = load_gpt_oss_mxfp4(checkpoint, device=DEVICE, dtype=DTYPE)
    reference = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=DTYPE,
                                                                  experts_implementation="eager").to(DEVICE).eval()
    assert not any(n.endswith(("experts.gate_up_proj", "experts.down_proj")) for n, _ in ours.named_parameters())
    assert any(n.endswith("experts.gate_up_proj") for n, _ in reference.named_parameters())
    experts = [m for m in ours.modules() if backend.PREPARED_ATTRIBUTE in m.__dict__]
    assert len(experts) == 2 and all(m.__dict__[backend.PREPARED_ATTRIBUTE].weight_format == "mxfp4" for m in experts)
    total, values = experts_bytes(ours)
    assert values == 2 * 4 * (2 * 64 * 64 + 64 * 64) and total * 8 / values == 4.25
    ids = INPUT_IDS.to(DEVICE)
    with torch.no_grad():
        got, want = ours(ids).logits.float(), reference(ids).logits.float()
    assert rel_error(got, want) < (2e-2 if DTYPE == torch.bfloat16 else 1e-4), rel_error(got, want)
    with torch.no_grad():
        tokens = ours.generate(ids, max_new_tokens=4, do_sample=False)
        expected = reference.generate(ids, max_new_tokens=4, do_sample=False)
        # Both models' logits of each generated position, on the reference's tokens: where the reference's top two
        # are closer than the two models' logits differ, greedy decoding may pick either (a near tie of a random
        # model in bf16), and the sequences may part from there on
        new = slice(ids.shape[1] - 1, -1)
        got, want = ours(expected).logits.float()[:, new], reference(expected).logits.float()[:, new]
    top2 = want.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1] > 2 * (got - want).abs().amax()).int().cumprod(dim=-1).bool()
    assert clear.any(), "no generated token stood clear of a near tie: nothing compared"
    generated = slice(ids.shape[1], None)
    assert torch.equal(tokens[:, :ids.shape[1]], ids)
    assert torch.equal(tokens[:, generated][clear], expected[:, generated][clear])
    if DTYPE == torch.float32:  # (no near ties at this precision: every token is compared)
        assert clear.all() and torch.equal(tokens, expected)


def test_a_call_fmoe2_cannot_run_raises_instead_of_a_fallback(checkpoint):
    ours = load_gpt_oss_mxfp4(checkpoint, device=DEVICE, dtype=DTYPE)
    ours.get_input_embeddings().weight.requires_grad_(True)  # (the hidden states then need gradients)
    with pytest.raises(RuntimeError, match="prepared mxfp4 weights.*gradients"):
        ours(INPUT_IDS.to(DEVICE))  # fmoe2 is inference-only, and no other backend holds the weights


def test_other_checkpoints_get_a_clear_error(tmp_path, checkpoint):
    with open(os.path.join(checkpoint, "config.json")) as f:
        config = json.load(f)
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "quantization_config"}))
    with pytest.raises(ValueError, match="quant_method 'mxfp4'"):
        load_gpt_oss_mxfp4(str(plain), device=DEVICE)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps(config))
    tensors = safetensors_torch.load_file(os.path.join(checkpoint, "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    safetensors_torch.save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match="lacks model.layers.1.mlp.experts.down_proj_scales"):
        load_gpt_oss_mxfp4(str(broken), device=DEVICE)
    with pytest.raises(TypeError, match="dtype"):
        load_gpt_oss_mxfp4(checkpoint, device=DEVICE, dtype="bf16")
    with pytest.raises(ValueError, match="model_type 'gpt_oss'"):
        save_mxfp4_checkpoint(build("mixtral"), str(tmp_path / "mixtral"))


def test_the_decode_benchmark_report_compares_the_4_bit_model_with_the_best_bf16_run():
    from fmoe2.bench.gpt_oss_mxfp4 import markdown

    result = dict(device="GPU", date="d", torch="t", triton="tr", command="c", model="gpt-oss-120b", layers=4,
                  prompt=64, new_tokens=32, rounds=3, experts_bits_per_value=4.25,
                  model_bytes=dict(mxfp4=2 * 2**30, bf16=8 * 2**30), logits_rel_err=3e-3, logits_rel_err_bf16_fmoe2=2e-3,
                  runs=["mxfp4 fmoe2", "bf16 fmoe2", "bf16 grouped_mm"],
                  rows=[dict(batch=1, tokens_per_s={"mxfp4 fmoe2": 300.0, "bf16 fmoe2": 200.0, "bf16 grouped_mm": 150.0}),
                        dict(batch=8, tokens_per_s={"mxfp4 fmoe2": 900.0, "bf16 fmoe2": 1000.0, "bf16 grouped_mm": None})])
    text = markdown(result)
    assert "4.250 bits per value" in text and "mxfp4 2.00 GiB, dequantized bf16 8.00 GiB" in text
    assert "| 1 | 300.0 | 200.0 | 150.0 | 1.50x |" in text and "| 8 | 900.0 | 1000.0 | error | 0.90x |" in text


def test_a_sharded_checkpoint_loads_through_its_index(tmp_path, checkpoint):
    # The published checkpoints are sharded: model.safetensors.index.json names the file of each tensor.
    tensors = safetensors_torch.load_file(os.path.join(checkpoint, "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        safetensors_torch.save_file({k: tensors[k] for k in keys}, str(tmp_path / file))
    weight_map = {k: file for file, keys in shards.items() for k in keys}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (tmp_path / "config.json").write_text(open(os.path.join(checkpoint, "config.json")).read())
    (tmp_path / "stray.safetensors").write_text("not named by the index: not read")
    sharded = load_gpt_oss_mxfp4(str(tmp_path), device=DEVICE, dtype=DTYPE)
    whole = load_gpt_oss_mxfp4(checkpoint, device=DEVICE, dtype=DTYPE)
    with torch.no_grad():
        assert torch.equal(sharded(INPUT_IDS.to(DEVICE)).logits, whole(INPUT_IDS.to(DEVICE)).logits)


def test_the_experts_move_with_the_model_and_stay_out_of_its_state(checkpoint):
    ours = load_gpt_oss_mxfp4(checkpoint, device=DEVICE, dtype=DTYPE)
    assert not [k for k in ours.state_dict() if ".experts." in k]  # (save the checkpoint, not this model)
    reference = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=DTYPE,
                                                                  experts_implementation="eager").to(DEVICE).eval()
    ours.half(), reference.half()  # the prepared biases are buffers: converted with the model, and read from there
    experts = next(m for m in ours.modules() if backend.PREPARED_ATTRIBUTE in m.__dict__)
    assert experts.fmoe2_b2.dtype == torch.float16 and backend.prepared_weights_of(experts).b2 is experts.fmoe2_b2
    ids = INPUT_IDS.to(DEVICE)
    with torch.no_grad():
        got, want = ours(ids).logits.float(), reference(ids).logits.float()
        assert rel_error(got, want) < 2e-2, rel_error(got, want)
        experts.fmoe2_b2.add_(100.0)  # the buffers are what the forward reads
        assert rel_error(ours(ids).logits.float(), want) > 1e-1


def test_a_missing_bias_is_named(tmp_path, checkpoint):
    tensors = safetensors_torch.load_file(os.path.join(checkpoint, "model.safetensors"))
    del tensors["model.layers.0.mlp.experts.down_proj_bias"]
    safetensors_torch.save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(open(os.path.join(checkpoint, "config.json")).read())
    with pytest.raises(ValueError, match="lacks model.layers.0.mlp.experts.down_proj_bias"):
        load_gpt_oss_mxfp4(str(tmp_path), device=DEVICE, dtype=DTYPE)


def test_tied_embeddings_take_the_one_the_checkpoint_holds(tmp_path, checkpoint):
    config = json.load(open(os.path.join(checkpoint, "config.json")))
    (tmp_path / "config.json").write_text(json.dumps(dict(config, tie_word_embeddings=True)))
    tensors = safetensors_torch.load_file(os.path.join(checkpoint, "model.safetensors"))
    del tensors["lm_head.weight"]
    safetensors_torch.save_file(tensors, str(tmp_path / "model.safetensors"))
    ours = load_gpt_oss_mxfp4(str(tmp_path), device=DEVICE, dtype=DTYPE)
    assert ours.get_output_embeddings().weight is ours.get_input_embeddings().weight


def test_only_the_loading_thread_builds_on_meta_and_the_patch_is_undone():
    import threading

    from fmoe2.integrations.gpt_oss_mxfp4 import _parameters_on_meta

    original, other = torch.nn.Module.register_parameter, {}
    with _parameters_on_meta():
        here = torch.nn.Linear(2, 2)
        thread = threading.Thread(target=lambda: other.update(linear=torch.nn.Linear(2, 2)))
        thread.start()
        thread.join()
    assert here.weight.is_meta and not other["linear"].weight.is_meta
    assert torch.nn.Module.register_parameter is original and not torch.nn.Linear(2, 2).weight.is_meta
