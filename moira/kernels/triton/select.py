"""Select (paper 3.2, Eq. 3, Alg. 1): each row's page list, by bisection on the threshold.

One program per (request, KV head) row keeps the row's group-mean shares on chip, on the
fewest lanes that hold the row (the block table's width rounded up to a power of two, or a half,
quarter or eighth of it, at least one lane per thread), so a short row in a wide table does not
pay for the width:

    share_P = 1/G sum_g softmax_P(log m_{g,.})

Coverage mode keeps the sink, the current page, and every middle page whose share is at least
tau, the largest threshold whose kept middle mass reaches gamma - share_sink - share_current.
tau is found without sorting: each pass tries K_B evenly spaced thresholds in [lo, hi] with one
reduction and keeps the sub-interval that holds tau; 24 / log2(K_B) passes shrink it 2**24-fold.
Because lo never passes tau, the kept set is the exact rule's set plus at most pages whose share
lies within (max share) * 2**-24 of tau. The masses are compared with gamma plus 2e-6, above the
float32 rounding of the sums, so the kept mass reaches gamma also where rounding would decide
(there the list may hold one page more than the exact rule's).

Fixed-count mode (paper 3.5) bisects on the *number* of middle pages above the threshold and
keeps exactly ``top_k`` pages per row (rows of at most ``top_k`` pages keep all); pages tied
within the final interval are taken in page order. Fraction mode is fixed-count mode with a
count per row, ``max(2, floor(f * pages + 0.5))`` with the row's fraction f (per KV head, or
per request and KV head), derived here from the row's length (budgets imposed for timing
studies, still filled with the top pages).

The coverage target is one ``gamma`` for every row, or one per row (``gammas``, per KV head or
per request and KV head: targets calibrated per head, where the estimate is known to state a
head's coverage too high or too low).

Rows of at most ``dense_below_pages`` pages keep every page in every mode (short rows, where
estimating and selecting would cost more than reading everything; Estimate skips them).

A middle page whose estimate is NaN or +inf for some head (non-finite keys, summaries or
queries) cannot be ranked: the estimate takes no part in its head's softmax, and the page is
kept under the coverage rule and ranks first in fixed-count mode (``reference.unreadable``), so
bad data never drops a page. (-inf is a mass of zero, as a page past the row has.)

Output: ``page_lists[b, h, :count]`` logical pages (sink, kept middle pages in increasing order,
current page) and ``page_counts[b, h] = count``. Entries past the count are not written.
"""

import triton
import triton.language as tl

from ...config import BISECTION_BITS, PAGE_SIZE
from .. import launch


def num_warps(block, eight_warps_from=2048):
    """Warps per row program, from ``block``, the block table's width in lanes (a launch
    parameter must not depend on the rows' lengths, which only the GPU knows). Select is a
    chain of dependent row-wide reductions, so a narrow table is fastest in one warp (no block
    barriers: shuffles only) and a wide one needs more warps to hold and reduce its shares.
    Timed on the H200 with tables as wide as the rows (``benchmarks/tune.py --kinds select``):
    128 lanes (8k x 32) 1 / 2 / 4 / 8 warps 4.0 / 4.4 / 5.1 / 6.2 us; 256 (16k x 32) 4.8 / 6.2
    / 7.3 / 8.5; 512 (32k x 16) 7.7 / 7.1 / 6.2 / 8.2; 2,048 (131k x 4) 28.1 / 12.6 / 9.1 /
    9.4. 4 warps beat 8 at 2,048 lanes alone, not in a step, where Attend's K/V stream evicts
    Select's code from the L2 (tuning ``select.eight_warps_from``; docs/design/select.md). In
    vLLM the table is as wide as ``max_model_len`` allows, so one warp serves engines of up to
    16k tokens."""
    if block <= 256:
        return 1
    if block < eight_warps_from:
        return 4
    return 8 if block <= 8192 else 16


@triton.jit
def _select_row(log_masses, row_values, lists, counts, row, b, head, pages_in_row,
                stride_lr, stride_lg, stride_vb, stride_vh, gamma, top_k,
                GROUP: tl.constexpr, BLOCK: tl.constexpr, WAYS: tl.constexpr,
                PASSES: tl.constexpr, FIXED_COUNT: tl.constexpr, FRACTIONS: tl.constexpr,
                ROW_GAMMAS: tl.constexpr, GROUP_PAD: tl.constexpr,
                SOFTMAX_TILE: tl.constexpr):
    """Select one row of 1 to ``BLOCK`` pages: its page list and count."""
    pages = tl.arange(0, BLOCK)
    in_row = pages < pages_in_row
    # group-mean attention share of every page. An estimate that is NaN or +inf takes no part
    # in its head's softmax, and its page is "unreadable": kept below
    row_masses = log_masses + row.to(tl.int64) * stride_lr
    if GROUP_PAD * BLOCK <= SOFTMAX_TILE:
        # all G softmaxes in one [G, BLOCK] tile: their maxima and sums are two reductions
        # side by side, not 2 G in a chain
        heads = tl.arange(0, GROUP_PAD)
        real = heads < GROUP
        ell = tl.load(row_masses + heads[:, None] * stride_lg + pages[None, :],
                      mask=real[:, None] & in_row[None, :], other=float("-inf"))
        bad = (ell != ell) | (ell == float("inf"))  # NaN or +inf; -inf is a zero mass
        unreadable = tl.max(bad.to(tl.int32), axis=0) > 0
        ell = tl.where(bad, float("-inf"), ell)
        peak = tl.max(ell, axis=1)
        peak = tl.where(peak > float("-inf"), peak, 0.0)  # padding heads, nothing finite
        weights = tl.exp(ell - peak[:, None])
        totals = tl.sum(weights, axis=1)
        totals = tl.where(totals > 0.0, totals, 1.0)
        shares = tl.sum(weights / totals[:, None], axis=0) / GROUP
    else:
        unreadable = pages < 0
        shares = tl.zeros([BLOCK], dtype=tl.float32)
        for g in range(GROUP):
            ell = tl.load(row_masses + g * stride_lg + pages, mask=in_row, other=float("-inf"))
            bad = (ell != ell) | (ell == float("inf"))
            unreadable = unreadable | bad
            ell = tl.where(bad, float("-inf"), ell)
            peak = tl.max(ell, axis=0)
            weights = tl.exp(ell - tl.where(peak > float("-inf"), peak, 0.0))
            total = tl.sum(weights, axis=0)
            shares += weights / tl.where(total > 0.0, total, 1.0)
        shares = shares / GROUP
    # unreadable: no share under the coverage rule (kept below), above every share (at most 1)
    # in fixed-count mode, so it ranks first
    shares = tl.where(unreadable, 2.0 if FIXED_COUNT else 0.0, shares)

    last = pages_in_row - 1
    forced = tl.sum(tl.where((pages == 0) | (pages == last), shares, 0.0), axis=0)
    middle = (pages > 0) & (pages < last)
    candidate = tl.where(middle, shares, -1.0)  # shares are >= 0: -1 is below every threshold
    top = tl.max(candidate, axis=0)
    fractions = tl.arange(0, WAYS).to(tl.float32) / WAYS

    if FIXED_COUNT:
        if FRACTIONS:
            fraction = tl.load(row_values + b * stride_vb + head * stride_vh)
            top_k = tl.maximum(tl.floor(fraction * pages_in_row + 0.5).to(tl.int32), 2)
        needed = top_k - 2
        lo = top * 0.0
        hi = top * (1.0 + 1e-6) + 1e-30  # strictly above every share: nothing is kept at hi
        for _ in range(PASSES):
            tau = lo + (hi - lo) * fractions
            above = tl.sum((candidate[None, :] >= tau[:, None]).to(tl.int32), axis=1)
            enough = above >= needed
            lo, hi = tl.max(tl.where(enough, tau, lo), axis=0), \
                tl.min(tl.where(enough, hi, tau), axis=0)
        sure = candidate >= hi  # fewer than `needed`
        tied = (candidate >= lo) & (candidate < hi)
        missing = needed - tl.sum(sure.to(tl.int32), axis=0)
        keep = sure | (tied & (tl.cumsum(tied.to(tl.int32), axis=0) <= missing))
        keep = tl.where(pages_in_row <= top_k, middle, keep)
    else:
        if ROW_GAMMAS:
            gamma = tl.load(row_values + b * stride_vb + head * stride_vh)
        # a margin above float32 rounding of the sums (~1e-6 over 16k pages): the kept mass
        # reaches gamma even where rounding makes it ambiguous, at the cost of a page there
        target = gamma - forced + 2e-6
        lo = top * 0.0
        hi = top
        for _ in range(PASSES):
            tau = lo + (hi - lo) * fractions
            mass = tl.sum(tl.where(candidate[None, :] >= tau[:, None], candidate[None, :], 0.0),
                          axis=1)
            enough = mass >= target
            lo, hi = tl.max(tl.where(enough, tau, lo), axis=0), \
                tl.min(tl.where(enough, hi, tau), axis=0)
        # gamma = 1 keeps every page (even shares that underflow to 0); a target the forced
        # pages already meet keeps no middle page
        lo = tl.where(gamma >= 1.0, -0.5, tl.where(gamma - forced <= 0.0, 2.0, lo))
        keep = (candidate >= lo) | (middle & unreadable)

    # compaction: sink, kept middle pages in order, current page
    kept = tl.sum(keep.to(tl.int32), axis=0)
    tl.store(lists + tl.cumsum(keep.to(tl.int32), axis=0), pages, mask=keep)
    tl.store(lists, 0)
    tl.store(lists + kept + 1, last, mask=last > 0)
    tl.store(counts, kept + tl.minimum(pages_in_row, 2))


@triton.jit
def _select_kernel(log_masses, seq_lens, row_values, page_lists, page_counts,
                   stride_lr, stride_lg, stride_pb, stride_ph, stride_cb, stride_ch,
                   stride_vb, stride_vh, num_kv_heads, max_pages, gamma, top_k,
                   dense_below_pages,
                   GROUP: tl.constexpr, BLOCK: tl.constexpr, BLOCK_2: tl.constexpr,
                   BLOCK_4: tl.constexpr, BLOCK_8: tl.constexpr, WAYS: tl.constexpr,
                   PASSES: tl.constexpr, FIXED_COUNT: tl.constexpr, FRACTIONS: tl.constexpr,
                   ROW_GAMMAS: tl.constexpr, PAGE: tl.constexpr, GROUP_PAD: tl.constexpr,
                   SOFTMAX_TILE: tl.constexpr, PDL: tl.constexpr):
    # row_values: the row's keep fraction (FRACTIONS) or coverage target (ROW_GAMMAS)
    launch.after_previous_kernel(PDL)
    row = tl.program_id(0)
    b = row // num_kv_heads
    head = row % num_kv_heads
    pages_in_row = tl.minimum(tl.cdiv(tl.load(seq_lens + b), PAGE), max_pages)
    lists = page_lists + b.to(tl.int64) * stride_pb + head * stride_ph
    counts = page_counts + b * stride_cb + head * stride_ch
    if pages_in_row == 0:
        tl.store(counts, 0)
        return

    if pages_in_row <= dense_below_pages:  # short row: every page (Estimate skipped it)
        pages = tl.arange(0, BLOCK)
        tl.store(lists + pages, pages, mask=pages < pages_in_row)
        tl.store(counts, pages_in_row)
        return

    # the row on the fewest lanes that hold it: the block table is as wide as the longest
    # context an engine admits, and a pass costs what its lanes cost, not what the row holds
    # (BLOCK_2, _4, _8: BLOCK / 2, 4, 8, at least one lane per thread; Triton needs each lane
    # count as a constant, hence one call per tier)
    if pages_in_row <= BLOCK_8:
        _select_row(log_masses, row_values, lists, counts, row, b, head, pages_in_row,
                    stride_lr, stride_lg, stride_vb, stride_vh, gamma, top_k,
                    GROUP, BLOCK_8, WAYS, PASSES, FIXED_COUNT, FRACTIONS, ROW_GAMMAS, GROUP_PAD,
                    SOFTMAX_TILE)
    elif pages_in_row <= BLOCK_4:
        _select_row(log_masses, row_values, lists, counts, row, b, head, pages_in_row,
                    stride_lr, stride_lg, stride_vb, stride_vh, gamma, top_k,
                    GROUP, BLOCK_4, WAYS, PASSES, FIXED_COUNT, FRACTIONS, ROW_GAMMAS, GROUP_PAD,
                    SOFTMAX_TILE)
    elif pages_in_row <= BLOCK_2:
        _select_row(log_masses, row_values, lists, counts, row, b, head, pages_in_row,
                    stride_lr, stride_lg, stride_vb, stride_vh, gamma, top_k,
                    GROUP, BLOCK_2, WAYS, PASSES, FIXED_COUNT, FRACTIONS, ROW_GAMMAS, GROUP_PAD,
                    SOFTMAX_TILE)
    else:
        _select_row(log_masses, row_values, lists, counts, row, b, head, pages_in_row,
                    stride_lr, stride_lg, stride_vb, stride_vh, gamma, top_k,
                    GROUP, BLOCK, WAYS, PASSES, FIXED_COUNT, FRACTIONS, ROW_GAMMAS, GROUP_PAD,
                    SOFTMAX_TILE)


def row_values_of(keep_fractions, gammas, page_counts):
    """``(row_values, fractions, row_gammas)`` of a call: its per-row values (keep fractions
    or coverage targets, a ``[num_kv_heads]`` tensor expanded to ``page_counts``' shape; None
    for neither) and which they are."""
    row_values = keep_fractions if keep_fractions is not None else gammas
    if row_values is not None and row_values.dim() == 1:  # per KV head, for every request
        row_values = row_values.expand(page_counts.shape)
    fractions = keep_fractions is not None
    return row_values, fractions, gammas is not None and not fractions


def select(log_masses, seq_lens, page_lists, page_counts, *, num_kv_heads, max_pages, gamma,
           top_k, ways, options, keep_fractions=None, gammas=None, dense_below_pages=0,
           programmatic_launch=False):
    """Fill ``page_lists`` ``[batch, num_kv_heads, >= max_pages]`` and ``page_counts``
    ``[batch, num_kv_heads]`` (int32) from ``log_masses`` ``[rows, G, >= max_pages]``.
    ``keep_fractions`` (float32 ``[num_kv_heads]`` or ``[batch, num_kv_heads]``) selects
    fraction mode; ``gammas`` (same shapes) gives each row its own coverage target. Rows of at
    most ``dense_below_pages`` pages keep every page, in any mode."""
    rows, group = log_masses.shape[0], log_masses.shape[1]
    block = max(16, triton.next_power_of_2(max_pages))
    # the smaller tiers keep at least one lane per thread: fewer would replicate the row across
    # threads and save nothing (and a scan over replicated lanes is a layout Triton's compiler
    # has miscompiled before)
    warps = options.value("select.num_warps") or num_warps(
        block, options.value("select.eight_warps_from"))
    lanes = min(block, 32 * warps)
    row_values, fractions, row_gammas = row_values_of(keep_fractions, gammas, page_counts)
    launch.on(_select_kernel, (rows,))(
        log_masses, seq_lens, seq_lens if row_values is None else row_values, page_lists,
        page_counts, log_masses.stride(0), log_masses.stride(1), *page_lists.stride()[:2],
        *page_counts.stride(), *(row_values.stride() if row_values is not None else (0, 0)),
        num_kv_heads, max_pages, float(gamma), int(top_k or 0), int(dense_below_pages),
        GROUP=group, BLOCK=block, BLOCK_2=max(lanes, block // 2),
        BLOCK_4=max(lanes, block // 4), BLOCK_8=max(lanes, block // 8), WAYS=ways,
        PASSES=BISECTION_BITS // (ways.bit_length() - 1),
        FIXED_COUNT=top_k is not None or fractions, FRACTIONS=fractions,
        ROW_GAMMAS=row_gammas, PAGE=PAGE_SIZE,
        GROUP_PAD=triton.next_power_of_2(group), SOFTMAX_TILE=options.value("select.softmax_tile"),
        num_warps=warps,
        **launch.options(programmatic_launch, "select", options.value("launch.chained")),
    )
    return page_lists, page_counts
