"""Programmatic dependent launch in kernels (``FusedMoEConfig.pdl``, CUDA sm_90+): ``gdc_wait``
(wait until the previous launch's results are visible), ``gdc_launch_dependents`` (let the next
launch be scheduled now) and ``dependent_launch_prologue`` (both, first thing in a chain member).
Triton builds without the CUDA backend may lack the first two; there they are no-op jit functions,
never reached, since PDL is only switched on for CUDA launches."""
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - Triton built for ROCm only
    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass



@triton.jit
def dependent_launch_prologue(PDL: tl.constexpr):
    """With PDL, first thing in a kernel: let the next launch be scheduled, then wait until the previous
    launch's results are visible. Every program waits before it reads anything or exits, so a launch
    cannot end before its predecessor and the chain (sort, [LoRA shrink, expand,] fused kernel or
    stage 1, [LoRA shrink, expand,] stage 2) stays ordered; a launch whose programs all exit at once
    costs little more than the wait."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()


__all__ = ["gdc_wait", "gdc_launch_dependents", "dependent_launch_prologue"]
