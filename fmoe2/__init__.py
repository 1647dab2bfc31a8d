"""fmoe2: a fused Mixture-of-Experts forward pass in Triton (two launches and zero workspace on
the fused path; a three-launch two-stage path where it measures faster).

* :func:`moe_sorting` - routing -> expert-major tiles, zeroing the output in the same launch;
* :func:`fused_moe` - sort + one fused kernel (gate+up GEMM, activation, routing weight,
  down GEMM with atomic adds), or sort + two stages for large batches;
* :func:`prepare_weights` - one-time conversion of expert weights to the prepared layout;
* fp8 weights (block-wise, per channel or per expert scales) with activations quantized inside the
  kernels: :mod:`fmoe2.fp8` (:func:`quantize_fp8_weights` makes them from 16-bit weights);
* weight-only formats with 16-bit activations, dequantized in the kernels' operand loader: mxfp4 (gpt-oss's
  published experts) and int4 with group scales and zero points (GPTQ, AWQ): :mod:`fmoe2.quant4`; int8 with
  per-channel or group scales (w8a16): :mod:`fmoe2.int8`; prepared by :func:`prepare_weights` (every format in one
  registry: :mod:`fmoe2.formats`);
* :class:`MoELoRA` / :func:`prepare_lora` - multi-LoRA adapters (inside the fused kernel; on the two-stage path
  inside the stages at decode sizes, else beside them);
* :func:`set_deterministic` - deterministic, batch-invariant mode for every call (or ``fused_moe(...,
  deterministic=True)`` per call);
* eager one-token calls run one launch on a float32 accumulator kept per stream (``fmoe2/gemm/decode.py``):
  :func:`set_one_launch_decode` turns that off, :func:`sort_path_only` avoids it for the calls inside (a caller's
  own op under ``torch.compile(mode="reduce-overhead")``), :func:`release_kept_accumulators` frees the buffers;
* :mod:`fmoe2.reference` - pure-torch references of both ops;
* ``torch.ops.fmoe2.fused_moe`` / ``torch.ops.fmoe2.moe_sorting`` - the same ops for
  ``torch.compile`` (:mod:`fmoe2.ops`; the functions above route to them while being traced).

A call whose shapes, dtypes and devices were seen before reuses that call's plan (config, buffer
layout, launches bound to their compiled kernels): :func:`clear_plan_cache` drops them.
"""
from .gemm import (FusedMoEConfig, MoELoRA, PreparedMoELoRA, PreparedMoEWeights, fused_moe, get_config, prepare_lora,
                   prepare_weights)
from .determinism import deterministic_enabled, set_deterministic
from .gemm.decode import release_kept_accumulators, set_one_launch_decode, sort_path_only
from .fp8 import quantize_weights as quantize_fp8_weights
from .reference import fused_moe_reference, moe_sorting_reference
from .sorting import MoESortingResult, moe_sorting
from . import ops  # noqa: F401  (registers torch.ops.fmoe2.*)
from . import formats, int8, quant4  # noqa: F401


def clear_plan_cache() -> None:
    """Drops the cached plans of :func:`fused_moe` and :func:`moe_sorting` (rebuilt on the next call) and the
    one-launch decode's kept accumulators (:func:`release_kept_accumulators`)."""
    from .gemm.fused_moe import PLANS
    from .sorting.moe_sorting import SORT_PLANS

    PLANS.clear()
    SORT_PLANS.clear()
    release_kept_accumulators()


__version__ = "0.1.0"
__all__ = [
    "fused_moe",
    "moe_sorting",
    "prepare_weights",
    "quantize_fp8_weights",
    "PreparedMoEWeights",
    "MoELoRA",
    "prepare_lora",
    "PreparedMoELoRA",
    "MoESortingResult",
    "FusedMoEConfig",
    "get_config",
    "fused_moe_reference",
    "moe_sorting_reference",
    "clear_plan_cache",
    "release_kept_accumulators",
    "set_one_launch_decode",
    "sort_path_only",
    "set_deterministic",
    "deterministic_enabled",
]
