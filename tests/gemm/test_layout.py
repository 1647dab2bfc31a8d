"""Prepared weight layout: round trip, interleaving, padding, argument checks."""
import pytest
import torch

from fmoe2 import prepare_weights


@pytest.mark.parametrize("E,H,I,pad_to", [(3, 40, 24, 64), (2, 128, 64, 64), (1, 17, 5, 16)])
def test_round_trip_and_layout(E, H, I, pad_to):
    w1 = torch.randn(E, 2 * I, H, dtype=torch.float16)
    w2 = torch.randn(E, H, I, dtype=torch.float16)
    p = prepare_weights(w1, w2, pad_to=pad_to)
    h_pad, i_pad = -(-H // pad_to) * pad_to, -(-I // pad_to) * pad_to
    assert p.w13.shape == (E, 2 * i_pad, h_pad) and p.w2.shape == (E, h_pad, i_pad)
    assert p.w13.stride(1) * p.w13.element_size() % 16 == 0 or pad_to % 8  # rows 16-byte aligned
    assert torch.equal(p.w13[:, 0:2 * I:2, :H], w1[:, :I]) and torch.equal(p.w13[:, 1:2 * I:2, :H], w1[:, I:])
    assert (p.w13[:, 2 * I:] == 0).all() and (p.w13[:, :, H:] == 0).all()
    assert (p.w2[:, H:] == 0).all() and (p.w2[:, :, I:] == 0).all()
    back1, back2 = p.unprepare()
    assert torch.equal(back1, w1) and torch.equal(back2, w2)
    assert (p.num_experts, p.hidden_size, p.intermediate_size, p.dtype) == (E, H, I, torch.float16)


def test_bad_weights_are_refused():
    w1 = torch.randn(2, 8, 16)
    with pytest.raises(ValueError, match=r"w2 must have shape \[E, H, I\]"):
        prepare_weights(w1, torch.randn(2, 16, 5))
    with pytest.raises(TypeError, match="w2 must have dtype"):
        prepare_weights(w1, torch.randn(2, 16, 4, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"w1 must have shape \[E, 2I, H\]"):
        prepare_weights(torch.randn(2, 7, 16), torch.randn(2, 16, 3))
    with pytest.raises(TypeError, match="w1 must be a torch.Tensor"):
        prepare_weights(None, w1)
