"""Named MoE layer shapes (E, H, I, topk) used by the benchmark, the tuner, the codegen report and the
correctness grid.

``SHAPES`` are the benchmark's defaults; ``MORE_SHAPES`` it runs when named (``--shapes``), with the
options of their experts' computation in ``SHAPE_OPTIONS`` (what fused_moe and the baseline take
besides the default SwiGLU without biases). ``ALL_SHAPES``: every named shape, each a real model's expert sizes
(their published configs; DESIGN notes), all of which the correctness grid (``fmoe2/bench/correctness.py``) covers.
"""
SHAPES = {
    "mixtral-8x7b": (8, 4096, 14336, 2),
    "qwen3-30b-a3b": (128, 2048, 768, 8),
    "deepseek-v2-lite": (64, 2048, 1408, 6),
}
MORE_SHAPES = {
    "gpt-oss-20b": (32, 2880, 2880, 4),
    "deepseek-v3": (256, 7168, 2048, 8),
    "gpt-oss-120b": (128, 2880, 2880, 4),
    "qwen3-235b-a22b": (128, 4096, 1536, 8),
    "qwen1.5-moe-a2.7b": (60, 2048, 1408, 4),
    "olmoe-1b-7b": (64, 2048, 1024, 8),
    "llama-4-scout": (16, 5120, 8192, 1),
    "mixtral-8x22b": (8, 6144, 16384, 2),
    "glm-4.5-air": (128, 4096, 1408, 8),
    # Tensor-parallel slices: each of TP GPUs holds I / TP columns of every expert.
    **{f"qwen3-235b-a22b-tp{tp}": (128, 4096, 1536 // tp, 8) for tp in (2, 4, 8)},
    "deepseek-v3-tp8": (256, 7168, 2048 // 8, 8),
}
ALL_SHAPES = {**SHAPES, **MORE_SHAPES}
# The models people serve, whose tuned files fmoe2 ships (``python -m fmoe2.tune --shape served``), and on which
# ``python -m fmoe2.bench.defaults`` measures the default rules (issue 46's list).
SERVED_SHAPES = ("gpt-oss-20b", "gpt-oss-120b", "qwen3-235b-a22b", "qwen3-235b-a22b-tp2", "qwen3-235b-a22b-tp4",
                 "qwen3-235b-a22b-tp8", "deepseek-v3", "deepseek-v3-tp8", "mixtral-8x22b", "glm-4.5-air")
# biases: gate/up and down biases; the rest are fused_moe keyword arguments.
SHAPE_OPTIONS = {
    "gpt-oss-20b": dict(activation="swiglu_oai", swiglu_limit=7.0, biases=True),
    "gpt-oss-120b": dict(activation="swiglu_oai", swiglu_limit=7.0, biases=True),
}
