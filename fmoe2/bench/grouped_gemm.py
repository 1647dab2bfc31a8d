"""The benchmark baseline's grouped GEMM: ``C[id] (+)= A[id // A_ROW_DIVISOR] @ B[expert]^T`` over sorted tiles.

vLLM's published Triton MoE algorithm gathers A by expanded id (``x[id // topk]`` or ``cache2[id]``) and stores
the output at row ``id``, optionally times ``topk_weights[id]``: modes fmoe2's own forward has no use for, so
they live here, in an entry kernel built from the K loops and epilogues of fmoe2's stage 2
(``fmoe2/gemm/grouped_gemm_kernel.py``).
"""
import triton
import triton.language as tl

from ..gemm.fp8_weights import _tile_gemm_fp8, scale_strides
from ..gemm.grouped_gemm_kernel import _add_bias, _stage2_program, _tile_gemm_16bit, _write_rows
from ..gemm.operands import _expert_scales
from ..sorting import max_busy_tiles


@triton.jit
def _gathered_gemm_kernel(
    a_ptr,  # [num_a_rows, K]
    b_ptr,  # [E, N, K]
    c_ptr,  # [num_c_rows, N]
    sorted_ids_ptr,  # [num_grid_tiles * BLOCK_M] int32 expanded ids, padding >= num_valid_ids
    expert_ids_ptr,  # [max_tiles] int32
    num_sorted_tiles_ptr,  # [1] int32
    topk_weights_ptr,  # [num_valid_ids] float32 (read only if MUL_ROUTED_WEIGHT)
    bias_ptr,  # None, or [E, N]: added before MUL_ROUTED_WEIGHT's multiply, as vLLM's kernel adds it
    a_scale_ptr,  # None, or fp8 A's float32 scales [num_a_rows, cdiv(K, BLOCK_K)] (b_scale_ptr with it)
    b_scale_ptr,  # None, or fp8 B's float32 scales [E, Sn, Sk] (stride 0 along a dimension of size 1)
    b_group_scale_ptr,  # None, or the group scales of 4-bit B (packed [E, N, K // 2], fmoe2/quant4.py)
    num_valid_ids, N, K, num_grid_tiles,
    stride_a_m, stride_b_e, stride_b_n, stride_b_k, stride_bias_e, stride_as_m, stride_bs_e, stride_bs_n,
    stride_bs_k, stride_c_m,
    A_ROW_DIVISOR: tl.constexpr,  # A row = id // A_ROW_DIVISOR
    MUL_ROUTED_WEIGHT: tl.constexpr,
    ATOMIC_OUTPUT: tl.constexpr,  # relaxed atomic add at row id (else a store)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SCALE_BLOCK_N: tl.constexpr = 1, SCALE_BLOCK_K: tl.constexpr = 128,
    WEIGHT_GROUP: tl.constexpr = 1,  # K columns per scale of 4-bit B
):
    """Grid: (num_grid_tiles * cdiv(N, BLOCK_N),)."""
    expert, tile, n_block, k_first, k_end, offs_m, row_id, row_valid, offs_n, n_valid = _stage2_program(sorted_ids_ptr,
        expert_ids_ptr, num_sorted_tiles_ptr, num_valid_ids, N, K, num_grid_tiles, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
        SPLIT_K=1, ATOMIC_OUTPUT=ATOMIC_OUTPUT, PDL=False)
    if expert < 0:
        return
    a_row = row_id // A_ROW_DIVISOR
    b_rows = b_ptr + expert * stride_b_e + offs_n[:, None] * stride_b_n
    if b_scale_ptr is not None:
        acc = _tile_gemm_fp8(a_ptr + a_row[:, None] * stride_a_m, a_scale_ptr + a_row * stride_as_m, row_valid, b_rows,
                             b_scale_ptr + expert * stride_bs_e + (offs_n // SCALE_BLOCK_N) * stride_bs_n, n_valid,
                             stride_b_k, stride_bs_k, k_first, k_end, K, BLOCK_M, BLOCK_N, BLOCK_K, 448.0,
                             SOFT_FP8_ROUNDING=False, FP8_MIN_NORMAL=0.015625, FP8_SUBNORMAL_STEP=0.001953125,
                             SCALE_BLOCK_K=SCALE_BLOCK_K)
    else:  # 16-bit B, or 4-bit B dequantized in the K loop (as vLLM's wna16 kernel does)
        bs_rows = None
        if b_group_scale_ptr is not None:
            bs_expert, stride_bs_group_n = _expert_scales(b_ptr, b_group_scale_ptr, expert, stride_b_e, stride_b_n,
                                                          WEIGHT_GROUP)
            bs_rows = bs_expert + offs_n * stride_bs_group_n
        acc = _tile_gemm_16bit(a_ptr + a_row[:, None] * stride_a_m, a_desc=None, a_row0=0, row_valid=row_valid,
                               b_expert=b_ptr + expert * stride_b_e, offs_n=offs_n, b_desc=None, b_row0=0,
                               n_valid=n_valid, stride_b_n=stride_b_n, stride_b_k=stride_b_k, k_first=k_first,
                               k_end=k_end, K=K, bs_rows=bs_rows, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                               WEIGHT_GROUP=WEIGHT_GROUP)
    acc = _add_bias(acc, bias_ptr, stride_bias_e, expert, row_weights_ptr=None, offs_m=offs_m, offs_n=offs_n,
                    n_valid=n_valid, k_first=k_first)
    if MUL_ROUTED_WEIGHT:
        acc = acc * tl.load(topk_weights_ptr + row_id, mask=row_valid, other=0.0)[:, None]
    _write_rows(acc, c_ptr, row_id, row_valid, offs_n, n_valid, stride_c_m, ATOMIC_OUTPUT)


def gathered_gemm(a, b, c, sorting, topk_weights, num_entries: int, a_row_divisor: int, mul_weight: bool,
                  atomic: bool, block_m: int, block_n: int, block_k: int, group_m: int, num_warps: int,
                  num_stages: int, bias=None, a_scale=None, b_scale=None, scale_block=None, group_scale=None,
                  group: int = 1) -> None:
    """Launches :func:`_gathered_gemm_kernel` over ``sorting``'s tiles (expanded ids, ``num_entries`` valid) of
    ``b`` [E, N, K]; fp8 with ``a_scale``, ``b_scale`` and ``scale_block`` ``(block_n, block_k)``; 4-bit ``b``
    (packed [E, N, K // 2]) with its ``group_scale`` of ``group`` columns (``fmoe2/quant4.py``)."""
    E, N, K = b.shape
    if group_scale is not None:
        K *= 2
    num_grid_tiles = max_busy_tiles(num_entries, E, block_m)
    bs_strides = [None] * 3
    fp8 = {}
    if b_scale is not None:
        bs_strides = list(scale_strides(b_scale))
        fp8 = dict(SCALE_BLOCK_N=scale_block[0], SCALE_BLOCK_K=scale_block[1])
    _gathered_gemm_kernel[(num_grid_tiles * triton.cdiv(N, block_n),)](
        a, b, c, sorting.sorted_token_ids, sorting.sorted_expert_ids, sorting.num_sorted_tiles, topk_weights, bias,
        a_scale, b_scale, group_scale, num_entries, N, K, num_grid_tiles, a.stride(0), b.stride(0), b.stride(1), b.stride(2),
        bias.stride(0) if bias is not None else None, a_scale.stride(0) if a_scale is not None else None,
        *bs_strides, c.stride(0), A_ROW_DIVISOR=a_row_divisor, MUL_ROUTED_WEIGHT=mul_weight, ATOMIC_OUTPUT=atomic,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m, num_warps=num_warps,
        num_stages=num_stages, WEIGHT_GROUP=group, **fp8)
