"""The LoRA launch-settings sweep (``python -m fmoe2.bench.lora_settings``): what it must cover, and its
refusal without a GPU (it runs on the device)."""
import pytest
import torch

from fmoe2 import FusedMoEConfig


def test_lora_settings_sweep_times_the_shipped_two_stage_settings():
    # The sweep behind lora_kernel_options / lora_expand_block_n must keep measuring what ships (sm_90, 128 rows).
    from fmoe2.bench.lora_settings import TWO_STAGE_SETTINGS
    from fmoe2.gemm.launches import LORA_BLOCK_K, lora_expand_block_n, lora_kernel_options
    from fmoe2.target import NAMED_TARGETS

    sm90 = NAMED_TARGETS["sm_90"]
    options = lora_kernel_options(128, sm90)
    shipped = (options["num_warps"], options["num_stages"], lora_expand_block_n(128, sm90), LORA_BLOCK_K)
    assert shipped in TWO_STAGE_SETTINGS


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_lora_settings_sweep_refuses_without_gpu():
    from fmoe2.bench.lora_settings import main

    with pytest.raises(SystemExit, match="needs a CUDA or ROCm GPU"):
        main(["--out-dir", "unused"])


def test_lora_settings_sweep_reaches_the_launches():
    # The sweep patches fmoe2.gemm.fused_moe and fmoe2.gemm.launches: the names it patches must be the ones
    # the launches use.
    from fmoe2.bench.lora_settings import lora_configs_as_given, two_stage_lora_settings
    from fmoe2.codegen import _meta_lora
    from fmoe2.gemm.fused_moe import pick_config
    from fmoe2.target import target_of
    from fmoe2.gemm.launches import MoEProblem, TwoStageWorkspace, lora_expand_launch, lora_shrink_launch
    from fmoe2.sorting import MoESortingResult
    from fmoe2.target import NAMED_TARGETS

    sm90 = NAMED_TARGETS["sm_90"]

    M, E, H, I, topk = 64, 64, 2048, 1408, 6
    meta = dict(device="meta", dtype=torch.bfloat16)
    problem = MoEProblem(torch.empty(M, H, **meta), torch.empty(E, 2 * I, H, **meta), torch.empty(E, H, I, **meta),
                         False, E, H, I, topk)
    problem.lora = _meta_lora(2, E, H, I, 16, torch.bfloat16)
    problem.token_lora_ids = torch.empty(M, dtype=torch.int32, device="meta")
    fused = FusedMoEConfig(BLOCK_M=16, BLOCK_N=128, BLOCK_K=64, BLOCK_H=128, num_warps=4, num_stages=4)
    assert pick_config(problem, fused, "auto", target_of(problem.x.device)).num_warps == 8  # past one wave the fit takes 8 warps ...
    with lora_configs_as_given():
        assert pick_config(problem, fused, "auto", target_of(problem.x.device)) == fused  # ... the sweep runs the config as given
    sorting = MoESortingResult.allocate(M * topk, E, 128, M, "meta", count_lora_tokens=True)
    workspace = TwoStageWorkspace.allocate(problem, sorting, fused, sm90)
    with two_stage_lora_settings(2, 3, 32, 128):
        shrink = lora_shrink_launch(problem, sorting, workspace, False, sm90)
        expand = lora_expand_launch(problem, sorting, workspace, problem.x, False, sm90)
    assert shrink.constexprs["BLOCK_K"] == 128 and expand.constexprs["BLOCK_N"] == 32
    assert shrink.options["num_warps"] == expand.options["num_warps"] == 2
    assert shrink.options["num_stages"] == expand.options["num_stages"] == 3


def test_lora_settings_sweep_names_the_missing_table(tmp_path):
    from fmoe2.bench.lora_settings import table_rows

    with pytest.raises(SystemExit, match="run `python -m fmoe2.bench --lora` first"):
        table_rows(str(tmp_path), "mixtral-8x7b")
