"""Select against the sorting reference, on the same log-masses."""

import math

import pytest
import torch
from helpers import DEVICE

from moira import reference as ref
from moira.config import PAGE_SIZE, KernelOptions, MoiraConfig
from moira.kernels.triton.select import select

# this file's launches go to the Triton kernel directly; test_select_cuda.py runs the cases on
# the CUDA one
TRITON = KernelOptions(select="triton")


NEAR = 1e-6  # pages this close to the threshold may differ from the reference's choice


def run_select(log_masses, seq_lens, *, gamma=0.98, top_k=None, max_pages=None,
               keep_fractions=None, gammas=None, dense_below_pages=0, options=TRITON):
    batch, num_kv_heads, group, width = log_masses.shape
    max_pages = max_pages or width
    page_lists = torch.full((batch, num_kv_heads, width), -7, dtype=torch.int32, device=DEVICE)
    page_counts = torch.full((batch, num_kv_heads), -7, dtype=torch.int32, device=DEVICE)
    select(log_masses.to(DEVICE).view(batch * num_kv_heads, group, width), seq_lens.to(DEVICE),
           page_lists, page_counts, num_kv_heads=num_kv_heads, max_pages=max_pages,
           gamma=gamma, top_k=top_k, ways=MoiraConfig().bisection_ways_for(max_pages),
           options=options,
           keep_fractions=None if keep_fractions is None else keep_fractions.to(DEVICE),
           gammas=None if gammas is None else gammas.to(DEVICE),
           dense_below_pages=dense_below_pages)
    return page_lists.cpu(), page_counts.cpu()


def random_log_masses(seq_lens, num_kv_heads, group, spread, width=None):
    width = width or max(1, -(-max(seq_lens) // PAGE_SIZE))
    log_masses = torch.randn(len(seq_lens), num_kv_heads, group, width) * spread
    log_masses += torch.randn(len(seq_lens), num_kv_heads, 1, width) * spread  # group agrees
    for b, length in enumerate(seq_lens):
        log_masses[b, ..., ref.num_pages(length, width):] = float("-inf")
    return log_masses, torch.tensor(seq_lens, dtype=torch.int32)


def check_lists(page_lists, page_counts, seq_lens):
    for b, length in enumerate(seq_lens.tolist()):
        pages = ref.num_pages(length, page_lists.shape[-1])
        for h in range(page_lists.shape[1]):
            kept = page_lists[b, h, : page_counts[b, h]].tolist()
            if pages == 0:
                assert kept == []
                continue
            assert kept[0] == 0 and kept[-1] == pages - 1
            assert all(x < y for x, y in zip(kept, kept[1:]))  # increasing, no duplicates


def check_superset(shares, got, want, gamma):
    """The kernel keeps the reference's pages, plus at most pages within NEAR of the threshold,
    or, where the reference's kept mass lands within the kernel's margin of its target, the
    page(s) the margin adds."""
    assert want <= got, sorted(want - got)
    tau, target = ref.coverage_threshold(shares, gamma)
    middle = sorted(want - {0, len(shares) - 1})
    ambiguous = float(shares[middle].double().sum()) < target + 4e-6
    extra = [p for p in got - want if abs(shares[p] - tau) > NEAR]
    assert not extra or (ambiguous and len(extra) <= 2), (extra, tau)
    kept_mass = float(shares[sorted(got)].double().sum())
    assert kept_mass >= min(gamma, float(shares.double().sum())) - 1e-6


@pytest.mark.parametrize("group", [1, 4, 7, 8])
@pytest.mark.parametrize("spread", [0.3, 2.0, 8.0])
@pytest.mark.parametrize("gamma", [0.5, 0.9, 0.98, 0.999])
def test_coverage_matches_reference(group, spread, gamma):
    # 300 pages wide (512 lanes, 4 warps): rows on 128 (1-100 pages), 256 (201) and 512 (300)
    seq_lens = [1, 64, 65, 130, 64 * 37 + 9, 64 * 100, 64 * 200 + 1, 64 * 300, 0]
    log_masses, seq_lens = random_log_masses(seq_lens, 2, group, spread)
    page_lists, page_counts = run_select(log_masses, seq_lens, gamma=gamma)
    check_coverage(log_masses, seq_lens, page_lists, page_counts, gamma)


@pytest.mark.parametrize("softmax_tile", [0, 1 << 14])
def test_both_softmax_forms_match_reference(softmax_tile):
    """The G softmaxes head by head (0) and side by side in one tile: both the reference's."""
    seq_lens = [1, 65, 64 * 37 + 9, 64 * 200 + 1, 64 * 300]
    log_masses, seq_lens = random_log_masses(seq_lens, 2, 7, 2.0)
    options = KernelOptions(select="triton", tuning={"select.softmax_tile": softmax_tile})
    page_lists, page_counts = run_select(log_masses, seq_lens, gamma=0.95, options=options)
    check_coverage(log_masses, seq_lens, page_lists, page_counts, 0.95)


def check_coverage(log_masses, seq_lens, page_lists, page_counts, gamma):
    """Every row's list against the reference's at the row's target (``gamma``: a number, or
    ``[num_kv_heads]`` / ``[batch, num_kv_heads]``)."""
    check_lists(page_lists, page_counts, seq_lens)
    expected_lists, expected_counts = ref.select(log_masses, seq_lens, gamma=gamma)
    shares = ref.group_shares(log_masses)
    for b, length in enumerate(seq_lens.tolist()):
        pages = ref.num_pages(length, log_masses.shape[-1])
        for h in range(log_masses.shape[1]):
            row_gamma = float(gamma if not torch.is_tensor(gamma)
                              else gamma[h] if gamma.dim() == 1 else gamma[b, h])
            got = set(page_lists[b, h, : page_counts[b, h]].tolist())
            want = set(expected_lists[b, h, : expected_counts[b, h]].tolist())
            if pages <= 2:
                assert got == want
                continue
            check_superset(shares[b, h, :pages], got, want, row_gamma)
            if row_gamma == 1.0:
                assert len(got) == pages


def test_gamma_one_keeps_every_page_even_underflowing_ones():
    log_masses, seq_lens = random_log_masses([64 * 50, 64 * 3 + 1, 64], 2, 4, 1.0)
    log_masses[0, :, :, 7] = 300.0  # every other page's share underflows to 0 in float32
    page_lists, page_counts = run_select(log_masses, seq_lens, gamma=1.0)
    assert page_counts.tolist() == [[50, 50], [4, 4], [1, 1]]
    check_lists(page_lists, page_counts, seq_lens)


def poison_estimates(log_masses, seq_lens, seed=0):
    """Non-finite estimates (NaN, +inf, -inf) at random (page, head) entries of each row's
    pages, the sink and the current page included, as non-finite keys, summaries or queries
    give them; one row keeps every estimate finite, one has every middle page unreadable."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.tensor([math.nan, math.inf, -math.inf])
    for b, length in enumerate(seq_lens.tolist()):
        pages = ref.num_pages(length, log_masses.shape[-1])
        if b == 1 or pages == 0:
            continue
        hit = torch.rand(log_masses.shape[1], log_masses.shape[2], pages,
                         generator=generator) < (1.0 if b == 2 else 0.08)
        if b == 2:
            hit[:, :, [0, pages - 1]] = False
        picks = values[torch.randint(0, 2 if b == 2 else 3, hit.shape, generator=generator)]
        log_masses[b, :, :, :pages] = torch.where(hit, picks, log_masses[b, :, :, :pages])
    return log_masses


NON_FINITE_ROWS = [64 * 40 + 3, 64 * 37 + 9, 64 * 20, 64 * 300, 65, 1]


@pytest.mark.parametrize("gamma", [0.5, 0.9, 0.98, 1.0])
@pytest.mark.parametrize("group", [1, 4])
def test_non_finite_estimates_are_kept_and_do_not_disturb_the_rest(gamma, group):
    """A page whose estimate is NaN or +inf for some head is kept; the other pages are chosen
    from the other estimates as the reference chooses them (-inf: a zero mass); gamma = 1
    keeps all."""
    log_masses, seq_lens = random_log_masses(NON_FINITE_ROWS, 2, group, 2.0)
    log_masses = poison_estimates(log_masses, seq_lens)
    page_lists, page_counts = run_select(log_masses, seq_lens, gamma=gamma)
    check_coverage(log_masses, seq_lens, page_lists, page_counts, gamma)
    unreadable = ref.unreadable(log_masses)
    for b, length in enumerate(seq_lens.tolist()):
        pages = ref.num_pages(length, log_masses.shape[-1])
        for h in range(2):
            kept = set(page_lists[b, h, : page_counts[b, h]].tolist())
            bad = set(torch.nonzero(unreadable[b, h, :pages]).flatten().tolist())
            assert bad <= kept
    assert unreadable[0].any() and unreadable[2, :, 1:19].all()  # the cases are there


@pytest.mark.parametrize("top_k", [3, 17])
def test_non_finite_estimates_rank_first_under_a_fixed_count(top_k):
    log_masses, seq_lens = random_log_masses(NON_FINITE_ROWS, 2, 4, 2.0)
    log_masses = poison_estimates(log_masses, seq_lens, seed=1)
    page_lists, page_counts = run_select(log_masses, seq_lens, top_k=top_k)
    check_lists(page_lists, page_counts, seq_lens)
    expected_lists, expected_counts = ref.select(log_masses, seq_lens, top_k=top_k)
    assert torch.equal(page_counts, expected_counts)
    unreadable = ref.unreadable(log_masses)
    shares = ref.group_shares(log_masses)
    for b, length in enumerate(seq_lens.tolist()):
        pages = ref.num_pages(length, log_masses.shape[-1])
        for h in range(2):
            got = set(page_lists[b, h, : page_counts[b, h]].tolist())
            want = set(expected_lists[b, h, : expected_counts[b, h]].tolist())
            # the same pages but where shares tie within NEAR at the cut
            differ = got ^ want
            assert all(not unreadable[b, h, p] for p in differ)
            assert all(abs(shares[b, h, p] - shares[b, h, q]) <= NEAR
                       for p in got - want for q in want - got)
            bad = torch.nonzero(unreadable[b, h, 1:pages - 1]).flatten() + 1
            assert set(bad.tolist()[:max(top_k - 2, 0)]) <= got  # first, in page order


def test_one_page_holding_the_mass_is_kept_alone():
    """The others' shares underflow to 0: no share lies inside (0, top), so the bisection stops
    before its first pass, and must still keep the top page only, not every page at share 0."""
    log_masses, seq_lens = random_log_masses([64 * 50], 2, 4, 1.0)
    log_masses[0, :, :, 7] = 300.0
    page_lists, page_counts = run_select(log_masses, seq_lens, gamma=0.98)
    assert page_lists[0, :, :3].tolist() == [[0, 7, 49]] * 2
    assert page_counts.tolist() == [[3, 3]]
    page_lists, page_counts = run_select(log_masses, seq_lens, top_k=4)
    assert page_counts.tolist() == [[4, 4]]  # page 7, then the first of the tied zeros
    assert page_lists[0, :, :4].tolist() == [[0, 1, 7, 49]] * 2


def _one_row(middle_log_masses, edge=0.0):
    """One row (one KV head, G = 1): sink and current page at ``edge``, the middle as given."""
    logs = [edge] + middle_log_masses + [edge]
    return (torch.tensor(logs).view(1, 1, 1, -1),
            torch.tensor([PAGE_SIZE * len(logs)], dtype=torch.int32))


@pytest.mark.parametrize("middle, edge, gamma", [
    ([5.0, 0.0], 0.0, 0.5),  # 4 pages: the top middle page alone reaches the target
    ([math.log(0.5), math.log(0.45)] + [math.log(0.001)] * 20, -10.0, 0.98),
])
def test_top_page_alone_reaching_the_target_is_kept_alone(middle, edge, gamma):
    """The bisection's early exit must test the top share too: no second page is kept when the
    largest one reaches the target (found in review: hi started at the top share)."""
    log_masses, seq_lens = _one_row(middle, edge)
    page_lists, page_counts = run_select(log_masses, seq_lens, gamma=gamma)
    want_lists, want_counts = ref.select(log_masses, seq_lens, gamma=gamma)
    assert (page_lists[0, 0, : page_counts[0, 0]].tolist()
            == want_lists[0, 0, : want_counts[0, 0]].tolist())


@pytest.mark.parametrize("gamma", [0.5, 0.9, 0.98])
def test_short_peaked_rows_match_reference(gamma):
    """Many rows of 3-12 pages with one or two dominant pages: where the bisection stops after a
    pass or two, each list must still be the reference's."""
    lengths = [PAGE_SIZE * n for n in range(3, 13)] * 4
    log_masses, seq_lens = random_log_masses(lengths, 2, 1, 6.0)
    page_lists, page_counts = run_select(log_masses, seq_lens, gamma=gamma)
    check_coverage(log_masses, seq_lens, page_lists, page_counts, gamma)


def test_target_met_by_forced_pages_keeps_only_them():
    log_masses, seq_lens = random_log_masses([64 * 20], 1, 2, 0.5)
    log_masses[..., 0] = 40.0  # the sink holds all the mass
    page_lists, page_counts = run_select(log_masses, seq_lens, gamma=0.98)
    assert page_lists[0, 0, : page_counts[0, 0]].tolist() == [0, 19]


@pytest.mark.parametrize("top_k", [2, 3, 17, 64])
def test_fixed_count_keeps_exactly_k(top_k):
    seq_lens = [1, 64 * 2, 64 * 17, 64 * 40 + 3, 64 * 200, 64 * 300]
    # 1,000 pages wide (1,024 lanes, 4 warps): rows on 256 (up to 200 pages) and 512 lanes
    log_masses, seq_lens = random_log_masses(seq_lens, 2, 4, 2.0, width=1000)
    log_masses[3, 0, :, 5:15] = 1.0  # exact ties at the cut
    page_lists, page_counts = run_select(log_masses, seq_lens, top_k=top_k)
    check_lists(page_lists, page_counts, seq_lens)
    shares = ref.group_shares(log_masses)
    for b, length in enumerate(seq_lens.tolist()):
        pages = ref.num_pages(length, log_masses.shape[-1])
        for h in range(2):
            kept = page_lists[b, h, : page_counts[b, h]].tolist()
            assert len(kept) == min(pages, top_k)
            if pages <= top_k:
                continue
            middle = shares[b, h, 1 : pages - 1]
            cut = torch.sort(middle, descending=True).values[top_k - 3] if top_k > 2 else 1.0
            chosen = torch.tensor(kept[1:-1], dtype=torch.long) - 1
            dropped = torch.ones(len(middle), dtype=torch.bool)
            dropped[chosen] = False
            assert (middle[chosen] >= cut - NEAR).all()
            assert (middle[dropped] <= cut + NEAR).all()


@pytest.mark.parametrize("per_request", [False, True])
def test_coverage_with_a_target_per_row(per_request):
    seq_lens = [1, 65, 64 * 37 + 9, 64 * 300, 0]
    log_masses, seq_lens = random_log_masses(seq_lens, 3, 4, 2.0)
    gammas = (torch.rand(len(seq_lens), 3) * 0.5 + 0.5 if per_request
              else torch.tensor([0.6, 0.98, 1.0]))
    gammas[..., -1] = 1.0  # the last KV head keeps every page, as a scalar gamma = 1 does
    page_lists, page_counts = run_select(log_masses, seq_lens, gamma=0.5, gammas=gammas)
    check_coverage(log_masses, seq_lens, page_lists, page_counts, gammas)
    if not per_request:  # the targets differ, so do the lists: 0.6 keeps fewer than 0.98
        assert (page_counts[3, 0] < page_counts[3, 1] < page_counts[3, 2]).item()


@pytest.mark.parametrize("mode", [dict(gamma=0.5), dict(top_k=3),
                                  dict(keep_fractions=torch.tensor([0.1, 0.1]))])
def test_short_rows_keep_every_page(mode):
    """Rows of at most dense_below_pages pages keep all of them, in every mode, without
    reading their log-masses (Estimate skips those rows: poisoned here)."""
    seq_lens = [1, 64 * 5, 64 * 6 + 1, 64 * 40, 0]
    log_masses, seq_lens = random_log_masses(seq_lens, 2, 4, 2.0)
    log_masses[:3] = float("nan")  # the short rows' masses, never written by Estimate
    page_lists, page_counts = run_select(log_masses, seq_lens, dense_below_pages=7, **mode)
    check_lists(page_lists, page_counts, seq_lens)
    assert page_counts[:3].tolist() == [[1, 1], [5, 5], [7, 7]]  # 7 pages: still short
    assert page_lists[2, 1, :7].tolist() == list(range(7))
    assert (page_counts[3] < 40).all()  # the long row is selected as usual
    reference = dict(mode, dense_below_pages=7)
    _, expected_counts = ref.select(torch.nan_to_num(log_masses, nan=0.0), seq_lens,
                                    **reference)
    assert torch.equal(page_counts[:3], expected_counts[:3])


def test_fraction_mode_keeps_each_heads_share_of_every_row():
    seq_lens = [1, 64 * 2, 64 * 17 + 9, 64 * 40 + 3, 64 * 200]
    log_masses, seq_lens = random_log_masses(seq_lens, 3, 4, 2.0)
    fractions = torch.tensor([0.05, 0.3, 1.0])
    page_lists, page_counts = run_select(log_masses, seq_lens, keep_fractions=fractions)
    check_lists(page_lists, page_counts, seq_lens)
    expected_counts = ref.fraction_counts(fractions, seq_lens, log_masses.shape[-1])
    pages = torch.tensor([ref.num_pages(n, log_masses.shape[-1]) for n in seq_lens.tolist()])
    assert torch.equal(page_counts, torch.minimum(expected_counts, pages[:, None]).int())
    assert page_counts[4].tolist() == [10, 60, 200]  # 200 pages: 5%, 30%, 100%
    expected_lists, _ = ref.select(log_masses, seq_lens, keep_fractions=fractions)
    for b in range(len(seq_lens)):
        for h in range(3):
            n = int(page_counts[b, h])
            assert page_lists[b, h, :n].tolist() == expected_lists[b, h, :n].tolist()
    # one fraction per (request, KV head)
    per_request = torch.rand(len(seq_lens), 3) * 0.9 + 0.05
    _, page_counts = run_select(log_masses, seq_lens, keep_fractions=per_request)
    expected = ref.fraction_counts(per_request, seq_lens, log_masses.shape[-1])
    assert torch.equal(page_counts, torch.minimum(expected, pages[:, None]).int())


@pytest.mark.parametrize("pages", [2000, 4096, 16384])
def test_long_rows(pages):
    # 16,384 pages = 1M tokens on chip in one program; 2,000 pages: 2,048 lanes in 8 warps
    # (``select.eight_warps_from``), a row on each of its lane tiers but the 512
    log_masses, seq_lens = random_log_masses([64 * pages - 5, 64 * 1000, 64 * 100 + 7], 1, 2,
                                             3.0, width=pages)
    page_lists, page_counts = run_select(log_masses, seq_lens, gamma=0.95)
    check_lists(page_lists, page_counts, seq_lens)
    expected_lists, expected_counts = ref.select(log_masses, seq_lens, gamma=0.95)
    shares = ref.group_shares(log_masses)
    for b in range(3):
        got = set(page_lists[b, 0, : page_counts[b, 0]].tolist())
        want = set(expected_lists[b, 0, : expected_counts[b, 0]].tolist())
        pages_in_row = ref.num_pages(seq_lens[b], pages)
        check_superset(shares[b, 0, :pages_in_row], got, want, 0.95)


def test_rows_clamped_to_block_table_width():
    # seq_len claims more pages than the table holds: never read or write past it
    log_masses, seq_lens = random_log_masses([64 * 8], 1, 1, 1.0)
    seq_lens[0] = 64 * 1000
    page_lists, page_counts = run_select(log_masses, seq_lens, gamma=1.0)
    assert page_counts.tolist() == [[8]]
