"""The 4-bit benchmark's int4 group (fmoe2/bench/quant4.py): one that divides both K sizes of the shape."""
import pytest

from fmoe2.bench.quant4 import int4_group
from fmoe2.shapes import ALL_SHAPES


def test_int4_group_divides_both_k_sizes():
    assert int4_group(4096, 1536) == 128
    assert int4_group(2880, 2880) == 64  # gpt-oss: 2880 = 45 x 64
    assert int4_group(96, 160) == 32
    with pytest.raises(ValueError, match="H=48, I=40"):
        int4_group(48, 40)
    for name, (E, H, I, topk) in ALL_SHAPES.items():
        if H % 32 == 0 and I % 32 == 0:
            group = int4_group(H, I)
            assert H % group == 0 and I % group == 0, name
