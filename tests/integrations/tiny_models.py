"""Tiny random transformers MoE models, built from configs (no downloads), for the integration tests.

Recipes checked against transformers 5.24 on the CPU (and 5.17 where the family exists there). Expert
weights are redrawn after construction at the scale of the layer's fan-in, biases drawn too, so the
experts' output is as large as the residual stream: a wrong expert computation cannot hide in logits
dominated by the rest of the model (transformers initialises everything with std 0.02 and zero biases).
Routers and the output head are redrawn ``DECISIVE`` times that scale, so routing and greedy choices are
clear-cut: with std 0.02 routers every token's experts were near ties, and bf16 rounding in any backend
(transformers' own included) flipped them, which compares rounding luck rather than backends.
"""
import math

import torch

GENERIC = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128, num_local_experts=4,
               num_experts=4, n_routed_experts=4, moe_num_experts=4, num_experts_per_tok=2,
               shared_expert_intermediate_size=32, max_position_embeddings=64)
MLA = dict(kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16, head_dim=8,
           n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1)
DSA = dict(MLA, q_lora_rank=32, num_key_value_heads=4, index_n_heads=4, index_head_dim=16, index_topk=4)
EXTRA = {
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                  use_mamba_kernels=False, pad_token_id=0),
    "granitemoehybrid": dict(layer_types=["mamba", "attention"], mamba_n_heads=8, mamba_d_state=16, mamba_chunk_size=8),
    "kimi_linear": dict(MLA, layer_types=["linear_attention", "full_attention"], mlp_layer_types=["dense", "sparse"],
                        linear_head_dim=16, linear_num_heads=4, pad_token_id=0, num_key_value_heads=4),
    "bailing_hybrid": dict(MLA, layer_group_size=2, pad_token_id=0, num_key_value_heads=4),
    "lfm2_moe": dict(num_dense_layers=1, layer_types=["conv", "full_attention"]),
    "axk1": dict(MLA, q_lora_rank=32), "deepseek_v32": DSA, "glm4_moe_lite": MLA, "glm_moe_dsa": DSA,
    "beam": dict(mlp_layer_types=["dense", "sparse"], n_group=1, topk_group=1, pad_token_id=0),
    "flint": dict(mlp_only_layers=[0], pad_token_id=0),
    "dots1": dict(n_shared_experts=1, first_k_dense_replace=1, pad_token_id=0),
    "flex_olmo": dict(pad_token_id=0), "hy_v4": dict(pad_token_id=0),
    "qwen3_next": dict(layer_types=["linear_attention", "full_attention"]),
    "qwen3_5_moe_text": dict(layer_types=["linear_attention", "full_attention"]),
    "zaya": dict(num_experts_per_tok=1),
    "gemma4_text": dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32,
                        hidden_size_per_layer_input=16, vocab_size_per_layer_input=128, num_key_value_heads=2,
                        head_dim=16, layer_types=["sliding_attention", "full_attention"], sliding_window=8),
    "deepseek_v2": dict(kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16,
                        n_shared_experts=1, first_k_dense_replace=1, head_dim=None),
    "deepseek_v3": MLA,
    "gpt_oss": dict(intermediate_size=32, head_dim=16, sliding_window=8, layer_types=None),
}
# The families whose experts fmoe2 computes, and those that fall back to grouped_mm (with the reason's start).
SUPPORTED = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3", "gpt_oss", "afmoe",
             "aria_text", "axk1", "bailing_hybrid", "beam", "cohere2_moe", "deepseek_v32", "deepseek_v4", "dots1",
             "ernie4_5_moe", "exaone_moe", "flex_olmo", "flint", "gemma4_text", "glm4_moe", "glm4_moe_lite",
             "glm_moe_dsa", "granitemoe", "granitemoe_swa", "granitemoehybrid", "granitemoeshared",
             "hunyuan_v1_moe", "hy_v3", "hy_v4", "inkling_text", "jamba", "kimi_linear", "kolibri1", "laguna",
             "lara_mini", "lfm2_moe", "mellum", "mimo_v2_flash", "minimax", "minimax_m2", "minimax_m3_vl_text",
             "phimoe", "qwen3_5_moe_text", "qwen3_next", "solar_open", "zaya"]
FALLBACK = {"nemotron_h": "its experts have no gate", "inkling2_text": "its own gate",
            "inkling2_loop_text": "its own gate"}
REQUIRED = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3", "gpt_oss"]
DECISIVE = 4.0


def available(model_type: str) -> bool:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return model_type in CONFIG_MAPPING


def experts_modules(model):
    return [m for m in model.modules() if hasattr(m, "has_gate") and hasattr(m, "gate_up_proj" if m.has_gate
                                                                               else "up_proj")]


def build(model_type: str, dtype=torch.float32, impl: str = "eager", device="cpu", seed: int = 0, layers: int = 2,
          sizes=None):
    """A tiny random CausalLM of ``model_type`` with experts that matter (module docstring); ``sizes``: config
    fields over the generic ones (e.g. ``hidden_size``)."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    base = config_class()
    fields = getattr(config_class, "__dataclass_fields__", {})
    kwargs = {k: v for k, v in GENERIC.items() if k in fields or hasattr(base, k)}
    kwargs.update(EXTRA.get(model_type, {}))
    kwargs.update(sizes or {})
    kwargs["num_hidden_layers"] = layers
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config_class(**kwargs), experts_implementation=impl, dtype=torch.float32)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    hidden = model.config.get_text_config().hidden_size
    num_experts = {m.gate_up_proj.shape[0] if m.has_gate else m.up_proj.shape[0] for m in experts_modules(model)}
    with torch.no_grad():
        for name, p in model.named_parameters():  # routers: [E, H] weights of a gate or router
            if (p.dim() == 2 and p.shape[0] in num_experts and p.shape[1] == hidden
                    and ("gate" in name or "router" in name) and "proj" not in name):
                p.copy_(torch.randn(p.shape, generator=gen) * DECISIVE / math.sqrt(hidden))
        head = model.get_output_embeddings()
        if head is not None:
            head.weight.copy_(torch.randn(head.weight.shape, generator=gen) * DECISIVE / math.sqrt(hidden))
        for experts in experts_modules(model):
            for name, p in experts.named_parameters(recurse=False):
                if name.endswith("_bias"):
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
                else:  # [E, out, in], or [E, in, out] when transposed: scale by the fan-in
                    fan_in = p.shape[1] if getattr(experts, "is_transposed", False) else p.shape[2]
                    p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(fan_in))
    return model.to(device=device, dtype=dtype).eval()


if __name__ == "__main__":
    # python tests/integrations/tiny_models.py MODEL_TYPE DIR [bf16|fp32]: saves one (fmoe2.bench.expert_parallel's
    # two-GPU run loads it: misc/bench/expert_parallel)
    import sys

    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    if len(sys.argv) not in (3, 4) or (len(sys.argv) == 4 and sys.argv[3] not in dtypes):
        sys.exit("usage: python tests/integrations/tiny_models.py MODEL_TYPE DIR [bf16|fp32]")
    build(sys.argv[1], dtype=dtypes[sys.argv[3] if len(sys.argv) == 4 else "bf16"]).save_pretrained(sys.argv[2])
    print(f"saved a tiny {sys.argv[1]} to {sys.argv[2]}")
