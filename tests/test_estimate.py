import itertools
import math

import pytest
import torch
from helpers import DEVICE, make_cache, make_query, make_table, poisoned

from moira import reference as ref
from moira.kernels import estimate as estimate_module
from moira.kernels.estimate import estimate

SEQ_LENS = {
    "one-token": [1],
    "one-page": [64],
    "two-pages-partial": [65],
    "mixed": [3, 128, 64 * 70 + 5, 64 * 9],  # one row spans two 64-page programs
}


@pytest.mark.parametrize("group", [1, 4, 7, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("lengths", list(SEQ_LENS))
def test_estimate_matches_reference(group, head_dim, lengths, rtol=1e-5, atol=1e-4):
    num_kv_heads, num_pages = 2, 300
    keys, _ = make_cache(num_pages, num_kv_heads, head_dim, layout="packed")
    table, seq_lens = make_table(SEQ_LENS[lengths], num_pages)
    query = make_query(len(SEQ_LENS[lengths]), num_kv_heads * group, head_dim)
    summaries = ref.summarize(keys.cpu(), table.cpu(), seq_lens.cpu()).to(DEVICE)
    summaries = summaries * torch.rand_like(summaries) * 2  # larger variance terms
    max_pages = table.shape[1]
    log_masses = poisoned(len(seq_lens) * num_kv_heads, group, max_pages, dtype=torch.float32)
    scale = 1.3 / math.sqrt(head_dim)
    estimate(query, keys, summaries, table, seq_lens, scale, log_masses)

    expected = ref.estimate(query.cpu(), keys.cpu(), summaries.cpu(), table.cpu(),
                            seq_lens.cpu(), scale)
    got = log_masses.cpu().view_as(expected)
    for b, length in enumerate(seq_lens.tolist()):
        pages = ref.num_pages(length, max_pages)
        torch.testing.assert_close(got[b, :, :, :pages], expected[b, :, :, :pages],
                                   rtol=rtol, atol=atol)
        assert torch.isnan(got[b, :, :, pages:]).all()  # past the row: not written


@pytest.mark.parametrize("target_programs, max_tiles", [(1, 100), (8, 8), (24, 8)])
def test_programs_share_a_rows_tiles_in_a_wide_table(monkeypatch, target_programs, max_tiles):
    """As in an engine: the block table (13 tiles) is far wider than the rows, and each row's
    mvar programs (1, 2 or 3 per row for 8 rows) split the row's own tiles, a program looping
    over up to four; every page of every row written once, nothing past a row."""
    monkeypatch.setattr(estimate_module, "TARGET_PROGRAMS", target_programs)
    monkeypatch.setattr(estimate_module, "MAX_TILES_PER_PROGRAM", max_tiles)
    num_kv_heads, group, head_dim = 2, 4, 64
    lengths = [64 * 70 + 5, 3, 64 * 100, 64 * 33]
    keys, _ = make_cache(1700, num_kv_heads, head_dim, layout="packed")
    table, seq_lens = make_table(lengths, 1700, extra_columns=300)  # 401 columns: 13 tiles
    query = make_query(len(lengths), num_kv_heads * group, head_dim)
    summaries = ref.summarize(keys.cpu(), table.cpu(), seq_lens.cpu()).to(DEVICE)
    log_masses = poisoned(len(lengths) * num_kv_heads, group, table.shape[1],
                          dtype=torch.float32)
    scale = 1 / math.sqrt(head_dim)
    estimate(query, keys, summaries, table, seq_lens, scale, log_masses)
    expected = ref.estimate(query.cpu(), keys.cpu(), summaries.cpu(), table.cpu(),
                            seq_lens.cpu(), scale)
    got = log_masses.cpu().view_as(expected)
    for b, length in enumerate(lengths):
        pages = ref.num_pages(length, table.shape[1])
        torch.testing.assert_close(got[b, :, :, :pages], expected[b, :, :, :pages],
                                   rtol=1e-5, atol=1e-4)
        assert torch.isnan(got[b, :, :, pages:]).all()


def test_estimate_programs_per_row_follow_the_batch_not_the_table_width():
    # a 131k-token engine's table (2,048 pages) at 8k x 32 (256 rows): 8 programs per row,
    # not 64; at 131k x 4 (32 rows) one per tile, as before; never more than the tiles
    assert estimate_module.programs_per_row(256, 2048) == 8
    assert estimate_module.programs_per_row(32, 2048) == 64
    assert estimate_module.programs_per_row(8, 40) == 2
    # a 1M-token table (512 tiles): however many rows, no program gets more than 8 tiles
    assert estimate_module.programs_per_row(4096, 16384) == 64


def test_estimate_bf16_summaries():
    num_kv_heads, head_dim, group = 1, 128, 4
    keys, _ = make_cache(20, num_kv_heads, head_dim, layout="hnd")
    table, seq_lens = make_table([64 * 10 + 1], 20)
    query = make_query(1, group, head_dim)
    summaries = ref.summarize(keys.cpu(), table.cpu(), seq_lens.cpu()).to(DEVICE)
    summaries = summaries.to(torch.bfloat16)
    log_masses = poisoned(num_kv_heads, group, table.shape[1], dtype=torch.float32)
    estimate(query, keys, summaries, table, seq_lens, 1 / math.sqrt(head_dim), log_masses)
    expected = ref.estimate(query.cpu(), keys.cpu(), summaries.cpu(), table.cpu(),
                            seq_lens.cpu())
    torch.testing.assert_close(log_masses.cpu()[..., :11], expected.view_as(log_masses)[..., :11],
                               rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("group", [1, 4, 7, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("lengths", list(SEQ_LENS))
def test_exact_pages_with_heads_side_by_side(monkeypatch, group, head_dim, lengths):
    """The [64, G] tile form of the sink's and current page's log-sum-exps (a tuning option)
    against the reference, for every G including padded ones (7 -> 8), one-token rows and
    pages with one valid token."""
    from moira.kernels import estimate as estimate_module

    monkeypatch.setattr(estimate_module, "EXACT_HEADS_SIDE_BY_SIDE", True)
    test_estimate_matches_reference(group, head_dim, lengths)


@pytest.mark.parametrize("group", [1, 4, 7, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("lengths", ["mixed", "two-pages-partial"])
@pytest.mark.parametrize("precision", ["tf32x3", "ieee", "tf32"])
def test_mvar_as_matrix_products(monkeypatch, group, head_dim, lengths, precision):
    """The middle pages' mvar as [pages, D] @ [D, G padded to 16] products (a tuning option)
    against the reference, padded groups (7 -> 16) and a row spanning two programs included.
    One tf32 product rounds the scaled query to 10 mantissa bits (2^-11 relative per term):
    its tolerance is that error over D terms of this test's sizes."""
    monkeypatch.setattr(estimate_module, "MVAR_DOT", True)
    monkeypatch.setattr(estimate_module, "MVAR_DOT_PRECISION", precision)
    tolerance = dict(rtol=2e-3, atol=2e-3) if precision == "tf32" else {}
    test_estimate_matches_reference(group, head_dim, lengths, **tolerance)


SELECT_MODES = {
    "coverage": dict(gamma=0.98, top_k=None),
    "fixed count": dict(gamma=0.98, top_k=5),
    "fractions": dict(gamma=0.98, top_k=None, keep_fractions=[0.3, 0.6]),
    "row gammas": dict(gamma=0.98, top_k=None, gammas=[0.9, 0.99]),
    # per (request, KV head): [6 requests, 2 KV heads]
    "fractions per request": dict(gamma=0.98, top_k=None, keep_fractions=[
        [0.3, 0.6], [0.5, 0.2], [0.9, 0.1], [0.25, 0.75], [0.4, 0.15], [0.7, 0.35]]),
    "row gammas per request": dict(gamma=0.98, top_k=None, gammas=[
        [0.9, 0.99], [0.95, 0.8], [0.99, 0.9], [0.85, 0.97], [0.92, 0.999], [0.6, 0.98]]),
    "short rows": dict(gamma=0.98, top_k=None, dense_below_pages=3),
}


@pytest.mark.parametrize("group, head_dim", [(1, 64), (4, 128), (7, 64), (8, 128)])
@pytest.mark.parametrize("mode", list(SELECT_MODES))
def test_select_in_estimates_launch_matches_the_two_launches(group, head_dim, mode):
    """Estimate with Select folded in (the row's last Estimate program selects) writes the
    log-masses of Estimate's own launch, and the lists and counts Select's own launch derives
    from those log-masses, in every mode; rows of 0, 1, 2 and 3 pages (short rows), one
    spanning several mvar programs, and its counters end at zero (a CUDA graph replays them).
    Log-masses bit for bit in the interpreter; on a GPU within a few float32 ulps (the fused
    launch runs on two warps up to 256 pages where Estimate's own runs on four, so its channel
    sums round in another order: the H200 showed one ulp, 4.8e-7 on values near 4.5), hence
    Select's own launch runs on the fused log-masses. Even on equal log-masses the fused Select
    reduces a row on the launch's warps and Select's own launch on one up to 256 pages, so on a
    GPU lists could still part at a float tie (none on these inputs)."""
    check_fused_select(group, head_dim, mode)


@pytest.mark.parametrize("mode", ["coverage", "fractions per request"])
def test_select_in_estimates_launch_waits_for_the_rows_slowest_program(monkeypatch, mode):
    """Two mvar programs per row with unequal shares (the first two of the long row's three
    tiles, the second one): on a GPU the row's last program by index usually finishes first,
    so a kernel that let the last *index* select instead of the last *arrival* would read
    unwritten (NaN-poisoned) log-masses. The interpreter runs programs in order and cannot
    show such a race; the GPU run of this test can."""
    monkeypatch.setattr(estimate_module, "TARGET_PROGRAMS", 1)
    monkeypatch.setattr(estimate_module, "MAX_TILES_PER_PROGRAM", 2)
    check_fused_select(4, 128, mode)


def check_fused_select(group, head_dim, mode):
    from moira.config import MoiraConfig
    from moira.kernels.select import select

    num_kv_heads, num_pages = 2, 450
    lengths = [0, 64, 65, 64 * 2 + 7, 64 * 70 + 5, 64 * 9]
    keys, _ = make_cache(num_pages, num_kv_heads, head_dim, layout="packed")
    table, seq_lens = make_table(lengths, num_pages)
    query = make_query(len(lengths), num_kv_heads * group, head_dim)
    summaries = ref.summarize(keys.cpu(), table.cpu(), seq_lens.cpu()).to(DEVICE)
    max_pages, rows = table.shape[1], len(lengths) * num_kv_heads
    settings = dict(SELECT_MODES[mode])
    for name in ("keep_fractions", "gammas"):
        if name in settings:
            settings[name] = torch.tensor(settings[name], device=DEVICE)
    settings["ways"] = MoiraConfig().bisection_ways_for(max_pages)
    scale = 1 / math.sqrt(head_dim)

    def buffers():
        return (poisoned(rows, group, max_pages, dtype=torch.float32),
                torch.full((len(lengths), num_kv_heads, max_pages), -7, dtype=torch.int32,
                           device=DEVICE),
                torch.full((len(lengths), num_kv_heads), -7, dtype=torch.int32, device=DEVICE))

    dense_below = settings.get("dense_below_pages", 0)
    masses, lists, counts = buffers()
    estimate(query, keys, summaries, table, seq_lens, scale, masses,
             dense_below_pages=dense_below)
    select(masses, seq_lens, lists, counts, num_kv_heads=num_kv_heads, max_pages=max_pages,
           **settings)
    arrivals = torch.zeros(rows, dtype=torch.int32, device=DEVICE)
    mass_tolerance = dict(rtol=4e-7, atol=1e-6) if DEVICE == "cuda" else dict(rtol=0, atol=0)
    for _ in range(2):  # the second call relies on the first having reset the counters
        fused_masses, fused_lists, fused_counts = buffers()  # poisoned afresh for each call
        estimate_module.estimate_select(query, keys, summaries, table, seq_lens, scale,
                                        fused_masses, fused_lists, fused_counts, arrivals,
                                        **settings)
        assert int(arrivals.abs().sum()) == 0
        torch.testing.assert_close(fused_masses.cpu(), masses.cpu(), equal_nan=True,
                                   **mass_tolerance)
        _, lists, counts = buffers()
        select(fused_masses, seq_lens, lists, counts, num_kv_heads=num_kv_heads,
               max_pages=max_pages, **settings)
        assert torch.equal(fused_counts.cpu(), counts.cpu())
        for b, h in itertools.product(range(len(lengths)), range(num_kv_heads)):
            count = int(counts[b, h])
            assert torch.equal(fused_lists[b, h, :count].cpu(), lists[b, h, :count].cpu())
    if mode == "short rows":  # rows of up to 3 pages kept whole, and not estimated
        assert counts[1:4].cpu().tolist() == [[1, 1], [2, 2], [3, 3]]
    assert counts[0].cpu().tolist() == [0, 0]


def test_select_runs_in_estimates_launch_only_for_tables_up_to_2048_pages():
    assert estimate_module.fits_one_launch(2048)
    assert not estimate_module.fits_one_launch(2049)
    num_kv_heads, group, head_dim = 1, 1, 64
    keys, _ = make_cache(4, num_kv_heads, head_dim)
    table = torch.zeros(1, 2049, dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor([64], dtype=torch.int32, device=DEVICE)
    query = make_query(1, group, head_dim)
    summaries = torch.zeros(4, num_kv_heads, 2, head_dim, device=DEVICE)
    masses = poisoned(1, group, 2049, dtype=torch.float32)
    lists = torch.zeros(1, 1, 2049, dtype=torch.int32, device=DEVICE)
    counts = torch.zeros(1, 1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="up to 2,048 pages"):
        estimate_module.estimate_select(query, keys, summaries, table, seq_lens, 0.1, masses,
                                        lists, counts, torch.zeros(1, dtype=torch.int32),
                                        gamma=0.98, top_k=None, ways=2)
