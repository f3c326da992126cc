"""Estimate (paper 3.1, Eq. 2): the log-mass of every page for every query head.

    log m_{g,P} = s q_g . mu_P + 1/2 (s q_g)^2 . sigma_P^2 + log 64

from the page summaries, without reading keys; the sink (page 0) and the current (last) page,
which has no summary yet, are computed exactly from their keys.

Grid: (rows = batch * KV heads, 1 + page blocks of ``PAGES_PER_PROGRAM``): program 0 of a row
computes the sink and the current page from their keys; the others apply mvar to the middle
pages of their block, and exit if the block is past the row's end. Bytes: every page's summary (2 * D values) once, two pages of keys per row,
and G floats written per page.
"""

import math

import triton
import triton.language as tl

from ..config import PAGE_SIZE

# tuned on the H200 (benchmarks/NOTES.md)
PAGES_PER_PROGRAM = 16
NUM_WARPS = 4


@triton.jit
def _exact_log_mass(keys, valid_tokens, q, groups, stride_kt, stride_kd,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
                    TOKENS: tl.constexpr):
    """log sum_t exp(q_g . k_t) over a page's first ``valid_tokens`` keys for every query head
    (``q`` ``[G_PAD, HEAD_DIM]`` float32, scaled), streaming ``TOKENS`` keys at a time so the
    tile stays small. Returns ``[G_PAD]``."""
    dims = tl.arange(0, HEAD_DIM)
    peak = tl.full(groups.shape, float("-inf"), dtype=tl.float32)
    total = tl.zeros(groups.shape, dtype=tl.float32)
    for start in tl.static_range(0, PAGE, TOKENS):
        tokens = start + tl.arange(0, TOKENS)
        valid = tokens < valid_tokens
        k = tl.load(keys + tokens[:, None] * stride_kt + dims[None, :] * stride_kd,
                    mask=valid[:, None], other=0.0).to(tl.float32)
        for g in tl.static_range(GROUP):
            q_g = tl.sum(tl.where(groups[:, None] == g, q, 0.0), axis=0)
            logits = tl.where(valid, tl.sum(k * q_g[None, :], axis=1), float("-inf"))
            tile_peak = tl.max(logits, axis=0)
            new_peak = tl.maximum(peak, tile_peak)
            safe = tl.where(new_peak == float("-inf"), 0.0, new_peak)  # all masked so far
            tile_total = tl.sum(tl.exp(logits - tl.sum(tl.where(groups == g, safe, 0.0))),
                                axis=0)
            total = tl.where(groups == g, total * tl.exp(peak - safe) + tile_total, total)
            peak = tl.where(groups == g, new_peak, peak)
    return peak + tl.log(tl.maximum(total, 1.0))  # >= 1 (the peak key); padded heads: 0


@triton.jit
def _estimate_kernel(query, key_cache, summaries, block_table, seq_lens, log_masses,
                     stride_qb, stride_qh, stride_qd,
                     stride_kp, stride_kt, stride_kh, stride_kd,
                     stride_sp, stride_sh, stride_ss, stride_sd,
                     stride_bt, stride_lr, stride_lg,
                     num_kv_heads, max_pages, scale,
                     GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                     PAGE: tl.constexpr, BLOCK_P: tl.constexpr):
    row = tl.program_id(0)
    block = tl.program_id(1)
    b = row // num_kv_heads
    head = row % num_kv_heads
    seq_len = tl.load(seq_lens + b)
    pages_in_row = tl.minimum(tl.cdiv(seq_len, PAGE), max_pages)
    last = pages_in_row - 1
    row_table = block_table + b.to(tl.int64) * stride_bt
    query_row = query + b.to(tl.int64) * stride_qb + head * GROUP * stride_qh
    dst = log_masses + row.to(tl.int64) * stride_lr
    dims = tl.arange(0, HEAD_DIM)

    if block == 0:
        # the sink and the current page, which has no summary yet: exact. Their own program,
        # scheduled first, so this longer work overlaps the mvar blocks. When the row has one
        # page, both are page 0 and both stores agree.
        if pages_in_row == 0:
            return
        groups = tl.arange(0, GROUP_PAD)
        q = tl.load(query_row + groups[:, None] * stride_qh + dims[None, :] * stride_qd,
                    mask=groups[:, None] < GROUP, other=0.0).to(tl.float32) * scale
        keys = key_cache + head * stride_kh
        sink = _exact_log_mass(keys + tl.load(row_table).to(tl.int64) * stride_kp, seq_len,
                               q, groups, stride_kt, stride_kd, GROUP, HEAD_DIM, PAGE, 16)
        current = _exact_log_mass(keys + tl.load(row_table + last).to(tl.int64) * stride_kp,
                                  seq_len - last * PAGE, q, groups, stride_kt, stride_kd,
                                  GROUP, HEAD_DIM, PAGE, 16)
        tl.store(dst + groups * stride_lg, sink, mask=groups < GROUP)
        tl.store(dst + groups * stride_lg + last, current, mask=groups < GROUP)
        return

    first = (block - 1) * BLOCK_P
    if first >= pages_in_row:
        return
    pages = first + tl.arange(0, BLOCK_P)
    middle = (pages > 0) & (pages < last)  # full pages, summarized
    physical = tl.load(row_table + pages, mask=middle, other=0)
    src = summaries + physical.to(tl.int64)[:, None] * stride_sp + head * stride_sh \
        + dims[None, :] * stride_sd
    mean = tl.load(src, mask=middle[:, None], other=0.0).to(tl.float32)
    var = tl.load(src + stride_ss, mask=middle[:, None], other=0.0).to(tl.float32)
    # mvar: G is small, so plain FMAs and a row sum (a tl.dot would pad G to 16)
    for g in tl.static_range(GROUP):
        q_g = tl.load(query_row + g * stride_qh + dims * stride_qd).to(tl.float32) * scale
        est = tl.sum(mean * q_g[None, :] + var * (0.5 * q_g * q_g)[None, :], axis=1) \
            + math.log(PAGE)
        tl.store(dst + g * stride_lg + pages, est, mask=middle)


def estimate(query, key_cache, summaries, block_table, seq_lens, scale, log_masses):
    """Fill ``log_masses`` ``[batch * num_kv_heads, G, >= max_pages]`` float32 (pages past a
    row's end are not written)."""
    batch, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    max_pages = block_table.shape[1]
    # column 0: the exact pages of each row; then the mvar page blocks
    grid = (batch * num_kv_heads, 1 + triton.cdiv(max_pages, PAGES_PER_PROGRAM))
    _estimate_kernel[grid](
        query, key_cache, summaries, block_table, seq_lens, log_masses,
        *query.stride(), *key_cache.stride(), *summaries.stride(),
        block_table.stride(0), log_masses.stride(0), log_masses.stride(1),
        num_kv_heads, max_pages, scale,
        GROUP=group, GROUP_PAD=triton.next_power_of_2(group), HEAD_DIM=head_dim,
        PAGE=PAGE_SIZE, BLOCK_P=PAGES_PER_PROGRAM, num_warps=NUM_WARPS,
    )
    return log_masses
