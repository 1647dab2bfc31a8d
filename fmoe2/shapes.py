"""Named MoE layer shapes (E, H, I, topk) used by the benchmark, the tuner and the codegen report."""
SHAPES = {
    "mixtral-8x7b": (8, 4096, 14336, 2),
    "qwen3-30b-a3b": (128, 2048, 768, 8),
    "deepseek-v2-lite": (64, 2048, 1408, 6),
}
