"""fmoe2's ops in torch.library, for ``torch.compile``: ``torch.ops.fmoe2.fused_moe`` and
``torch.ops.fmoe2.moe_sorting``.

``fmoe2.fused_moe`` and ``fmoe2.moe_sorting`` call these ops only while ``torch.compile``
traces them (``torch.compiler.is_compiling()``); run eagerly they skip the dispatcher and run
their cached plan directly. Traced, an op is one node of the graph: its fake implementation gives
the output's shape and dtype, so ``fullgraph=True`` traces through it, and at run time it calls
the eager function, whose launches CUDA graphs capture (``mode="reduce-overhead"``). The ops
allocate their outputs and mutate no input (``fused_moe``'s ``out=`` becomes a copy after the
op), so Inductor's CUDA-graph trees do not skip a graph for them.

The schemas take tensors and plain values only: prepared weights and adapters travel as their
tensors plus the sizes needed to rebuild them, a caller's config as JSON. The packing of a call into a
schema sits beside each eager function (``fused_moe_op_call`` in ``fmoe2/gemm/op_call.py``,
``moe_sorting_op_call`` in ``fmoe2/sorting/moe_sorting.py``; both importable from here as before): they
reach these ops through ``torch.ops.fmoe2`` and import nothing from this module, which sits on the top floor
of ``tests/test_layers.py`` because its implementations call the eager functions.
"""
from __future__ import annotations

import torch

from .gemm.call import MoECall, op_schema
from .gemm.decode import sort_path_only
from .gemm.fused_moe import fused_moe
from .gemm.op_call import fused_moe_op_call  # noqa: F401  (fmoe2.ops.fused_moe_op_call as before)
from .sorting.moe_sorting import (MoESortingResult, _check_sorting_args, launch_moe_sorting, max_num_tokens_padded,
                                  moe_sorting_op_call, sorting_buffers)  # noqa: F401  (moe_sorting_op_call re-exported)

_LIB = torch.library.Library("fmoe2", "DEF")
_LIB.define(op_schema())  # from the fields of fmoe2.gemm.call.MoECall
_LIB.define(
    "moe_sorting(Tensor topk_ids, Tensor topk_weights, int num_experts, int block_m, Tensor(a!)? out, "
    "Tensor? expert_map) -> (Tensor, Tensor, Tensor, Tensor, Tensor)")


def _fused_moe_impl(*values, **named):
    call = MoECall.from_op(values, named)  # prepared weights and adapters rebuilt from their tensors
    # No one-launch decode in here: CUDA-graph trees run a compiled step's first calls while allocating into their
    # pool, where a kept accumulator would stop them recording (fmoe2/gemm/decode.py).
    with sort_path_only():
        return fused_moe(**call.arguments())


def _fused_moe_fake(hidden_states, *args):
    return torch.empty_like(hidden_states)


def _moe_sorting_impl(topk_ids, topk_weights, num_experts, block_m, out, expert_map):
    _check_sorting_args(topk_ids, topk_weights, num_experts, block_m, out, expert_map)
    M, topk = topk_ids.shape
    # Separate tensors: the op's outputs must not share storage.
    views = {name: torch.empty(shape, dtype=dtype, device=topk_ids.device)
             for name, dtype, shape in sorting_buffers(M * topk, num_experts, block_m)}
    result = MoESortingResult.from_views(views, block_m, M, 0)
    launch_moe_sorting(topk_ids, topk_weights, num_experts, expert_map, result, out)
    return (result.sorted_token_ids, result.sorted_weights, result.sorted_expert_ids, result.num_tokens_post_padded,
            result.num_sorted_tiles)


def _moe_sorting_fake(topk_ids, topk_weights, num_experts, block_m, out, expert_map):
    M, topk = topk_ids.shape
    padded = max_num_tokens_padded(M * topk, num_experts, block_m)
    ints = dict(dtype=torch.int32, device=topk_ids.device)
    return (topk_ids.new_empty(padded, dtype=torch.int32), topk_ids.new_empty(padded, dtype=torch.float32),
            torch.empty(padded // block_m, **ints), torch.empty(1, **ints), torch.empty(1, **ints))


for _device in ("CPU", "CUDA"):  # CPU: the Triton interpreter
    _LIB.impl("fused_moe", _fused_moe_impl, _device)
    _LIB.impl("moe_sorting", _moe_sorting_impl, _device)
torch.library.register_fake("fmoe2::fused_moe", _fused_moe_fake, lib=_LIB)
torch.library.register_fake("fmoe2::moe_sorting", _moe_sorting_fake, lib=_LIB)
