"""The LoRA launch-settings sweep (``python -m fmoe2.bench.lora_settings``): what it must cover, and its
refusal without a GPU (it runs on the device)."""
import pytest
import torch


def test_lora_settings_sweep_times_the_shipped_two_stage_settings():
    # The sweep behind lora_kernel_options / lora_expand_block_n must keep measuring what ships (sm_90, 128 rows).
    from fmoe2.bench.lora_settings import TWO_STAGE_SETTINGS
    from fmoe2.gemm.fused_moe import LORA_BLOCK_K, lora_expand_block_n, lora_kernel_options

    options = lora_kernel_options(128, "cuda", 90)
    shipped = (options["num_warps"], options["num_stages"], lora_expand_block_n(128, "cuda", 90), LORA_BLOCK_K)
    assert shipped in TWO_STAGE_SETTINGS


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_lora_settings_sweep_refuses_without_gpu():
    from fmoe2.bench.lora_settings import main

    with pytest.raises(SystemExit, match="needs a CUDA or ROCm GPU"):
        main(["--out-dir", "unused"])
