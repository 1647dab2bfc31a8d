"""The fused MoE GEMM: kernel, launcher, weight layout and configs."""
from .config import FusedMoEConfig, get_config
from .fused_moe import fused_moe
from .layout import PreparedMoEWeights, prepare_weights
from .lora import MoELoRA, PreparedMoELoRA, prepare_lora

__all__ = ["fused_moe", "prepare_weights", "PreparedMoEWeights", "FusedMoEConfig", "get_config", "MoELoRA",
           "PreparedMoELoRA", "prepare_lora"]
