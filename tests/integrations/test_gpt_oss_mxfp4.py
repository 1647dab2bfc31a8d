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
from fmoe2.integrations.gpt_oss_mxfp4 import experts_bytes, load_gpt_oss_mxfp4  # noqa: E402
from fmoe2.quant4 import quantize_mxfp4  # noqa: E402
from helpers import DEVICE, rel_error  # noqa: E402
from tiny_models import available, build  # noqa: E402

pytestmark = pytest.mark.skipif(not available("gpt_oss"), reason="gpt_oss is not in this transformers")

INPUT_IDS = torch.tensor([[3, 17, 99, 5, 42, 8, 120], [7, 7, 64, 1, 88, 15, 2]])
MXFP4_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                     "model.embed_tokens", "lm_head"]}
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32


def save_mxfp4_checkpoint(folder: str, quantization_config=MXFP4_CONFIG) -> None:
    """A tiny random gpt-oss (2 layers, 4 experts, H = I = 64) saved as the published mxfp4 checkpoints are."""
    model = build("gpt_oss", sizes=dict(hidden_size=64, intermediate_size=64))
    tensors = {}
    for name, tensor in model.state_dict().items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            rows = tensor.transpose(1, 2).contiguous()  # gpt-oss stores [E, K, N]; the blocks are [E, N, K]
            packed, scales = quantize_mxfp4(rows)
            tensors[name + "_blocks"] = packed.reshape(*packed.shape[:2], -1, 16).contiguous()
            tensors[name + "_scales"] = scales.contiguous()
        else:
            tensors[name] = tensor.to(torch.bfloat16).contiguous()
    os.makedirs(folder, exist_ok=True)
    safetensors_torch.save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    model.config.quantization_config = quantization_config
    model.config.save_pretrained(folder)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("gpt_oss_mxfp4"))
    save_mxfp4_checkpoint(folder)
    return folder


def test_the_experts_stay_in_4_bits_and_compute_what_transformers_dequantized_forward_does(checkpoint):
    ours = load_gpt_oss_mxfp4(checkpoint, device=DEVICE, dtype=DTYPE)
    reference = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=DTYPE,
                                                                  experts_implementation="eager").to(DEVICE).eval()
    assert not any("experts.gate_up_proj" == n.rsplit(".", 1)[-1] for n, _ in ours.named_parameters())
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
    assert torch.equal(tokens, expected)


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
