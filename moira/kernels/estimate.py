"""Estimate (paper 3.1, Eq. 2): the log-mass of every page for every query head.

    log m_{g,P} = s q_g . mu_P + 1/2 (s q_g)^2 . sigma_P^2 + log 64

from the page summaries, without reading keys; the sink (page 0) and the current (last) page,
which has no summary yet, are computed exactly from their keys.

Grid: (rows = batch * KV heads, page blocks of ``PAGES_PER_PROGRAM``); a program past its row's
last page exits. The programs holding the sink or the current page also read those pages' keys. Bytes: every page's summary (2 * D values) once, two pages of keys per row,
and G floats written per page.
"""

import math

import triton
import triton.language as tl

from ..config import PAGE_SIZE

# tuned on the H200 (benchmarks/NOTES.md)
PAGES_PER_PROGRAM = 32
NUM_WARPS = 4


@triton.jit
def exact_page_log_mass(q, key_cache, page, head, valid_tokens,
                        stride_kp, stride_kt, stride_kh, stride_kd, scale,
                        HEAD_DIM: tl.constexpr, PAGE: tl.constexpr):
    """log sum_t exp(scale * q_g . k_t) over the first ``valid_tokens`` keys of a page.

    q: ``[G_PAD, HEAD_DIM]`` in the cache's dtype; returns ``[G_PAD]`` float32."""
    tokens = tl.arange(0, PAGE)
    dims = tl.arange(0, HEAD_DIM)
    valid = tokens < valid_tokens
    keys = tl.load(key_cache + page.to(tl.int64) * stride_kp + head * stride_kh
                   + tokens[:, None] * stride_kt + dims[None, :] * stride_kd,
                   mask=valid[:, None], other=0.0)
    logits = tl.dot(q, tl.trans(keys)) * scale
    logits = tl.where(valid[None, :], logits, float("-inf"))
    peak = tl.max(logits, axis=1)
    return peak + tl.log(tl.sum(tl.exp(logits - peak[:, None]), axis=1))


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
    first = tl.program_id(1) * BLOCK_P
    b = row // num_kv_heads
    head = row % num_kv_heads
    seq_len = tl.load(seq_lens + b)
    pages_in_row = tl.minimum(tl.cdiv(seq_len, PAGE), max_pages)
    if first >= pages_in_row:
        return
    last = pages_in_row - 1

    dims = tl.arange(0, HEAD_DIM)
    pages = first + tl.arange(0, BLOCK_P)
    in_row = pages < pages_in_row
    summarized = (pages + 1) * PAGE <= seq_len  # the current page may have no summary yet
    physical = tl.load(block_table + b.to(tl.int64) * stride_bt + pages, mask=in_row, other=0)
    src = summaries + physical.to(tl.int64)[:, None] * stride_sp + head * stride_sh \
        + dims[None, :] * stride_sd
    mean = tl.load(src, mask=summarized[:, None], other=0.0).to(tl.float32)
    var = tl.load(src + stride_ss, mask=summarized[:, None], other=0.0).to(tl.float32)

    # the sink and the current page: exact, for all G query heads at once
    groups = tl.arange(0, GROUP_PAD)
    query_row = query + b.to(tl.int64) * stride_qb + head * GROUP * stride_qh
    has_sink = first == 0
    has_current = last < first + BLOCK_P
    if has_sink | has_current:
        q = tl.load(query_row + groups[:, None] * stride_qh + dims[None, :] * stride_qd,
                    mask=groups[:, None] < GROUP, other=0.0)
        sink_page = tl.load(block_table + b.to(tl.int64) * stride_bt)
        sink = exact_page_log_mass(q, key_cache, sink_page, head, seq_len,
                                   stride_kp, stride_kt, stride_kh, stride_kd, scale,
                                   HEAD_DIM, PAGE)
        current_page = tl.load(block_table + b.to(tl.int64) * stride_bt + last)
        current = exact_page_log_mass(q, key_cache, current_page, head, seq_len - last * PAGE,
                                      stride_kp, stride_kt, stride_kh, stride_kd, scale,
                                      HEAD_DIM, PAGE)
    else:
        sink = tl.zeros([GROUP_PAD], dtype=tl.float32)
        current = sink

    # mvar for the other pages: G is small, so plain FMAs and a row sum beat a padded tl.dot
    dst = log_masses + row.to(tl.int64) * stride_lr + pages
    for g in tl.static_range(GROUP):
        q_g = tl.load(query_row + g * stride_qh + dims * stride_qd).to(tl.float32) * scale
        est = tl.sum(mean * q_g[None, :] + var * (0.5 * q_g * q_g)[None, :], axis=1) \
            + math.log(PAGE)
        est = tl.where(pages == 0, tl.sum(tl.where(groups == g, sink, 0.0), axis=0), est)
        est = tl.where(pages == last, tl.sum(tl.where(groups == g, current, 0.0), axis=0), est)
        tl.store(dst + g * stride_lg, est, mask=in_row)


def estimate(query, key_cache, summaries, block_table, seq_lens, scale, log_masses):
    """Fill ``log_masses`` ``[batch * num_kv_heads, G, >= max_pages]`` float32 (pages past a
    row's end are not written)."""
    batch, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    max_pages = block_table.shape[1]
    grid = (batch * num_kv_heads, triton.cdiv(max_pages, PAGES_PER_PROGRAM))
    _estimate_kernel[grid](
        query, key_cache, summaries, block_table, seq_lens, log_masses,
        *query.stride(), *key_cache.stride(), *summaries.stride(),
        block_table.stride(0), log_masses.stride(0), log_masses.stride(1),
        num_kv_heads, max_pages, scale,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        PAGE=PAGE_SIZE, BLOCK_P=PAGES_PER_PROGRAM, num_warps=NUM_WARPS,
    )
    return log_masses
