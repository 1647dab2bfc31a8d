"""Config picking: defaults by tokens per expert, tuned files by nearest batch, ROCm-only options."""
import json
from dataclasses import replace

import pytest
import torch

from fmoe2.gemm.config import FusedMoEConfig, device_config_name, fit_config, get_config, shape_file_name


def test_defaults_follow_tokens_per_expert_and_clamp():
    cpu = torch.device("cpu")  # no tuned file: the defaults are under test
    small = get_config(1, 128, 2048, 768, 8, torch.bfloat16, backend="cuda", device=cpu)
    large = get_config(16384, 8, 4096, 14336, 2, torch.bfloat16, backend="cuda", device=cpu)
    assert small.BLOCK_M <= large.BLOCK_M and large.BLOCK_M >= 64
    tiny = get_config(4, 4, 40, 24, 2, torch.float16, backend="cuda", device=cpu)
    assert tiny.BLOCK_N <= 32 and tiny.BLOCK_K <= 64 and tiny.BLOCK_H <= 64


def test_cuda_defaults_give_tiles_as_tall_as_the_rows_per_expert():
    # The searches of 2026-11-24 (H100, H200) picked 64-row tiles at 32-64 routed rows per expert and
    # 128-row tiles at 96-384; shorter tiles read each expert's weights again (up to 1.375x slower).
    cpu = torch.device("cpu")
    pick = lambda M, E, H, I, topk: get_config(M, E, H, I, topk, torch.bfloat16, backend="cuda", device=cpu)
    assert pick(128, 8, 4096, 14336, 2).BLOCK_M == 64  # Mixtral M=128: 32 rows per expert
    assert pick(1024, 128, 2048, 768, 8).BLOCK_M == 64  # Qwen3 M=1024: 64
    for M, E, H, I, topk in ((1024, 64, 2048, 1408, 6), (1024, 8, 4096, 14336, 2), (4096, 64, 2048, 1408, 6)):
        cfg = pick(M, E, H, I, topk)  # 96, 256 and 384 rows per expert
        assert cfg.BLOCK_M == 128 and cfg.path == "two_stage", (M, E, cfg)
    # Above 128 rows per expert stage 1 takes 128 columns and 4 stages (H100 sweeps, see defaults.json);
    # at 96 (DeepSeek M=1024) 64 columns and 3 stages stay.
    assert [(c.BLOCK_N, c.num_stages) for c in (pick(1024, 8, 4096, 14336, 2), pick(4096, 64, 2048, 1408, 6))] == \
        [(128, 4), (128, 4)]
    assert (pick(1024, 64, 2048, 1408, 6).BLOCK_N, pick(1024, 64, 2048, 1408, 6).num_stages) == (64, 3)


def test_tensor_descriptor_weight_loads_only_where_they_compile_to_the_copy_engine():
    # On sm_80 Triton lowers a descriptor load to pointer-load code whose two-stage K loops compiled to 2.7-7x the
    # instructions of plain pointer loads (config_cuda.tensor_descriptor_weights): tma is off there, as on ROCm; the
    # interpreter keeps it (the CPU tests compare both loads).
    from fmoe2.gemm.config import ConfigMode, ConfigProblem, resolve_config
    from fmoe2.target import INTERPRETER_TARGET, NAMED_TARGETS

    problem = ConfigProblem(4096, 8, 4096, 14336, 2, torch.bfloat16)  # Mixtral M=4096: a two-stage rule with tma
    picks = {name: resolve_config(problem, ConfigMode(), NAMED_TARGETS[name])
             for name in ("sm_80", "sm_90", "sm_100", "gfx942")}
    assert picks["sm_90"].tma and picks["sm_90"].pdl and picks["sm_90"].path == "two_stage"
    assert picks["sm_100"].tma and picks["sm_100"].pdl
    # (and plain launches where the GPU has no programmatic dependent launch: the config says what runs)
    assert not any(picks[name].tma or picks[name].pdl for name in ("sm_80", "gfx942"))
    given = replace(picks["sm_90"], tma=True)
    assert not resolve_config(problem, ConfigMode(), NAMED_TARGETS["sm_80"], given).tma  # a caller's too
    assert resolve_config(problem, ConfigMode(), NAMED_TARGETS["sm_90"], given).tma
    assert resolve_config(problem, ConfigMode(), INTERPRETER_TARGET, given).tma


def test_hip_options_only_on_hip():
    cfg = get_config(4096, 8, 4096, 14336, 2, torch.bfloat16, backend="hip", arch="gfx942")
    assert {"waves_per_eu", "matrix_instr_nonkdim"} <= set(cfg.launch_options("hip"))
    assert set(get_config(4096, 8, 4096, 14336, 2, torch.bfloat16, backend="cuda").launch_options("cuda")) == \
        {"num_warps", "num_stages"}
    assert set(cfg.launch_options("cuda")) == {"num_warps", "num_stages"}
    gfx950 = get_config(4096, 8, 4096, 14336, 2, torch.bfloat16, backend="hip", arch="gfx950")
    assert gfx950.kpack is None  # kpack is a gfx942 knob


def test_tuned_file_nearest_batch(tmp_path):
    d = tmp_path / device_config_name(torch.device("cpu"))
    d.mkdir()
    entry = dict(BLOCK_N=64, BLOCK_K=64, BLOCK_H=64, num_warps=4, num_stages=2)
    (d / shape_file_name(8, 4096, 14336, 2, torch.bfloat16)).write_text(json.dumps(
        {"1": {"BLOCK_M": 16, **entry}, "128": {"BLOCK_M": 32, **entry}, "4096": {"BLOCK_M": 64, **entry}}))
    pick = lambda M: get_config(M, 8, 4096, 14336, 2, torch.bfloat16, device=torch.device("cpu"),
                                config_dir=str(tmp_path)).BLOCK_M
    assert [pick(1), pick(60), pick(100), pick(3000), pick(65536)] == [16, 16, 32, 64, 64]
    shipped = get_config(4096, 8, 4096, 14336, 2, torch.bfloat16, device=torch.device("cpu"),
                         config_dir=str(tmp_path), tuned=False)  # what a GPU without the file gets
    assert shipped == get_config(4096, 8, 4096, 14336, 2, torch.bfloat16, device=torch.device("cpu"))
    assert shipped.BLOCK_M == 128


def test_invalid_configs_are_refused():
    with pytest.raises(ValueError, match="BLOCK_N must be a power of two >= 16"):
        FusedMoEConfig(BLOCK_M=16, BLOCK_N=24, BLOCK_K=32, BLOCK_H=32)
    with pytest.raises(ValueError, match="s2_num_warps must be a power of two"):
        FusedMoEConfig(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, BLOCK_H=16, s2_num_warps=3)
    with pytest.raises(ValueError, match="S2_GROUP_M must be an int >= 1"):
        FusedMoEConfig(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, BLOCK_H=16, S2_GROUP_M=0)
    with pytest.raises(ValueError, match="unknown config keys"):
        FusedMoEConfig.from_dict(dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, BLOCK_H=16, BLOCK_Q=1))


def test_two_stage_fields_round_trip_and_are_validated():
    cfg = FusedMoEConfig(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, BLOCK_H=128, path="two_stage", S2_BLOCK_N=256)
    assert FusedMoEConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.launch_options("cuda", stage2=True) == {"num_warps": cfg.s2_num_warps, "num_stages": cfg.s2_num_stages}
    assert "S2_BLOCK_N" not in FusedMoEConfig(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, BLOCK_H=16).to_dict()
    with pytest.raises(ValueError, match="config path must be one of"):
        FusedMoEConfig(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, BLOCK_H=16, path="split")


def test_tuned_files_are_only_used_for_the_gpu_that_is_here(tmp_path, monkeypatch):
    import fmoe2.gemm.config as config

    monkeypatch.setattr(config, "device_config_name", lambda device=None: "SOME_GPU")
    d = tmp_path / "SOME_GPU"
    d.mkdir()
    (d / shape_file_name(8, 4096, 14336, 2, torch.bfloat16)).write_text(json.dumps(
        {"1": dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, BLOCK_H=64)}))
    here = get_config(1, 8, 4096, 14336, 2, torch.bfloat16, config_dir=str(tmp_path), backend=config.current_backend())
    other = get_config(1, 8, 4096, 14336, 2, torch.bfloat16, config_dir=str(tmp_path), backend="hip", arch="gfx942")
    assert here.BLOCK_M == 64  # the tuned 128, fitted (fused path, widened BLOCK_N) to the register budget
    assert other.BLOCK_M == 16 and other.waves_per_eu is not None


def test_fit_config_switches_path_and_applies_the_precision_cap():
    cfg = FusedMoEConfig(BLOCK_M=16, BLOCK_N=16, BLOCK_K=64, BLOCK_H=64)
    fused = fit_config(cfg, 4096, 14336, 2, torch.bfloat16)
    assert fused.path == "fused" and 2 * -(-14336 // fused.BLOCK_N) <= 128
    two = fit_config(cfg, 4096, 14336, 2, torch.bfloat16, path="two_stage")
    assert two.path == "two_stage" and two.BLOCK_N == 16  # the cap is for the fused path only
    assert fit_config(fused, 4096, 14336, 2, torch.bfloat16) == fused  # idempotent


def test_fit_config_caps_stage2_k_shares():
    cfg = FusedMoEConfig(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, BLOCK_H=64, path="two_stage", S2_BLOCK_K=64,
                         S2_SPLIT_K=32)
    assert fit_config(cfg, 2048, 768, 8, torch.bfloat16).S2_SPLIT_K == 12  # 768 / 64 K steps, none empty
    assert fit_config(cfg, 2048, 4096, 8, torch.bfloat16).S2_SPLIT_K == 16  # 8 * 16 = MAX_ATOMIC_ADDS
    assert fit_config(cfg, 2048, 4096, 8, torch.float32).S2_SPLIT_K == 32  # fp32 outputs: no precision cap
    assert fit_config(cfg, 2048, 40, 1, torch.bfloat16).S2_SPLIT_K == 1  # one K step (S2_BLOCK_K capped to 64)
    # 4 K steps in 3 shares would be 2, 2 and 0 steps: 2 shares of 2.
    three = replace(cfg, S2_SPLIT_K=3)
    assert fit_config(three, 2048, 256, 2, torch.bfloat16).S2_SPLIT_K == 2
    assert fit_config(fit_config(three, 2048, 256, 2, torch.bfloat16), 2048, 256, 2, torch.bfloat16).S2_SPLIT_K == 2
    with pytest.raises(ValueError, match="S2_SPLIT_K must be an int >= 1"):
        FusedMoEConfig(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, BLOCK_H=16, S2_SPLIT_K=0)


def test_fit_lora_config_keeps_what_was_measured_to_fit():
    from fmoe2.gemm.config import fit_lora_config

    small = FusedMoEConfig(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, BLOCK_H=128, num_stages=4)
    small_decode = fit_lora_config(small, one_wave=True)
    assert small_decode.num_stages == 4 and small_decode.BLOCK_K == 128 and small_decode.num_warps == 4  # 135 KB
    assert small_decode.lora_num_stages == 4
    large = FusedMoEConfig(BLOCK_M=32, BLOCK_N=128, BLOCK_K=128, BLOCK_H=128, num_stages=4)
    large_batch = fit_lora_config(large, one_wave=False)
    # Tiles without adapters keep the plain loops' stages; the LoRA loops get 3 (233-307 KB with 4).
    assert (large_batch.BLOCK_M, large_batch.num_stages, large_batch.lora_num_stages, large_batch.num_warps,
            large_batch.BLOCK_K) == (32, 4, 3, 8, 128)
    tall = fit_lora_config(FusedMoEConfig(BLOCK_M=64, BLOCK_N=256, BLOCK_K=64, BLOCK_H=64, num_stages=3), False)
    assert tall.BLOCK_K == 32 and tall.BLOCK_M == 64  # BLOCK_K=64 needed 270336 B (264 KiB)
    for cfg, one_wave in ((large_batch, False), (small_decode, True), (tall, False)):
        assert fit_lora_config(cfg, one_wave) == cfg  # idempotent
    # Two-stage configs carry no adapter work in their loops: unchanged.
    two = FusedMoEConfig(BLOCK_M=64, BLOCK_N=256, BLOCK_K=64, BLOCK_H=64, num_warps=4, path="two_stage")
    assert fit_lora_config(two, False) == two


def test_fit_lora_config_keeps_the_plain_kernels_warps_and_occupancy_beyond_one_wave():
    # Warps and shared memory are the whole kernel's. Within one wave (a program per multiprocessor at
    # most) the pick's 4 warps stay and the LoRA loops may take 4 stages; beyond it 8 warps, and 3
    # stages, which keep two programs per multiprocessor (4 stages of this tiling: 150 KB).
    from fmoe2.gemm.config import fit_lora_config, fused_grid_fits_one_wave

    wide = FusedMoEConfig(BLOCK_M=16, BLOCK_N=128, BLOCK_K=64, BLOCK_H=128, num_warps=4, num_stages=4)
    one_wave = fit_lora_config(wide, one_wave=True)
    assert (one_wave.num_warps, one_wave.lora_num_stages) == (4, 4)
    waves = fit_lora_config(wide, one_wave=False)
    assert (waves.num_warps, waves.lora_num_stages) == (8, 3)
    assert fit_lora_config(replace(wide, BLOCK_N=64), False).num_warps == 4  # narrow tiles never spilled
    # DeepSeek-V2-Lite (E=64, I=1408: 11 slices of 128) on 132 multiprocessors: M=2 routes 12 rows, 12 tiles
    # at most, 132 programs; M=3 18 tiles, 198 programs. Full tiles count on top of one per expert hit.
    assert fused_grid_fits_one_wave(wide, 2, 64, 1408, 6, 132)
    assert not fused_grid_fits_one_wave(wide, 3, 64, 1408, 6, 132)
    assert fused_grid_fits_one_wave(wide, 1, 64, 1408, 6, 66)
    tall = replace(wide, BLOCK_M=64)  # E=4, topk=2: 512 rows in (4 + 8) x 11 programs, 576 in (4 + 9) x 11
    assert fused_grid_fits_one_wave(tall, 256, 4, 1408, 2, 132)
    assert not fused_grid_fits_one_wave(tall, 288, 4, 1408, 2, 132)


def test_lora_stages_reach_only_the_lora_kernel():
    # The plain kernel does not take LORA_STAGES, so a LoRA-fitted config (different lora_num_stages) compiles no
    # second copy of it; with adapters it is the fitted depth.
    from fmoe2.codegen import _meta_lora
    from fmoe2.gemm.config import fit_lora_config
    from fmoe2.gemm.launches import MoEProblem, fused_kernel_launch
    from fmoe2.sorting import MoESortingResult
    from fmoe2.target import NAMED_TARGETS

    M, E, H, I, topk = 4, 8, 64, 128, 2
    meta = dict(device="meta", dtype=torch.bfloat16)
    problem = MoEProblem(torch.empty(M, H, **meta), torch.empty(E, 2 * I, H, **meta), torch.empty(E, H, I, **meta),
                         False, E, H, I, topk)
    cfg = FusedMoEConfig(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, BLOCK_H=128, num_stages=4)
    fitted = fit_lora_config(cfg, one_wave=True)
    assert fitted.lora_num_stages == 3
    sorting = MoESortingResult.allocate(M * topk, E, 16, M, "meta")
    sm90 = NAMED_TARGETS["sm_90"]
    plain = [fused_kernel_launch(problem, problem.x, sorting, "silu", c, sm90).constexprs for c in (cfg, fitted)]
    assert "LORA_STAGES" not in plain[0] and plain[0] == plain[1]
    problem.lora = _meta_lora(2, E, H, I, 16, torch.bfloat16)
    problem.token_lora_ids = torch.empty(M, dtype=torch.int32, device="meta")
    sorting = MoESortingResult.allocate(M * topk, E, 16, M, "meta", count_lora_tokens=True)
    assert fused_kernel_launch(problem, problem.x, sorting, "silu", fitted, sm90).constexprs["LORA_STAGES"] == 3


def test_lora_pick_keeps_the_plain_path_and_fits_the_stages_that_carry_adapters(tmp_path):
    from fmoe2.gemm.config import (LORA_IN_STAGES_MAX_TOKENS_PER_EXPERT, fit_lora_config,
                                   fit_lora_config_to_problem, gate_up_loop_shared_bytes, lora_in_stages)

    d = tmp_path / device_config_name(torch.device("cpu"))
    d.mkdir()
    # The H100's Mixtral M=1 pick (tuned file) at 1 and 4096 tokens.
    two = dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, BLOCK_H=128, num_stages=3, path="two_stage", S2_BLOCK_N=128,
               S2_BLOCK_K=128, s2_num_stages=4)
    (d / shape_file_name(8, 4096, 14336, 2, torch.bfloat16)).write_text(json.dumps({"1": two, "4096": two}))
    pick = lambda M, **kw: get_config(M, 8, 4096, 14336, 2, torch.bfloat16, device=torch.device("cpu"),
                                      config_dir=str(tmp_path), **kw)
    edge = LORA_IN_STAGES_MAX_TOKENS_PER_EXPERT * 8 // 2  # M with exactly that many routed rows per expert
    for M in (1, 2, edge):
        # The deltas in the two stages; within the 232448 bytes of Hopper's shared memory as tuned.
        assert lora_in_stages(pick(M), M, 8, 2) and pick(M, lora=True) == pick(M)
    assert not lora_in_stages(pick(edge + 1), edge + 1, 8, 2) and pick(edge + 1, lora=True) == pick(edge + 1)
    assert pick(1, lora=True, path="fused").path == "fused"  # a forced path stays forced
    # The A100's 166912 bytes: stage 1's LoRA loop (204800 bytes at 3 stages) comes down to 2 stages, its
    # plain loop (139264) fits as it is.
    cfg = pick(1)
    fitted = fit_lora_config(cfg, False, 166912, 2, in_stages=True)
    assert (fitted.lora_num_stages, fitted.num_stages, fitted.BLOCK_K) == (2, 3, 128)
    assert fit_lora_config(fitted, False, 166912, 2, in_stages=True) == fitted  # idempotent
    assert fit_lora_config(cfg, False, 166912, 2) == cfg  # deltas by their own launches: stages carry none
    # 64 KiB (gfx942): both loops at 2 stages, then BLOCK_K halved.
    small = fit_lora_config(cfg, False, 65536, 2, in_stages=True)
    assert (small.lora_num_stages, small.num_stages, small.BLOCK_K) == (2, 2, 64)
    assert gate_up_loop_shared_bytes(small, 2) <= 65536
    # Stage 1's slices at least LORA_MIN_BLOCK_N wide (the H200's pick has 64 columns at M=1), within I.
    narrow = replace(cfg, BLOCK_N=64, num_stages=4)
    wide = fit_lora_config_to_problem(narrow, 1, 8, 4096, 14336, 2, torch.bfloat16, 132)
    assert (wide.BLOCK_N, wide.BLOCK_K, wide.num_stages, wide.lora_num_stages, wide.num_warps) == (128, 128, 4, 3, 4)
    assert fit_lora_config_to_problem(narrow, 1, 8, 4096, 40, 2, torch.bfloat16, 132).BLOCK_N == 64  # I = 40
    assert fit_lora_config_to_problem(narrow, 5, 8, 4096, 14336, 2, torch.bfloat16, 132) == narrow  # 1.25 rows
    # Fused picks only get the adapters' fit.
    fused = dict(two, path="fused")
    (d / shape_file_name(8, 512, 256, 2, torch.bfloat16)).write_text(json.dumps({"1": fused}))
    plain = get_config(1, 8, 512, 256, 2, torch.bfloat16, device=torch.device("cpu"), config_dir=str(tmp_path))
    assert get_config(1, 8, 512, 256, 2, torch.bfloat16, device=torch.device("cpu"), config_dir=str(tmp_path),
                      lora=True) == fit_lora_config(plain, True)


def test_lora_fit_counts_the_grid_of_the_problem(tmp_path):
    # get_config(lora=True) and a caller's config (pick_config) both fit by the problem's grid. Without a
    # GPU the target has DEFAULT_NUM_SMS (132): DeepSeek-V2-Lite's grid is one wave up to M=2
    # (12 tiles x 11 slices), not at M=3 (18 x 11).
    from fmoe2.codegen import _meta_lora
    from fmoe2.target import DEFAULT_NUM_SMS, target_of
    from fmoe2.gemm.fused_moe import MoEProblem, pick_config
    from fmoe2.target import target_of

    assert target_of(torch.device("cpu")).num_sms == DEFAULT_NUM_SMS == 132
    E, H, I, topk = 64, 2048, 1408, 6
    fused = dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=64, BLOCK_H=128, num_warps=4, num_stages=4)
    d = tmp_path / device_config_name(torch.device("cpu"))
    d.mkdir()
    (d / shape_file_name(E, H, I, topk, torch.bfloat16)).write_text(json.dumps({"1": fused}))
    meta = dict(device="meta", dtype=torch.bfloat16)
    for M, expected in ((2, (4, 4)), (3, (8, 3))):
        pick = get_config(M, E, H, I, topk, torch.bfloat16, device=torch.device("cpu"), config_dir=str(tmp_path),
                          lora=True)
        assert (pick.num_warps, pick.lora_num_stages) == expected, M
        problem = MoEProblem(torch.empty(M, H, **meta), torch.empty(E, 2 * I, H, **meta), torch.empty(E, H, I, **meta),
                             False, E, H, I, topk)
        problem.lora = _meta_lora(2, E, H, I, 16, torch.bfloat16)
        given = pick_config(problem, FusedMoEConfig(**fused), "auto", target_of(problem.x.device))
        assert (given.num_warps, given.lora_num_stages) == expected, M


def test_fit_lora_config_keeps_the_lora_loops_within_shared_memory():
    from fmoe2.gemm.config import fit_lora_config, gate_up_loop_shared_bytes
    from fmoe2.target import DEFAULT_SHARED_MEMORY, target_of

    assert target_of(torch.device("cpu")).shared_memory == DEFAULT_SHARED_MEMORY == 232448  # the H100/H200's

    wide = FusedMoEConfig(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, BLOCK_H=128, num_warps=8, num_stages=3)
    assert gate_up_loop_shared_bytes(wide, 3) == 204800  # what sm_80 and sm_90 reported with 4 adapter slots
    assert gate_up_loop_shared_bytes(wide, 3, lora=False) == 139264  # the plain loop (sm_80 report)
    assert fit_lora_config(wide, False).lora_num_stages == 3  # 227 KiB (H100/H200, the default)
    a100 = fit_lora_config(wide, False, shared_memory=166912)
    assert a100.lora_num_stages == 2 and a100.num_stages == 3  # the plain loops keep theirs
    assert fit_lora_config(a100, False, shared_memory=166912) == a100
    # fp32 inputs on the H100: the plain loop's 3 stages took 278528 bytes; both loops get 2 (204800 for the LoRA one).
    fp32 = fit_lora_config(wide, False, element_bytes=4)
    assert (fp32.num_stages, fp32.lora_num_stages, fp32.BLOCK_K) == (2, 2, 128)
    assert fit_lora_config(fp32, False, element_bytes=4) == fp32
    # Past 2 stages each, BLOCK_K is halved: on sm_80 fp32 needs 102400 bytes per K of 64.
    a100_fp32 = fit_lora_config(wide, False, shared_memory=166912, element_bytes=4)
    assert (a100_fp32.num_stages, a100_fp32.lora_num_stages, a100_fp32.BLOCK_K) == (2, 2, 64)
    tiny = fit_lora_config(wide, False, shared_memory=1024)
    assert (tiny.num_stages, tiny.lora_num_stages, tiny.BLOCK_K) == (2, 2, 16)  # never below 2 stages and 16
    narrow = FusedMoEConfig(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, BLOCK_H=128, num_warps=4, num_stages=4)
    assert fit_lora_config(narrow, True).lora_num_stages == 4  # 208896 bytes
    assert fit_lora_config(narrow, True, shared_memory=166912).lora_num_stages == 3


def test_plain_loops_fit_shared_memory_for_the_input_dtype():
    import glob
    import os

    import fmoe2.shapes
    from fmoe2.gemm.config import (CONFIG_DIR, LEAST_PACKED_K_STEP, TUNED_SECTIONS, fit_packed_config,
                                   fit_shared_memory, pipelined_loop_bytes)
    from fmoe2.target import DEFAULT_SHARED_MEMORY

    # What Triton asked for at launch on the H100 with fp32 inputs (both failed there before the fit).
    assert pipelined_loop_bytes(3, (16 + 2 * 128) * 128, 4) == 278528
    assert pipelined_loop_bytes(4, (128 + 256) * 64, 4) == 294912
    # Every shipped tuned config (bf16) fits as it is.
    tuned = glob.glob(os.path.join(CONFIG_DIR, "*", "*.json"))
    assert tuned
    for path in tuned:
        with open(path) as f:
            tuned_file = json.load(f)
            entries = [e for m, e in tuned_file.items() if m.isdigit()]
            entries += list(tuned_file.get("deterministic", {}).values())  # deterministic mode's own
            fp8 = list(tuned_file.get("fp8", {}).values())  # fp8 weights' own (fmoe2.tune --dtype fp8)
            # (the tuner's record of each entry's check against the reference: not an entry)
            assert set(tuned_file) - set(TUNED_SECTIONS) - {"checked"} == {m for m in tuned_file if m.isdigit()}, path
            weight_only = {s: tuned_file[s] for s in TUNED_SECTIONS if s in tuned_file and s in LEAST_PACKED_K_STEP}
            for fmt, section in weight_only.items():  # (fmoe2.tune --weights F: stored as the forward ran them)
                for entry in section.values():
                    cfg = FusedMoEConfig.from_dict(entry)
                    assert fit_packed_config(cfg, weight_format=fmt) == cfg, (path, fmt, entry)
            for entry in entries:
                cfg = FusedMoEConfig.from_dict(entry)
                assert fit_shared_memory(cfg, 2) == cfg, (path, entry)
            for entry in fp8:  # stored as they ran: K steps of one activation group, pointer loads
                cfg = FusedMoEConfig.from_dict(entry)
                assert (cfg.BLOCK_K, cfg.tma) == (128, False) and cfg.path in ("fused", "two_stage"), (path, entry)
                assert cfg.path == "fused" or cfg.S2_BLOCK_K == 128, (path, entry)
    # Defaults: unchanged for bf16; for fp32 every loop of every pick fits.
    cpu = torch.device("cpu")
    for E, H, I, topk in fmoe2.shapes.SHAPES.values():
        for M in (1, 16, 128, 1024, 4096, 16384):
            for path in ("auto", "fused", "two_stage"):
                bf16 = get_config(M, E, H, I, topk, torch.bfloat16, backend="cuda", device=cpu, tuned=False,
                                  path=path)
                assert fit_shared_memory(bf16, 2) == bf16
                cfg = get_config(M, E, H, I, topk, torch.float32, backend="cuda", device=cpu, tuned=False, path=path)
                loops = [(cfg.num_stages, (cfg.BLOCK_M + 2 * cfg.BLOCK_N) * cfg.BLOCK_K)]
                loops.append((cfg.num_stages, cfg.BLOCK_H * cfg.BLOCK_N) if cfg.path == "fused" else
                             (cfg.s2_num_stages, (cfg.BLOCK_M + cfg.S2_BLOCK_N) * cfg.S2_BLOCK_K))
                assert all(pipelined_loop_bytes(st, n, 4) <= DEFAULT_SHARED_MEMORY for st, n in loops), (M, cfg)
                assert cfg.num_stages >= 2 and cfg.s2_num_stages >= 2
    # Stages come down first (to 2), then K tiles halve; stage 2 alike.
    wide = FusedMoEConfig(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, BLOCK_H=128, num_warps=8, num_stages=3)
    assert (fit_shared_memory(wide, 4).num_stages, fit_shared_memory(wide, 4).BLOCK_K) == (2, 128)
    assert (fit_shared_memory(wide, 4, 100_000).num_stages, fit_shared_memory(wide, 4, 100_000).BLOCK_K) == (2, 64)
    two = FusedMoEConfig(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, BLOCK_H=128, GROUP_M=8, num_warps=8, num_stages=4,
                         path="two_stage", S2_BLOCK_N=256, S2_BLOCK_K=64, s2_num_stages=4)
    fitted = fit_shared_memory(two, 4)
    assert (fitted.num_stages, fitted.BLOCK_K, fitted.s2_num_stages, fitted.S2_BLOCK_K) == (3, 64, 3, 64)
    # A caller's config is fitted too (fused_moe, through pick_config).
    assert fit_config(two, 2048, 768, 8, torch.float32) == fitted


def test_lora_fit_widens_narrow_fused_slices_beyond_one_wave(tmp_path):
    # Every slice program of a tile reads the tile's gate/up A over all of H: with adapters, fused slices
    # beyond one wave are LORA_MIN_BLOCK_N wide (H200 Qwen3 M=16: 64 columns ran mixed adapters 1.36x of
    # the plain forward, 128 columns 1.09x). Within one wave (Qwen3 M=1: 8 tiles x 12 slices of 64) they stay.
    from fmoe2.codegen import _meta_lora
    from fmoe2.gemm.config import LORA_MIN_BLOCK_N, fit_lora_config_to_problem
    from fmoe2.gemm.fused_moe import MoEProblem, pick_config
    from fmoe2.target import target_of

    E, H, I, topk = 128, 2048, 768, 8
    narrow = FusedMoEConfig(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, BLOCK_H=128, num_warps=4, num_stages=4, tma=True)
    fit = lambda cfg, M, inter=I, dtype=torch.bfloat16, backend="cuda": fit_lora_config_to_problem(
        cfg, M, E, H, inter, topk, dtype, 132, backend)
    decode = fit(narrow, 1)
    assert decode.BLOCK_N == 64 and decode.num_warps == 4 and decode.lora_num_stages == 4
    batch = fit(narrow, 16)
    # Widened like the atomic-add cap widens: weight tile 2 x 128 x 128 = 32768 elements, 3 stages on CUDA
    # (4 would take 4 x 64 KB), 8 warps to hold it (and fit_lora_config's rule beyond one wave).
    assert LORA_MIN_BLOCK_N == 128
    assert (batch.BLOCK_N, batch.BLOCK_K, batch.BLOCK_H, batch.num_stages, batch.num_warps, batch.lora_num_stages,
            batch.tma, batch.BLOCK_M) == (128, 128, 128, 3, 8, 3, True, 16)
    assert fit(batch, 16) == batch  # idempotent (fused_moe fits a given config again)
    hip = fit(narrow, 16, backend="hip")  # 64 KiB of LDS: 2 stages of a 16384-element tile
    assert (hip.BLOCK_N, hip.num_stages, hip.BLOCK_K) == (128, 2, 64)
    assert fit(narrow, 16, inter=40).BLOCK_N == 64  # never wider than next_pow2(I)
    fp32 = fit(narrow, 16, dtype=torch.float32)  # fp32 outputs too (no atomic-add cap there), within 227 KiB
    assert (fp32.BLOCK_N, fp32.num_stages, fp32.lora_num_stages) == (128, 2, 2)
    assert fit(replace(narrow, BLOCK_N=256), 16).BLOCK_N == 256  # wide picks unchanged
    two = replace(narrow, path="two_stage")
    assert fit(two, 32) == two  # 2 routed rows per expert: the two-stage loops carry no adapter work
    assert fit(two, 16) == replace(two, BLOCK_N=128, lora_num_stages=3)  # 1 row: deltas in the stages
    # The pick and a caller's config get the same fit.
    d = tmp_path / device_config_name(torch.device("cpu"))
    d.mkdir()
    (d / shape_file_name(E, H, I, topk, torch.bfloat16)).write_text(json.dumps({"16": narrow.to_dict()}))
    for M in (1, 16):
        pick = get_config(M, E, H, I, topk, torch.bfloat16, device=torch.device("cpu"), config_dir=str(tmp_path),
                          lora=True)
        assert pick.BLOCK_N == (64 if M == 1 else 128), M
        assert get_config(M, E, H, I, topk, torch.bfloat16, device=torch.device("cpu"),
                          config_dir=str(tmp_path)).BLOCK_N == 64  # the plain pick keeps its slices
        meta = dict(device="meta", dtype=torch.bfloat16)
        problem = MoEProblem(torch.empty(M, H, **meta), torch.empty(E, 2 * I, H, **meta), torch.empty(E, H, I, **meta),
                             False, E, H, I, topk)
        problem.lora = _meta_lora(2, E, H, I, 16, torch.bfloat16)
        assert pick_config(problem, narrow, "auto", target_of(problem.x.device)) == pick, M


def test_codegen_knows_the_multiprocessors_of_every_target():
    from fmoe2.codegen import TARGET_MULTIPROCESSORS, TARGET_SHARED_MEMORY, TARGETS

    assert set(TARGET_MULTIPROCESSORS) == set(TARGETS)
    assert set(TARGET_SHARED_MEMORY) == set(TARGETS)  # the LoRA fit's shared memory per target


def test_default_rules_of_the_served_shapes_sweep():
    # configs/defaults.json after the H100 sweep of 13 shapes (misc/bench/defaults, 2026-11-28).
    from fmoe2.gemm.config import ConfigMode, ConfigProblem, resolve_config
    from fmoe2.shapes import ALL_SHAPES
    from fmoe2.target import NAMED_TARGETS

    def pick(name, M, target="sm_90", fp8=False, config=None):
        return resolve_config(ConfigProblem(M, *ALL_SHAPES[name], torch.bfloat16), ConfigMode(fp8=fp8),
                              NAMED_TARGETS[target], config)

    # A fused grid of fewer than 0.4 programs per multiprocessor takes the two-stage path: Qwen3-235B's TP4 and TP8
    # slices and DeepSeek-V3's TP8 slice at M=1 (48, 24 and 32 programs on 132 multiprocessors); the TP2 slice (96)
    # and the whole models stay fused, as does Llama-4-Scout (64).
    for name in ("qwen3-235b-a22b-tp4", "qwen3-235b-a22b-tp8", "deepseek-v3-tp8"):
        assert pick(name, 1).path == "two_stage", name
    for name in ("qwen3-235b-a22b-tp2", "qwen3-235b-a22b", "deepseek-v3", "qwen3-30b-a3b", "llama-4-scout"):
        assert pick(name, 1).path == "fused", name
    # A caller's fused config is run as given, however small its grid.
    given = FusedMoEConfig(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, BLOCK_H=128)
    assert pick("qwen3-235b-a22b-tp8", 1, config=given).path == "fused"
    # 16 rows per expert overflow 16-row tiles: gpt-oss-20b M=128 takes the 64-row two-stage rule; 8 rows stay fused.
    assert (pick("gpt-oss-20b", 128).BLOCK_M, pick("gpt-oss-20b", 128).path) == (64, "two_stage")
    assert pick("qwen3-30b-a3b", 128).path == "fused"
    # The two-stage rules take tensor descriptors and PDL on CUDA; HIP's rules are unchanged.
    for M in (1024, 4096):
        cfg = pick("glm-4.5-air", M)
        assert cfg.path == "two_stage" and cfg.tma and cfg.pdl, cfg
        assert not pick("glm-4.5-air", M, "gfx942").tma
    # fp8 weights keep pointer loads (fit_fp8_config).
    assert not pick("deepseek-v3", 4096, fp8=True).tma


def test_an_expert_parallel_slice_takes_the_full_models_config():
    # With expert_map (global id -> local id or -1), rows per local expert are M * topk / E_global, as in the full
    # model: the config is picked for the full model's shape (its tuned file too), not for E_local experts.
    from fmoe2.gemm.fused_moe import pick_config
    from fmoe2.gemm.launches import MoEProblem
    from fmoe2.target import NAMED_TARGETS

    meta = dict(device="meta", dtype=torch.bfloat16)
    E, H, I, topk = 256, 7168, 2048, 8

    def pick(M, local, routed):
        problem = MoEProblem(torch.empty(M, H, **meta), torch.empty(local, 2 * I, H, **meta),
                             torch.empty(local, H, I, **meta), False, local, H, I, topk, routed_experts=routed)
        return pick_config(problem, None, "auto", NAMED_TARGETS["sm_90"])

    for M in (1, 16, 128, 1024, 4096):
        assert pick(M, E // 8, E) == pick(M, E, None), M
    # Without the global count, 32 local experts would read M=128 as 32 rows per expert (64-row two-stage tiles)
    # where each gets 4 (16-row fused tiles).
    assert (pick(128, E // 8, E).BLOCK_M, pick(128, E // 8, E).path) == (16, "fused")
    assert (pick(128, E // 8, None).BLOCK_M, pick(128, E // 8, None).path) == (64, "two_stage")


def test_n_contiguous_concatenated_weights_get_slices_of_whole_cache_lines(monkeypatch):
    # Transposed (N-contiguous) [E, H, 2I] views with gate rows then up rows: each K row of a gate or up tile is
    # BLOCK_N elements. The H200's gpt-oss-20b pick at M=1 and 8 (two-stage, BLOCK_N=32: 64-byte rows) compiled to
    # the same sm_90 code for every layout and ran 1.20x slower at M=8 with these weights than K-contiguous ones
    # (interleaved rows, 128 bytes: 0.99x). Picks take MIN_WEIGHT_ROW_BYTES per row there; other layouts and a
    # caller's config are kept.
    import importlib

    from fmoe2.gemm.config import MIN_WEIGHT_ROW_BYTES
    from fmoe2.gemm.launches import MoEProblem
    from fmoe2.target import NAMED_TARGETS

    fused_moe_module = importlib.import_module("fmoe2.gemm.fused_moe")  # (the package's name is the function)
    monkeypatch.setattr(fused_moe_module, "device_config_name", lambda device=None: "NVIDIA_H200")
    meta = dict(device="meta", dtype=torch.bfloat16)
    E, H, I, topk = 32, 2880, 2880, 4
    k_contiguous = torch.empty(E, 2 * I, H, **meta)
    n_contiguous = torch.empty(E, H, 2 * I, **meta).transpose(1, 2)

    def pick(M, w1, interleaved, config=None, deterministic=False):
        problem = MoEProblem(torch.empty(M, H, **meta), w1, torch.empty(E, H, I, **meta), interleaved, E, H, I, topk,
                             deterministic=deterministic)
        return fused_moe_module.pick_config(problem, config, "auto", NAMED_TARGETS["sm_90"])

    wide = MIN_WEIGHT_ROW_BYTES // 2
    for M in (1, 8):
        plain = pick(M, k_contiguous, False)
        assert (plain.path, plain.BLOCK_N) == ("two_stage", 32), plain
        assert pick(M, n_contiguous, True) == plain
        assert pick(M, n_contiguous, False) == replace(plain, BLOCK_N=wide)
        assert pick(M, n_contiguous, False, deterministic=True).BLOCK_N == wide
        assert pick(M, n_contiguous, False, config=plain) == plain  # the caller's choice
        # get_config answers the same when told the layout (its device name is not the H200: its tuned files asked)
        assert get_config(M, E, H, I, topk, torch.bfloat16, backend="cuda", arch=90, tuned_for="NVIDIA_H200",
                          n_contiguous_halves=True) == replace(plain, BLOCK_N=wide)
    for M in (128, 4096):  # picks with slices of 64 columns or more: kept
        assert pick(M, k_contiguous, False).BLOCK_N >= wide
        assert pick(M, n_contiguous, False) == pick(M, k_contiguous, False)
