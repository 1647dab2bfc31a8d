"""What :func:`fmoe2.fused_moe` runs while ``torch.compile`` traces it: its arguments packed into the schema of
``torch.ops.fmoe2.fused_moe``.

The op is defined and implemented in ``fmoe2/ops.py`` (a floor above, since its implementation calls
``fused_moe``); this half sits beside ``fused_moe`` so that the eager function reaches the op through the
dispatcher (``torch.ops.fmoe2``, registered when ``fmoe2`` is imported) and never imports upward
(``tests/test_layers.py``). The schema's argument order is written in ``fmoe2/ops.py``: a change there is a
change here.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..activations import SWIGLU_ALPHA
from .config import FusedMoEConfig
from .layout import PreparedMoEWeights
from .lora import prepare_lora


def fused_moe_op_call(hidden_states, w1, w2, topk_weights, topk_ids, *, activation="silu", out=None, expert_map=None,
                      config: Optional[FusedMoEConfig] = None, path="auto", lora=None, token_lora_ids=None,
                      w1_bias=None, w2_bias=None, gate_up_interleaved=False, swiglu_alpha=SWIGLU_ALPHA,
                      swiglu_limit=None, w1_scale=None, w2_scale=None, block_shape=None, deterministic=False):
    """``fmoe2.fused_moe``'s arguments passed to ``torch.ops.fmoe2.fused_moe`` (what it runs while
    ``torch.compile`` traces it; ``deterministic`` resolved already); ``out`` is then filled by a copy."""
    prepared_h = prepared_i = 0
    if isinstance(w1, PreparedMoEWeights):
        if any(t is not None for t in (w1_bias, w2_bias, w1_scale, w2_scale, block_shape)):
            # (the op's impl would pass them on as the prepared ones)
            raise ValueError("w1_bias/w2_bias/w1_scale/w2_scale/block_shape go with plain weights; prepared weights "
                             "carry theirs (fmoe2.prepare_weights(w1, w2, w1_bias=..., w1_scale=..., ...))")
        prepared_h, prepared_i = w1.hidden_size, w1.intermediate_size
        w1_scale, w2_scale, block_shape = w1.s13, w1.s2, w1.scale_block
        w1, w2, w1_bias, w2_bias = w1.w13, w1.w2, w1.b13, w1.b2
    lora_tensors, lora_rank = (None,) * 5, 0
    if lora is not None:
        lora = prepare_lora(lora)
        lora_tensors, lora_rank = (lora.a13, lora.b13, lora.a2, lora.b2, lora.scaling), lora.rank
    result = torch.ops.fmoe2.fused_moe(hidden_states, w1, w2, topk_weights, topk_ids, activation, expert_map, path,
                                       config.to_json() if config is not None else "", prepared_h, prepared_i,
                                       *lora_tensors, lora_rank, token_lora_ids, w1_bias, w2_bias,
                                       gate_up_interleaved, float(swiglu_alpha),
                                       float(swiglu_limit) if swiglu_limit is not None else None, w1_scale, w2_scale,
                                       list(block_shape) if block_shape is not None else None, bool(deterministic))
    if out is None:
        return result
    out.copy_(result)
    return out
