import pytest
import torch
from helpers import DEVICE, make_cache, make_table, poisoned

import moira
from moira import reference as ref
from moira.config import PAGE_SIZE


def _untouched(summaries, pages):
    return torch.isnan(summaries[pages].float()).all()


@pytest.mark.parametrize("layout", ["contiguous", "packed", "hnd", "packed_hnd"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("summary_dtype", [torch.float32, torch.bfloat16])
def test_summarize_matches_reference(layout, head_dim, summary_dtype):
    num_kv_heads = 2
    keys, _ = make_cache(40, num_kv_heads, head_dim, layout=layout)
    # a mean 100 standard deviations from zero: a one-pass variance (E[k^2] - mean^2) loses
    # its float32 digits to cancellation and misses the tolerance; +1 did not
    keys = keys * 3 + 300
    table, seq_lens = make_table([1, 64, 65, 200, 7 * PAGE_SIZE], 40)
    summaries = poisoned(40, num_kv_heads, 2, head_dim, dtype=summary_dtype)
    moira.summarize(keys, table, seq_lens, summaries)
    expected = ref.summarize(keys.cpu(), table.cpu(), seq_lens.cpu())
    written = []
    for b, length in enumerate(seq_lens.tolist()):
        full = length // PAGE_SIZE
        written += table[b, :full].tolist()
        assert _untouched(summaries, table[b, full:])  # partial and unused columns
    untouched = sorted(set(range(40)) - set(written))
    assert _untouched(summaries, untouched)
    got = summaries[written].float().cpu()
    tolerance = 1e-5 if summary_dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, expected[written], rtol=tolerance, atol=tolerance)


def test_summarize_allocates_in_cache_dtype():
    keys, _ = make_cache(8, 1, 64, dtype=torch.float16)
    table, seq_lens = make_table([128], 8)
    summaries = moira.summarize(keys, table, seq_lens)
    assert summaries.dtype == torch.float16 and summaries.shape == (8, 1, 2, 64)
    expected = ref.summarize(keys.cpu(), table.cpu(), seq_lens.cpu())
    pages = table[0, :2].tolist()
    torch.testing.assert_close(summaries[pages].float().cpu(), expected[pages], rtol=1e-2,
                               atol=1e-2)


@pytest.fixture
def recycled_memory(monkeypatch):
    """``torch.empty`` returning NaNs, as a block the GPU's caching allocator hands back may
    hold anything: what a function leaves unwritten shows."""
    empty = torch.empty

    def recycled(*args, **kwargs):
        tensor = empty(*args, **kwargs)
        return tensor.fill_(float("nan")) if tensor.is_floating_point() else tensor

    monkeypatch.setattr(torch, "empty", recycled)


def test_summaries_of_pages_no_full_page_lands_on_are_zeros(recycled_memory):
    """The default output is defined everywhere: the summaries of full pages, zeros elsewhere
    (pages of no row, partial pages), and all zeros for an empty batch."""
    keys, _ = make_cache(12, 2, 64)
    table, seq_lens = make_table([64 * 2 + 5], 12)  # two full pages, one partial
    summaries = moira.summarize(keys, table, seq_lens)
    full = table[0, :2].tolist()
    others = [page for page in range(12) if page not in full]
    assert torch.isfinite(summaries).all()
    assert (summaries[others] == 0).all()
    expected = ref.summarize(keys.cpu(), table.cpu(), seq_lens.cpu())
    torch.testing.assert_close(summaries[full].float().cpu(), expected[full], rtol=1e-2,
                               atol=1e-2)
    empty_batch = moira.summarize(keys, table[:0], seq_lens[:0])
    assert empty_batch.shape == (12, 2, 2, 64) and (empty_batch == 0).all()


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_update_summaries_from_slot_mapping(slot_dtype):
    num_pages, num_kv_heads, head_dim = 12, 3, 128
    keys, _ = make_cache(num_pages, num_kv_heads, head_dim, layout="packed")
    # a decode step and a chunked-prefill chunk: page 2 and page 5 complete, page 7 does not,
    # page 9's last slot appears twice, -1 is padding
    slots = [2 * 64 + 63, 7 * 64 + 10, -1, 5 * 64 + 40, 5 * 64 + 63, 9 * 64 + 63, 9 * 64 + 63, -1]
    slot_mapping = torch.tensor(slots, dtype=slot_dtype, device=DEVICE)
    summaries = poisoned(num_pages, num_kv_heads, 2, head_dim, dtype=torch.float32)
    moira.update_summaries(keys, slot_mapping, summaries)
    filled = [2, 5, 9]
    table = torch.tensor([filled], dtype=torch.int32)
    expected = ref.summarize(keys.cpu(), table, torch.tensor([3 * 64], dtype=torch.int32))
    torch.testing.assert_close(summaries[filled].cpu(), expected[filled], rtol=1e-5, atol=1e-5)
    assert _untouched(summaries, [p for p in range(num_pages) if p not in filled])
