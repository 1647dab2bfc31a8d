"""The sort settings sweep (``python -m fmoe2.bench.sort_settings``): its reference check, the
overrides it times, and its refusal without a GPU (it runs on the device)."""
import importlib

import pytest
import torch

from helpers import DEVICE


def _sorted(M, topk, E, block_m, num_parts=None, num_warps=None):
    from fmoe2.sorting import MoESortingResult, launch_moe_sorting

    gen = torch.Generator().manual_seed(M)
    ids = torch.stack([torch.randperm(E, generator=gen)[:topk] for _ in range(M)]).int().to(DEVICE)
    weights = torch.rand(M, topk, generator=gen).to(DEVICE)
    result = MoESortingResult.allocate(M * topk, E, block_m, M, ids.device)
    launch_moe_sorting(ids, weights, E, None, result, None, num_parts=num_parts, num_warps=num_warps)
    return ids, weights, result


def test_reference_check_accepts_the_sort_and_catches_a_swap(monkeypatch):
    from fmoe2.bench import sort_settings

    monkeypatch.setattr(sort_settings, "BLOCK_M", 16)
    M, topk, E = 40, 3, 6
    ids, weights, result = _sorted(M, topk, E, 16)
    sort_settings.check_against_reference(result, ids, weights, E)
    first_two = result.sorted_token_ids[:2].clone()
    assert first_two[0] != first_two[1]
    result.sorted_token_ids[:2] = first_two.flip(0)  # two entries of one expert out of token order
    with pytest.raises(SystemExit, match="differ from the reference"):
        sort_settings.check_against_reference(result, ids, weights, E)


def test_warps_and_parts_overrides_keep_the_layout(monkeypatch):
    # The sweep times overrides of sort_programs; the layout must not depend on them. (Warps
    # matter on a GPU only: the interpreter ignores them; the GPU run of this test checks them.)
    monkeypatch.setattr(importlib.import_module("fmoe2.sorting.moe_sorting"), "MAX_SCAN_BLOCK", 32)
    _, _, auto = _sorted(50, 4, 7, 16)
    for parts, warps in ((2, 4), (3, 8)):
        _, _, other = _sorted(50, 4, 7, 16, num_parts=parts, num_warps=warps)
        for name in ("sorted_token_ids", "sorted_weights", "sorted_expert_ids", "num_tokens_post_padded",
                     "num_sorted_tiles"):
            assert torch.equal(getattr(other, name), getattr(auto, name)), (parts, warps, name)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_sort_settings_sweep_refuses_without_gpu():
    from fmoe2.bench.sort_settings import main

    with pytest.raises(SystemExit, match="needs a CUDA or ROCm GPU"):
        main(["--out-dir", "unused"])


def test_forward_comparison_switches_the_sort_off_and_back():
    # --forward times fused_moe with the picked sort against the one-launch sort: inside the context
    # every allocation takes one launch, after it the rule is back (also after an error).
    from fmoe2.bench.sort_settings import one_launch_sort
    from fmoe2.sorting import MoESortingResult

    qwen3_m4096 = dict(num_entries=4096 * 8, num_experts=128, block_m=64, num_tokens=4096, device="meta")
    assert MoESortingResult.allocate(**qwen3_m4096).chunk_size == 512
    with one_launch_sort():
        assert MoESortingResult.allocate(**qwen3_m4096).chunk_size == 0
    with pytest.raises(RuntimeError), one_launch_sort():
        raise RuntimeError
    assert MoESortingResult.allocate(**qwen3_m4096).chunk_size == 512
