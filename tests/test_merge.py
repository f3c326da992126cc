import math

import pytest
import torch
from helpers import DEVICE, poisoned

from moira import reference as ref
from moira.kernels.triton.merge import merge


@pytest.mark.parametrize("group", [1, 4, 7, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_merge_matches_reference(group, head_dim):
    # chunk floor 1, J = 6: a row of n pages has min(n, 6) chunks
    chunks_per_row, num_kv_heads, batch = 6, 2, 3
    page_counts = torch.tensor([[1, 2], [6, 4], [0, 5]], dtype=torch.int32, device=DEVICE)
    rows = batch * num_kv_heads
    partial_out = torch.randn(rows, chunks_per_row, group, head_dim, device=DEVICE)
    partial_lse = torch.randn(rows, chunks_per_row, group, device=DEVICE) * 3
    partial_lse[3, 1] = -math.inf  # a chunk without keys...
    partial_out[3, 1] = float("nan")  # ...whose output must not leak in
    partial_lse[5, :, 0] = -math.inf  # a query head with no key in any chunk
    out = poisoned(batch, num_kv_heads * group, head_dim)
    merge(page_counts, partial_out.flatten(), partial_lse.flatten(), out,
          num_kv_heads=num_kv_heads, chunk_floor=1, chunks_per_row=chunks_per_row)

    out = out.cpu().view(rows, group, head_dim)
    for row, chunks in enumerate(page_counts.flatten().tolist()):
        if chunks <= 1:
            assert torch.isnan(out[row].float()).all()  # single-chunk rows belong to Attend
            continue
        expected, _ = ref.merge(partial_out[row, :chunks].cpu(), partial_lse[row, :chunks].cpu())
        torch.testing.assert_close(out[row].float(), expected, rtol=1e-2, atol=1e-2)
    assert (out[5, 0] == 0).all()


@pytest.mark.parametrize("chunks_per_row", [33, 40])
def test_merge_of_more_chunks_than_one_load(chunks_per_row):
    """Rows of more than 32 chunks (the default at batch 1, J up to 128) merge in several
    loads of SPLITS_PER_LOAD chunks; the largest partial sits in the last load."""
    group, head_dim, num_kv_heads = 4, 64, 1
    page_counts = torch.tensor([[chunks_per_row], [chunks_per_row - 1], [31]], dtype=torch.int32,
                               device=DEVICE)
    rows = page_counts.numel()
    partial_out = torch.randn(rows, chunks_per_row, group, head_dim, device=DEVICE)
    partial_lse = torch.randn(rows, chunks_per_row, group, device=DEVICE)
    partial_lse[:, chunks_per_row - 2] += 6  # dominant, past the first 32
    out = poisoned(rows, num_kv_heads * group, head_dim)
    merge(page_counts, partial_out.flatten(), partial_lse.flatten(), out,
          num_kv_heads=num_kv_heads, chunk_floor=1, chunks_per_row=chunks_per_row)
    for row, chunks in enumerate(page_counts.flatten().tolist()):
        expected, _ = ref.merge(partial_out[row, :chunks].cpu(), partial_lse[row, :chunks].cpu())
        torch.testing.assert_close(out[row].float().cpu(), expected, rtol=1e-2, atol=1e-2)
