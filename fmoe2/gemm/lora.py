"""Per-expert LoRA adapters for the fused MoE forward (multi-LoRA: one adapter per token).

Input layout (:class:`MoELoRA`, vLLM's ``fused_moe_lora`` convention), ``L`` = max adapters,
``R`` = rank::

    gate_a, up_a  [L, E, R, H]     gate_b, up_b  [L, E, I, R]
    down_a        [L, E, R, I]     down_b        [L, E, H, R]
    scaling       [L] float32      (a float is broadcast to every adapter)

For a token ``t`` with adapter ``l`` routed to expert ``e``::

    gate += s_l * (x_t gate_a[l,e]^T) gate_b[l,e]^T
    up   += s_l * (x_t up_a[l,e]^T)   up_b[l,e]^T
    out  += w_tk * (y_t W2_e^T + s_l * (y_t down_a[l,e]^T) down_b[l,e]^T)

Prepared layout (:class:`PreparedMoELoRA`, from :func:`prepare_lora`, once at load time), rank
padded with zeros to ``R_pad = max(16, next_pow2(R))`` (the smallest matrix-instruction width)::

    a13 [L, E, 2*R_pad, H_pad]   rows 0..R_pad-1 gate_a, rows R_pad.. up_a: one shrink product
                                  gives both gate and up shrinks
    b13 [L, E, 2*R_pad, I_pad]   gate_b^T then up_b^T (whatever the base layout)
    a2  [L, E, R_pad, I_pad]     b2 [L, E, R_pad, H_pad] (down_b^T)

Every operand keeps H or I as its contiguous dimension: the kernel picks adapter rows by a
run-time id, so only a contiguous H/I axis lets it load them as 16-byte vectors. B in vLLM's
``[..., rank]`` layout compiled to 2-byte loads: on the H200 the LoRA forward at Qwen3 M=1 took
40.5 us with it and 29.9 us with this layout (plain forward 25.1 us). ``H_pad``/``I_pad`` round
H and I up to ``pad_to`` (default 64) so rows start 16-byte aligned.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

import torch
import triton

from .._validation import FLOAT_DTYPES, check_tensor
from .layout import _round_up

MAX_LORAS = 16
MAX_LORA_RANK = 64
MIN_PADDED_RANK = 16  # tl.dot needs every dimension >= 16

Scaling = Union[float, Sequence[float], torch.Tensor]


def padded_rank(rank: int) -> int:
    """Rank the kernel runs at: the next power of two, at least 16 (zero padded)."""
    return max(MIN_PADDED_RANK, triton.next_power_of_2(rank))


def _scaling_tensor(scaling: Scaling, num_loras: int, device) -> torch.Tensor:
    if isinstance(scaling, bool):
        raise TypeError("scaling must be a float, a sequence of floats or a float tensor, got bool")
    if isinstance(scaling, (int, float)):
        return torch.full((num_loras,), float(scaling), dtype=torch.float32, device=device)
    if isinstance(scaling, torch.Tensor):
        if not scaling.is_floating_point():
            raise TypeError(f"scaling must be a floating-point tensor, got {scaling.dtype}")
        t = scaling
    else:
        try:
            if isinstance(scaling, str):
                raise TypeError
            t = torch.tensor([float(s) for s in scaling], dtype=torch.float32)
        except (TypeError, ValueError):
            raise TypeError(f"scaling must be a float, a sequence of floats or a float tensor, "
                            f"got {type(scaling).__name__}") from None
    if t.shape != (num_loras,):
        raise ValueError(f"scaling must be a float or have shape [max_loras] = [{num_loras}], got {tuple(t.shape)}")
    return t.to(device=device, dtype=torch.float32).contiguous()


@dataclass
class MoELoRA:
    """Adapter weights for the gate, up and down projections of every expert (module docstring).

    Shapes are checked on construction; experts or adapters without a LoRA simply hold zeros.
    Pass it (or, better, :func:`prepare_lora` of it, done once) to ``fused_moe(..., lora=...)``.
    """

    gate_a: torch.Tensor  # [L, E, R, H]
    gate_b: torch.Tensor  # [L, E, I, R]
    up_a: torch.Tensor  # [L, E, R, H]
    up_b: torch.Tensor  # [L, E, I, R]
    down_a: torch.Tensor  # [L, E, R, I]
    down_b: torch.Tensor  # [L, E, H, R]
    scaling: Scaling = 1.0  # float or [L]

    def __post_init__(self):
        check_tensor("lora.gate_a", self.gate_a, ndim=4, dtypes=FLOAT_DTYPES, shape_doc="[max_loras, E, rank, H]",
                     contiguous=False)
        L, E, R, H = self.gate_a.shape
        dtype, device = self.gate_a.dtype, self.gate_a.device
        if not 1 <= L <= MAX_LORAS:
            raise ValueError(f"lora.gate_a: max_loras must be in [1, {MAX_LORAS}], got {L}")
        if not 1 <= R <= MAX_LORA_RANK:
            raise ValueError(f"lora.gate_a: rank must be in [1, {MAX_LORA_RANK}], got {R}")
        if E < 1 or H < 1:
            raise ValueError(f"lora.gate_a must have E >= 1 and H >= 1, got shape {tuple(self.gate_a.shape)}")
        check_tensor("lora.gate_b", self.gate_b, ndim=4, dtypes=(dtype,), shape_doc="[max_loras, E, I, rank]",
                     contiguous=False)
        inter = self.gate_b.shape[2]
        expected = {
            "up_a": ((L, E, R, H), "[max_loras, E, rank, H]"),
            "gate_b": ((L, E, inter, R), "[max_loras, E, I, rank]"),
            "up_b": ((L, E, inter, R), "[max_loras, E, I, rank]"),
            "down_a": ((L, E, R, inter), "[max_loras, E, rank, I]"),
            "down_b": ((L, E, H, R), "[max_loras, E, H, rank]"),
        }
        for name, (shape, doc) in expected.items():
            t = getattr(self, name)
            check_tensor(f"lora.{name}", t, dtypes=(dtype,), shape=shape,
                         shape_doc=f"{doc} = {list(shape)} (like gate_a {list(self.gate_a.shape)})", contiguous=False)
            if t.device != device:
                raise ValueError(f"lora.{name} is on {t.device} but lora.gate_a is on {device}")
        if inter < 1:
            raise ValueError(f"lora.gate_b must have I >= 1, got shape {tuple(self.gate_b.shape)}")
        self.scaling = _scaling_tensor(self.scaling, L, device)

    @property
    def num_loras(self) -> int:
        return self.gate_a.shape[0]

    @property
    def num_experts(self) -> int:
        return self.gate_a.shape[1]

    @property
    def rank(self) -> int:
        return self.gate_a.shape[2]

    @property
    def hidden_size(self) -> int:
        return self.gate_a.shape[3]

    @property
    def intermediate_size(self) -> int:
        return self.gate_b.shape[2]

    @property
    def dtype(self) -> torch.dtype:
        return self.gate_a.dtype

    @property
    def device(self) -> torch.device:
        return self.gate_a.device


@dataclass
class PreparedMoELoRA:
    """:class:`MoELoRA` in the kernel's layout (module docstring); made by :func:`prepare_lora`."""

    a13: torch.Tensor  # [L, E, 2*R_pad, H_pad]
    b13: torch.Tensor  # [L, E, 2*R_pad, I_pad]
    a2: torch.Tensor  # [L, E, R_pad, I_pad]
    b2: torch.Tensor  # [L, E, R_pad, H_pad]
    scaling: torch.Tensor  # [L] float32
    rank: int  # logical rank R
    hidden_size: int
    intermediate_size: int

    def __post_init__(self):
        # A hand-built or cached object in another layout (B was [..., rank] before) would read
        # the wrong elements without any error: check every shape against the layout.
        check_tensor("lora.a13", self.a13, ndim=4, dtypes=FLOAT_DTYPES, shape_doc="[L, E, 2*R_pad, H_pad]")
        L, E, two_r_pad, h_pad = self.a13.shape
        R_pad, H, inter = padded_rank(self.rank), self.hidden_size, self.intermediate_size
        if two_r_pad != 2 * R_pad or h_pad < H:
            raise ValueError(f"lora.a13 must have shape [L, E, 2*R_pad, H_pad] = [{L}, {E}, {2 * R_pad}, >= {H}] "
                             f"(rank {self.rank} padded to {R_pad}), got {tuple(self.a13.shape)}")
        for name, rows, cols, doc in (("b13", 2 * R_pad, inter, "[L, E, 2*R_pad, I_pad] (gate_b^T, up_b^T)"),
                                      ("a2", R_pad, inter, "[L, E, R_pad, I_pad]"),
                                      ("b2", R_pad, H, "[L, E, R_pad, H_pad] (down_b^T)")):
            t = getattr(self, name)
            check_tensor(f"lora.{name}", t, ndim=4, dtypes=(self.a13.dtype,), shape_doc=doc)
            if tuple(t.shape[:3]) != (L, E, rows) or t.shape[3] < cols:
                raise ValueError(f"lora.{name} must have shape {doc} = [{L}, {E}, {rows}, >= {cols}], "
                                 f"got {tuple(t.shape)} (make it with fmoe2.prepare_lora)")
        check_tensor("lora.scaling", self.scaling, dtypes=(torch.float32,), shape=(L,), shape_doc=f"[L] = [{L}]")

    @property
    def num_loras(self) -> int:
        return self.a13.shape[0]

    @property
    def num_experts(self) -> int:
        return self.a13.shape[1]

    @property
    def padded_rank(self) -> int:
        return self.a2.shape[2]

    @property
    def dtype(self) -> torch.dtype:
        return self.a13.dtype

    @property
    def device(self) -> torch.device:
        return self.a13.device

    def tensors(self):
        return dict(a13=self.a13, b13=self.b13, a2=self.a2, b2=self.b2, scaling=self.scaling)

    def unprepare(self) -> MoELoRA:
        """The logical adapters back (for references and tests)."""
        R, R_pad, H, inter = self.rank, self.padded_rank, self.hidden_size, self.intermediate_size
        return MoELoRA(
            gate_a=self.a13[:, :, :R, :H], up_a=self.a13[:, :, R_pad:R_pad + R, :H],
            gate_b=self.b13[:, :, :R, :inter].transpose(2, 3), up_b=self.b13[:, :, R_pad:R_pad + R, :inter].transpose(2, 3),
            down_a=self.a2[:, :, :R, :inter], down_b=self.b2[:, :, :R, :H].transpose(2, 3), scaling=self.scaling.clone())


def prepare_lora(lora: MoELoRA, *, pad_to: int = 64) -> PreparedMoELoRA:
    """Converts :class:`MoELoRA` to the kernel's layout; call once at load time (allocates)."""
    if isinstance(lora, PreparedMoELoRA):
        return lora
    if not isinstance(lora, MoELoRA):
        raise TypeError(f"lora must be a fmoe2.MoELoRA or PreparedMoELoRA, got {type(lora).__name__}")
    if pad_to < 1:
        raise ValueError(f"pad_to must be >= 1, got {pad_to}")
    L, E, R, H = lora.gate_a.shape
    inter = lora.intermediate_size
    R_pad = padded_rank(R)
    h_pad, i_pad = _round_up(H, pad_to), _round_up(inter, pad_to)
    a13 = lora.gate_a.new_zeros(L, E, 2 * R_pad, h_pad)
    a13[:, :, :R, :H] = lora.gate_a
    a13[:, :, R_pad:R_pad + R, :H] = lora.up_a
    b13 = lora.gate_a.new_zeros(L, E, 2 * R_pad, i_pad)
    b13[:, :, :R, :inter] = lora.gate_b.transpose(2, 3)
    b13[:, :, R_pad:R_pad + R, :inter] = lora.up_b.transpose(2, 3)
    a2 = lora.gate_a.new_zeros(L, E, R_pad, i_pad)
    a2[:, :, :R, :inter] = lora.down_a
    b2 = lora.gate_a.new_zeros(L, E, R_pad, h_pad)
    b2[:, :, :R, :H] = lora.down_b.transpose(2, 3)
    return PreparedMoELoRA(a13=a13, b13=b13, a2=a2, b2=b2, scaling=lora.scaling, rank=R, hidden_size=H,
                           intermediate_size=inter)
