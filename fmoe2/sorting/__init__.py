"""Routing -> expert-major tiles (one launch, or two for large batches of many experts; also zeroes
the output; for fp8 forwards also quantizes the activations)."""
from .moe_sorting import (
    MoESortingResult,
    checked_chunk_size,
    launch_moe_sorting,
    max_busy_tiles,
    max_num_tokens_padded,
    moe_sorting,
    sort_launch_specs,
    sorting_buffers,
    sorting_kernel_launch,
    x_quantization_values,
)

__all__ = ["MoESortingResult", "moe_sorting", "launch_moe_sorting", "max_num_tokens_padded", "max_busy_tiles",
           "sorting_kernel_launch", "sort_launch_specs", "sorting_buffers", "checked_chunk_size",
           "x_quantization_values"]
