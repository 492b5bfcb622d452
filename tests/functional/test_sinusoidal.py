import math

import pytest
import torch

from torchembed.functional import sinusoidal_table


def test_matches_paper_formula():
    table = sinusoidal_table(50, 16)
    for pos in (0, 1, 7, 49):
        for i in range(8):
            angle = pos / 10000 ** (2 * i / 16)
            assert table[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-7)
            assert table[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-7)


def test_offset_continues_table():
    torch.testing.assert_close(sinusoidal_table(5, 8, offset=10), sinusoidal_table(15, 8)[10:])


@pytest.mark.parametrize("dim", [7, 0, -2])
def test_errors(dim):
    with pytest.raises(ValueError, match="positive even"):
        sinusoidal_table(4, dim)
