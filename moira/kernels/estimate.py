"""Estimate (paper 3.1, Eq. 2): the log-mass of every page for every query head.

    log m_{g,P} = s q_g . mu_P + 1/2 (s q_g)^2 . sigma_P^2 + log 64

from the page summaries, without reading keys; the sink (page 0) and the current (last) page,
which has no summary yet, are computed exactly from their keys.

Grid: (rows = batch * KV heads, page blocks of ``PAGES_PER_PROGRAM``); a program past its row's
last page exits. Each row's first program also reads the keys of the sink and the current page.

Bytes: every page's summary (2 * D values) once, two pages of keys per row, and G floats written
per page.
"""

import math

import triton
import triton.language as tl

from ..config import PAGE_SIZE

# tuned on the H200 (benchmarks/NOTES.md)
PAGES_PER_PROGRAM = 64
NUM_WARPS = 8


@triton.jit
def _log_sum_exp(logits):
    peak = tl.max(logits, axis=0)
    return peak + tl.log(tl.sum(tl.exp(logits - peak), axis=0))


@triton.jit
def _estimate_kernel(query, key_cache, summaries, block_table, seq_lens, log_masses,
                     stride_qb, stride_qh, stride_qd,
                     stride_kp, stride_kt, stride_kh, stride_kd,
                     stride_sp, stride_sh, stride_ss, stride_sd,
                     stride_bt, stride_lr, stride_lg,
                     num_kv_heads, max_pages, scale,
                     GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
                     BLOCK_P: tl.constexpr):
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
    middle = (pages > 0) & (pages < last)  # full pages, summarized
    row_table = block_table + b.to(tl.int64) * stride_bt
    physical = tl.load(row_table + pages, mask=middle, other=0)
    src = summaries + physical.to(tl.int64)[:, None] * stride_sp + head * stride_sh \
        + dims[None, :] * stride_sd
    mean = tl.load(src, mask=middle[:, None], other=0.0).to(tl.float32)
    var = tl.load(src + stride_ss, mask=middle[:, None], other=0.0).to(tl.float32)

    # mvar: G is small, so plain FMAs and a row sum (a tl.dot would pad G to 16)
    query_row = query + b.to(tl.int64) * stride_qb + head * GROUP * stride_qh
    dst = log_masses + row.to(tl.int64) * stride_lr
    for g in tl.static_range(GROUP):
        q_g = tl.load(query_row + g * stride_qh + dims * stride_qd).to(tl.float32) * scale
        est = tl.sum(mean * q_g[None, :] + var * (0.5 * q_g * q_g)[None, :], axis=1) \
            + math.log(PAGE)
        tl.store(dst + g * stride_lg + pages, est, mask=middle)

    # the sink and the current page, which has no summary yet: exact, in the row's first
    # program (when the row has one page, both are page 0 and both stores agree)
    if first == 0:
        tokens = tl.arange(0, PAGE)
        in_sink = tokens < seq_len
        in_current = tokens < seq_len - last * PAGE
        keys = key_cache + head * stride_kh + tokens[:, None] * stride_kt \
            + dims[None, :] * stride_kd
        sink_keys = tl.load(keys + tl.load(row_table).to(tl.int64) * stride_kp,
                            mask=in_sink[:, None], other=0.0)
        current_keys = tl.load(keys + tl.load(row_table + last).to(tl.int64) * stride_kp,
                               mask=in_current[:, None], other=0.0)
        for g in tl.static_range(GROUP):
            q_g = tl.load(query_row + g * stride_qh + dims * stride_qd).to(tl.float32) * scale
            sink = tl.sum(sink_keys.to(tl.float32) * q_g[None, :], axis=1)
            current = tl.sum(current_keys.to(tl.float32) * q_g[None, :], axis=1)
            tl.store(dst + g * stride_lg, _log_sum_exp(tl.where(in_sink, sink, float("-inf"))))
            tl.store(dst + g * stride_lg + last,
                     _log_sum_exp(tl.where(in_current, current, float("-inf"))))


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
        GROUP=group, HEAD_DIM=head_dim, PAGE=PAGE_SIZE, BLOCK_P=PAGES_PER_PROGRAM,
        num_warps=NUM_WARPS,
    )
    return log_masses
