"""Attend + Merge with the balanced global split against the float32 reference."""

import pytest
import torch
from helpers import DEVICE, make_cache, make_query, make_table
from test_attend import check_attend, random_lists

import moira
from moira import MoiraConfig


@pytest.mark.parametrize("programs, min_pages", [(1, 1), (5, 2), (7, 1), (64, 3)])
@pytest.mark.parametrize("group", [1, 4, 7])
def test_balanced_split_matches_reference(programs, min_pages, group):
    """Ranges that cut rows anywhere, span several short rows, skip empty rows; more programs
    than pages (idle programs); one program for everything."""
    num_kv_heads, head_dim = 2, 64
    keys, values = make_cache(120, num_kv_heads, head_dim)
    table, seq_lens = make_table([1, 0, 65, 64 * 7 + 3, 64 * 16, 64 * 2, 64 * 11 + 63], 120)
    query = make_query(len(seq_lens), num_kv_heads * group, head_dim)
    page_lists, page_counts = random_lists(seq_lens.cpu(), num_kv_heads, table.shape[1],
                                           shuffle=True)
    config = MoiraConfig(schedule="balanced", programs=programs, chunk_pages=min_pages)
    out = check_attend(query, keys, values, table, seq_lens, page_lists, page_counts, config)
    assert (out[page_counts.cpu().repeat_interleave(group, dim=1) == 0] == 0).all()


@pytest.mark.parametrize("head_dim", [64, 128])
def test_balanced_one_long_row_over_every_program(head_dim):
    keys, values = make_cache(310, 1, head_dim)
    table, seq_lens = make_table([64 * 150 + 7, 64], 310)
    query = make_query(2, 8, head_dim)
    page_lists = torch.arange(table.shape[1], dtype=torch.int32,
                              device=DEVICE).expand(2, 1, -1).contiguous()
    page_counts = torch.tensor([[151], [1]], dtype=torch.int32, device=DEVICE)
    check_attend(query, keys, values, table, seq_lens, page_lists, page_counts,
                 MoiraConfig(schedule="balanced", programs=9, chunk_pages=4))


def test_balanced_schedule_through_the_step_with_page_stats():
    keys, values = make_cache(80, 2, 64)
    table, seq_lens = make_table([64 * 20 + 5, 64 * 9, 0], 80)
    query = make_query(3, 8, 64)
    summaries = moira.summarize(keys, table, seq_lens)
    stats = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    config = MoiraConfig(schedule="balanced", programs=6, chunk_pages=2)
    out, _, counts = moira.sparse_decode(query, keys, values, summaries, table, seq_lens,
                                         gamma=0.9, config=config, return_pages=True,
                                         page_stats=stats)
    rows_config = MoiraConfig(chunk_pages=2, min_chunks_per_row=3, min_programs=8)
    expected = moira.sparse_decode(query, keys, values, summaries, table, seq_lens, gamma=0.9,
                                   config=rows_config)
    assert (out.float() - expected.float()).abs().max() < 2e-2  # same lists, other split
    assert stats.tolist() == [int(counts.sum()), 2 * (21 + 9)]
    assert (out[2] == 0).all()


def test_schedule_is_validated():
    with pytest.raises(ValueError, match="schedule must be 'rows'"):
        MoiraConfig(schedule="fast")
    with pytest.raises(ValueError, match="programs must be an int in"):
        MoiraConfig(programs=0)
