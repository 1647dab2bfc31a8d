"""Programmatic dependent launch in kernels (``FusedMoEConfig.pdl``, CUDA sm_90+): ``gdc_wait``
(wait until the previous launch's results are visible) and ``gdc_launch_dependents`` (let the next
launch be scheduled now). Triton builds without the CUDA backend may lack these; there the names
are no-op jit functions, never reached, since PDL is only switched on for CUDA launches."""
import triton

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - Triton built for ROCm only
    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass

__all__ = ["gdc_wait", "gdc_launch_dependents"]
