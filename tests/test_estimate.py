import math

import pytest
import torch
from helpers import DEVICE, make_cache, make_query, make_table, poisoned

from moira import KernelOptions
from moira import reference as ref
from moira.kernels.triton import estimate as estimate_module
from moira.kernels.triton.estimate import estimate


def triton_options(**tuning):
    """The Triton Estimate with these ``estimate.*`` tuning constants (this file's launches go
    to its kernel directly; test_estimate_cuda.py runs the cases on the CUDA one)."""
    return KernelOptions(estimate="triton", tuning={f"estimate.{name}": value
                                                    for name, value in tuning.items()})


SEQ_LENS = {
    "one-token": [1],
    "one-page": [64],
    "two-pages-partial": [65],
    "mixed": [3, 128, 64 * 70 + 5, 64 * 9],  # one row spans two 64-page programs
}


def check_against_reference(group, head_dim, lengths, options, rtol=1e-5, atol=1e-4):
    num_kv_heads, num_pages = 2, 300
    keys, _ = make_cache(num_pages, num_kv_heads, head_dim, layout="packed")
    table, seq_lens = make_table(SEQ_LENS[lengths], num_pages)
    query = make_query(len(SEQ_LENS[lengths]), num_kv_heads * group, head_dim)
    summaries = ref.summarize(keys.cpu(), table.cpu(), seq_lens.cpu()).to(DEVICE)
    summaries = summaries * torch.rand_like(summaries) * 2  # larger variance terms
    max_pages = table.shape[1]
    log_masses = poisoned(len(seq_lens) * num_kv_heads, group, max_pages, dtype=torch.float32)
    scale = 1.3 / math.sqrt(head_dim)
    estimate(query, keys, summaries, table, seq_lens, scale, log_masses, options)

    expected = ref.estimate(query.cpu(), keys.cpu(), summaries.cpu(), table.cpu(),
                            seq_lens.cpu(), scale)
    got = log_masses.cpu().view_as(expected)
    for b, length in enumerate(seq_lens.tolist()):
        pages = ref.num_pages(length, max_pages)
        torch.testing.assert_close(got[b, :, :, :pages], expected[b, :, :, :pages],
                                   rtol=rtol, atol=atol)
        assert torch.isnan(got[b, :, :, pages:]).all()  # past the row: not written


@pytest.mark.parametrize("group", [1, 4, 7, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("lengths", list(SEQ_LENS))
def test_estimate_matches_reference(group, head_dim, lengths):
    check_against_reference(group, head_dim, lengths, triton_options())


def check_wide_table(options):
    """As in an engine: the block table (13 tiles) is far wider than the rows, and each row's
    mvar programs (1, 2 or 3 per row for 8 rows) split the row's own tiles, a program looping
    over up to four; every page of every row written once, nothing past a row."""
    num_kv_heads, group, head_dim = 2, 4, 64
    lengths = [64 * 70 + 5, 3, 64 * 100, 64 * 33]
    keys, _ = make_cache(1700, num_kv_heads, head_dim, layout="packed")
    table, seq_lens = make_table(lengths, 1700, extra_columns=300)  # 401 columns: 13 tiles
    query = make_query(len(lengths), num_kv_heads * group, head_dim)
    summaries = ref.summarize(keys.cpu(), table.cpu(), seq_lens.cpu()).to(DEVICE)
    log_masses = poisoned(len(lengths) * num_kv_heads, group, table.shape[1],
                          dtype=torch.float32)
    scale = 1 / math.sqrt(head_dim)
    estimate(query, keys, summaries, table, seq_lens, scale, log_masses, options)
    expected = ref.estimate(query.cpu(), keys.cpu(), summaries.cpu(), table.cpu(),
                            seq_lens.cpu(), scale)
    got = log_masses.cpu().view_as(expected)
    for b, length in enumerate(lengths):
        pages = ref.num_pages(length, table.shape[1])
        torch.testing.assert_close(got[b, :, :, :pages], expected[b, :, :, :pages],
                                   rtol=1e-5, atol=1e-4)
        assert torch.isnan(got[b, :, :, pages:]).all()


@pytest.mark.parametrize("target_programs, max_tiles", [(1, 100), (8, 8), (24, 8)])
def test_programs_share_a_rows_tiles_in_a_wide_table(target_programs, max_tiles):
    check_wide_table(triton_options(target_programs=target_programs,
                                    max_tiles_per_program=max_tiles))


@pytest.mark.parametrize("group", [1, 4, 7, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("lengths", ["one-token", "two-pages-partial", "mixed"])
def test_query_head_in_turn(group, head_dim, lengths):
    """``estimate.query_head_ahead`` off (on by default, which the other tests run): each
    head's query loaded in its turn, in the mvar tiles and the exact pages. (With it on, a head
    given its neighbour's query fails test_estimate_matches_reference at G > 1.)"""
    check_against_reference(group, head_dim, lengths, triton_options(query_head_ahead=False))


@pytest.mark.parametrize("query_head_ahead", [False, True])
def test_query_head_ahead_or_not_in_programs_of_several_tiles(query_head_ahead):
    check_wide_table(triton_options(query_head_ahead=query_head_ahead, target_programs=8,
                                    max_tiles_per_program=8))


@pytest.mark.parametrize("registers", [80, 64])
def test_register_ceiling(registers):
    """``estimate.max_registers``: a build under a lower register ceiling, whose spills (80 and
    200 bytes on sm_90) go through local memory on the GPU, computes the same (the interpreter
    ignores the ceiling; the GPU run is the one that checks the spilled build)."""
    check_against_reference(4, 128, "mixed", triton_options(max_registers=registers))
    check_wide_table(triton_options(max_registers=registers, target_programs=8,
                                    max_tiles_per_program=8))


def test_register_ceiling_applies_to_small_groups_only():
    # G = 8 spills under 96 registers on sm_90 (benchmarks/compile_check.py): ptxas's choice
    options = triton_options()
    assert [estimate_module.max_registers(group, options) for group in (1, 4, 7, 8)] \
        == [options.value("estimate.max_registers")] * 2 + [None] * 2


def test_estimate_programs_per_row_follow_the_batch_not_the_table_width():
    # a 131k-token engine's table (2,048 pages) at 8k x 32 (256 rows): 8 programs per row,
    # not 64; at 131k x 4 (32 rows) one per tile, as before; never more than the tiles
    options = triton_options()
    assert estimate_module.programs_per_row(256, 2048, options) == 8
    assert estimate_module.programs_per_row(32, 2048, options) == 64
    assert estimate_module.programs_per_row(8, 40, options) == 2
    # a 1M-token table (512 tiles): however many rows, no program gets more than 8 tiles
    assert estimate_module.programs_per_row(4096, 16384, options) == 64


def test_estimate_bf16_summaries():
    num_kv_heads, head_dim, group = 1, 128, 4
    keys, _ = make_cache(20, num_kv_heads, head_dim, layout="hnd")
    table, seq_lens = make_table([64 * 10 + 1], 20)
    query = make_query(1, group, head_dim)
    summaries = ref.summarize(keys.cpu(), table.cpu(), seq_lens.cpu()).to(DEVICE)
    summaries = summaries.to(torch.bfloat16)
    log_masses = poisoned(num_kv_heads, group, table.shape[1], dtype=torch.float32)
    estimate(query, keys, summaries, table, seq_lens, 1 / math.sqrt(head_dim), log_masses,
             triton_options())
    expected = ref.estimate(query.cpu(), keys.cpu(), summaries.cpu(), table.cpu(),
                            seq_lens.cpu())
    torch.testing.assert_close(log_masses.cpu()[..., :11], expected.view_as(log_masses)[..., :11],
                               rtol=1e-5, atol=1e-4)
    assert torch.isnan(log_masses[..., 11:]).all()  # past the row: not written


@pytest.mark.parametrize("group", [1, 4, 7, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("lengths", list(SEQ_LENS))
def test_exact_pages_in_one_tile(group, head_dim, lengths):
    """The [64, G] tile form of the sink's and current page's log-sum-exps (a tuning option)
    against the reference, for every G including padded ones (7 -> 8), one-token rows and
    pages with one valid token."""
    check_against_reference(group, head_dim, lengths, triton_options(exact_pages="side by side"))


def test_an_unknown_exact_form_is_refused():
    with pytest.raises(ValueError, match="estimate.exact_pages"):
        triton_options(exact_pages="sidebyside")
