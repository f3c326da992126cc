"""Imposed read fractions (moira/kernels/imposed.py) against reference.imposed_fractions."""

import math

import pytest
import torch
from helpers import DEVICE

from moira import reference as ref
from moira.benchmarking.imposed import imposed_fractions


@pytest.mark.parametrize("knot_tokens", [[1], [8192, 131072],
                                         [8192, 16384, 32768, 65536, 130000]])
@pytest.mark.parametrize("layers, heads", [(4, 8), (3, 5), (32, 8)])
def test_imposed_fractions_match_the_reference(knot_tokens, layers, heads):
    generator = torch.Generator().manual_seed(len(knot_tokens) * 100 + layers * heads)
    log_tokens = torch.tensor([math.log(t) for t in knot_tokens], dtype=torch.float32)
    tables = torch.rand(len(knot_tokens), layers, heads, generator=generator)
    # lengths below, at, between and beyond the knots, and a graph's padding rows (0)
    seq_lens = torch.tensor([0, 1, 4096, 8192, 8193, 12000, 16384, 50000, 130000, 131072,
                             500000, 0], dtype=torch.int32)
    expected = ref.imposed_fractions(seq_lens, log_tokens, tables)
    buffer = torch.full((layers, seq_lens.shape[0] + 3, heads), float("nan"), device=DEVICE)
    got = imposed_fractions(seq_lens.to(DEVICE), log_tokens.to(DEVICE), tables.to(DEVICE),
                            buffer)
    assert got.shape == (layers, seq_lens.shape[0], heads)
    assert got.data_ptr() == buffer.data_ptr()
    # (logs of the lengths may round an ulp apart: at a knot, alpha ~1e-7 instead of 0)
    torch.testing.assert_close(got.cpu(), expected, rtol=0, atol=1e-5)
    assert buffer[:, seq_lens.shape[0]:].isnan().all()  # rows past the batch left alone
    # clamped outside the knots: exactly the first and last knots' tables
    torch.testing.assert_close(got[:, 2].cpu(), tables[0], rtol=0, atol=0)
    torch.testing.assert_close(got[:, 10].cpu(), tables[-1], rtol=0, atol=0)


def test_reference_interpolates_in_log_length():
    log_tokens = torch.tensor([math.log(8192), math.log(32768)])
    tables = torch.tensor([[[0.4]], [[0.2]]])
    halfway = ref.imposed_fractions(torch.tensor([16384]), log_tokens, tables)
    torch.testing.assert_close(halfway, torch.tensor([[[0.3]]]))
