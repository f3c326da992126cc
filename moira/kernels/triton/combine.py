"""Helpers shared by the kernels that combine split rows (Merge and the balanced Merge): the
log-sum-exp combination and the page counters.

    lse = log sum_j exp(lse_j)      out = sum_j exp(lse_j - lse) * out_j
"""

import triton
import triton.language as tl


@triton.jit
def merged(partial_out, partial_lse, first_slot, num_chunks, g, GROUP: tl.constexpr,
           HEAD_DIM: tl.constexpr, SPLITS_PAD: tl.constexpr, SPLITS_PER_LOAD: tl.constexpr):
    """The LSE combination of query head ``g``'s partials in slots ``[first_slot, first_slot +
    num_chunks)`` (``partial_lse[slot * GROUP + g]``, ``partial_out[(slot * GROUP + g) * D]``).
    A row of at most ``SPLITS_PER_LOAD`` chunks loads its LSEs and its partials at once: one
    memory round trip, where the general form waits for the LSEs, then loads them again with
    the partials behind a mask made from them (three). Merge is a chain of dependent loads of
    a few KB per program, so the round trips are its time: measured 0.5-1.3 us less per layer
    in Attend + Merge at 8k x 32 to 128k x 4 on the H200 (docs/design/merge.md)."""
    if num_chunks <= SPLITS_PER_LOAD:
        result = _merged_in_one_load(partial_out, partial_lse, first_slot, num_chunks, g,
                                     GROUP, HEAD_DIM, SPLITS_PER_LOAD)
    else:
        result = _merged_in_loads(partial_out, partial_lse, first_slot, num_chunks, g, GROUP,
                                  HEAD_DIM, SPLITS_PAD, SPLITS_PER_LOAD)
    return result


@triton.jit
def _merged_in_one_load(partial_out, partial_lse, first_slot, num_chunks, g,
                        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                        SPLITS_PER_LOAD: tl.constexpr):
    split = tl.arange(0, SPLITS_PER_LOAD)
    slot = (first_slot + split) * GROUP + g
    real = split < num_chunks
    dims = tl.arange(0, HEAD_DIM)
    lse = tl.load(partial_lse + slot, mask=real, other=float("-inf"), cache_modifier=".cg")
    # every chunk's partial, written or not: a chunk without keys (lse -inf, weight 0) is
    # dropped by the where below, so whatever its slot holds (NaN included) cannot leak in
    part = tl.load(partial_out + slot[:, None] * HEAD_DIM + dims[None, :], mask=real[:, None],
                   other=0.0, cache_modifier=".cg")
    peak = tl.max(lse, axis=0)
    peak = tl.where(peak == float("-inf"), 0.0, peak)
    weight = tl.exp(lse - peak)
    total = tl.sum(weight, axis=0)
    acc = tl.sum(tl.where((weight > 0.0)[:, None], weight[:, None] * part, 0.0), axis=0)
    return acc / tl.where(total == 0.0, 1.0, total)


@triton.jit
def _merged_in_loads(partial_out, partial_lse, first_slot, num_chunks, g, GROUP: tl.constexpr,
                     HEAD_DIM: tl.constexpr, SPLITS_PAD: tl.constexpr,
                     SPLITS_PER_LOAD: tl.constexpr):
    splits = tl.arange(0, SPLITS_PAD)
    # .cg (L2, not L1): chosen for a merge folded into Attend (other SMs writing these in the
    # same kernel; that fold lost, docs/design/merge.md), kept so Merge's loads stay as timed
    lse = tl.load(partial_lse + (first_slot + splits) * GROUP + g, mask=splits < num_chunks,
                  other=float("-inf"), cache_modifier=".cg")
    peak = tl.max(lse, axis=0)
    peak = tl.where(peak == float("-inf"), 0.0, peak)
    total = tl.sum(tl.exp(lse - peak), axis=0)

    # many splits at once: independent loads, one memory round trip per SPLITS_PER_LOAD
    dims = tl.arange(0, HEAD_DIM)
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    for start in range(0, num_chunks, SPLITS_PER_LOAD):
        split = start + tl.arange(0, SPLITS_PER_LOAD)
        slot = (first_slot + split) * GROUP + g
        weight = tl.exp(tl.load(partial_lse + slot, mask=split < num_chunks,
                                other=float("-inf"), cache_modifier=".cg") - peak)
        part = tl.load(partial_out + slot[:, None] * HEAD_DIM + dims[None, :],
                       mask=(weight > 0.0)[:, None], other=0.0,  # empty chunks: never read
                       cache_modifier=".cg")
        acc += tl.sum(weight[:, None] * part, axis=0)
    return acc / tl.where(total == 0.0, 1.0, total)


@triton.jit
def add_page_stats(page_stats, seq_lens, b, count, max_pages, PAGE: tl.constexpr):
    """Add a row's listed pages and its pages present (``min(ceil(seq_len / 64), max_pages)``)
    to the two int64 counters."""
    row_pages = tl.minimum(tl.cdiv(tl.load(seq_lens + b), PAGE), max_pages)
    # relaxed: counters order nothing, and the default (acq_rel) fences every program's
    # memory around each add
    tl.atomic_add(page_stats, count.to(tl.int64), sem="relaxed")
    tl.atomic_add(page_stats + 1, row_pages.to(tl.int64), sem="relaxed")
