"""Estimate: the log-mass of every page for every query head, from the page summaries.

    mvar (paper 3.1, Eq. 2):  log m_{g,P} = s q_g . mu_P + 1/2 (s q_g)^2 . sigma_P^2 + log 64
    int2 / int4:              log m_{g,P} = log sum_t exp(s q_g . (lo_P + code_t * step_P))

without reading keys; the sink (page 0) and the current (last) page, which has no summary yet,
are computed exactly from their keys. The codes' logits are one small matrix product per
page and code slice, ``[64, D * BITS / 8]`` codes x ``[D * BITS / 8, G]`` queries scaled by
the slice's steps (``_codes_store``): integer codes times per-channel scales, so the
dequantized keys are never formed.

Grid: (rows = batch * KV heads, 2 + J): programs 0 and 1 of a row compute the sink and the
current page from their keys; the J others split the row's tiles of 32 pages
between them, each reading the row's length from GPU memory (as Attend does), and apply mvar to
the middle pages. J depends on the batch shape alone (``programs_per_row``): enough programs to
fill the GPU, not one per tile of the block table's width. In an engine the block table is as
wide as the longest context it admits, so a grid sized by the width launched, at 8k x 32 in a
130k-token engine (2,037 pages), 66 programs per row of which 7 had work (measured in vLLM's
step: Estimate 29 us per layer in the engine against 13-16 in a bench whose table was as wide
as its rows; docs/design/estimate.md).

Program 1 also summarizes the current page when this step's token has just filled it (the
row's length a multiple of 64): the page is a middle page from the next step on, and a decode
step then needs no separate summarize launch (``summarize.summarize_page``, the same math).

With ``new_kv`` (``sparse_decode``'s ``new_keys`` / ``new_values`` / ``slot_mapping``) program 1
first writes the request's new key and value of its KV head into their slot, so a decode step
needs no separate cache-write launch either; a one-page row is then program 1's alone.

Bytes: every page's summary (2 * D values, plus 64 * D * BITS / 8 code bytes) once, two
pages of keys per row, and G floats written per page.
"""

import math

import triton
import triton.language as tl

from ...config import PAGE_SIZE
from .. import launch
from .summarize import code_view, summarize_page


def max_registers(group, options, bits=0):
    """Triton's ``maxnreg`` for Estimate's build at ``group`` query heads per KV head: the
    ``estimate.max_registers`` ceiling up to ``estimate.max_registers_group`` heads (96
    registers fit 5 blocks per SM without spills at G <= 4; G = 8 spills), ptxas's choice
    above and for the codes (``bits`` > 0: their [64, D * bits / 8] tiles spill under 96)."""
    if bits == 0 and group <= options.value("estimate.max_registers_group"):
        return options.value("estimate.max_registers")
    return None


def programs_per_row(rows, max_pages, options):
    """J: mvar programs per row for a step of ``rows`` rows and a block table of ``max_pages``
    pages per row: about ``estimate.target_programs`` over the batch, at most one per tile of
    the table, and enough that no program has more than ``estimate.max_tiles_per_program``
    tiles (so the grid follows the batch shape, not the table's width)."""
    table_tiles = triton.cdiv(max_pages, options.value("estimate.pages_per_program"))
    target = options.value("estimate.target_programs")
    most_tiles = options.value("estimate.max_tiles_per_program")
    return max(1, min(table_tiles, max(triton.cdiv(target, max(rows, 1)),
                                       triton.cdiv(table_tiles, most_tiles))))


@triton.jit
def _log_sum_exp(logits):
    peak = tl.max(logits, axis=0)
    return peak + tl.log(tl.sum(tl.exp(logits - peak), axis=0))


@triton.jit
def _summary_tile(summaries, physical, middle, head, stride_sp, stride_sh, stride_ss,
                  stride_sd, HEAD_DIM: tl.constexpr):
    """The summaries (mean, variance) ``[pages, D]`` of the ``middle`` pages, whose physical
    ids are ``physical``, in the summaries' dtype (zeros elsewhere)."""
    dims = tl.arange(0, HEAD_DIM)
    src = summaries + physical.to(tl.int64)[:, None] * stride_sp + head * stride_sh \
        + dims[None, :] * stride_sd
    return (tl.load(src, mask=middle[:, None], other=0.0),
            tl.load(src + stride_ss, mask=middle[:, None], other=0.0))


@triton.jit
def _query_head(query_row, q_next, g: tl.constexpr, dims, scale, stride_qh, stride_qd,
                GROUP: tl.constexpr, AHEAD: tl.constexpr):
    """(head ``g``'s query scaled, float32; the raw query to pass for head g + 1). With
    ``AHEAD`` (``estimate.query_head_ahead``) ``q_next`` holds head g's raw query, loaded during
    head g - 1 (head 0's before the loop), and head g + 1's is loaded now; otherwise head g's
    loads now."""
    if AHEAD:
        q_g = q_next.to(tl.float32) * scale
        if g + 1 < GROUP:
            q_next = tl.load(query_row + (g + 1) * stride_qh + dims * stride_qd)
    else:
        q_g = tl.load(query_row + g * stride_qh + dims * stride_qd).to(tl.float32) * scale
    return q_g, q_next


@triton.jit
def _mvar_store(query_row, dst, mean, var, pages, middle, scale, stride_qh, stride_qd,
                stride_lg, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
                QUERY_AHEAD: tl.constexpr):
    """mvar of the ``middle`` pages among ``pages`` from their summaries for every head of the
    group, stored at ``dst[g, page]``: G is small, so plain FMAs and a row sum per head."""
    dims = tl.arange(0, HEAD_DIM)
    mean = mean.to(tl.float32)
    var = var.to(tl.float32)
    q_next = tl.load(query_row + dims * stride_qd)  # head 0's query
    for g in tl.static_range(GROUP):
        q_g, q_next = _query_head(query_row, q_next, g, dims, scale, stride_qh, stride_qd,
                                  GROUP, QUERY_AHEAD)
        est = tl.sum(mean * q_g[None, :] + var * (0.5 * q_g * q_g)[None, :], axis=1) \
            + math.log(PAGE)
        tl.store(dst + g * stride_lg + pages, est, mask=middle)


@triton.jit
def _codes_store(query_row, dst, summaries, codes, physical, page, head, scale,
                 stride_qh, stride_qd, stride_sp, stride_sh, stride_ss, stride_sd,
                 stride_cp, stride_ch, stride_lg, GROUP: tl.constexpr,
                 GROUP_DOT: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
                 BITS: tl.constexpr):
    """The log-mass of one full page from its codes for every head of the group, stored at
    ``dst[g, page]``. Code slice ``part`` holds channels ``part * WIDTH + j`` (j < WIDTH) at
    bits ``part * BITS``: q . k~_t = q . lo + sum_c (q_c step_c) code_{t,c}."""
    WIDTH: tl.constexpr = HEAD_DIM * BITS // 8
    LEVELS: tl.constexpr = (1 << BITS) - 1
    cols = tl.arange(0, WIDTH)
    heads = tl.arange(0, GROUP_DOT)
    tokens = tl.arange(0, PAGE)
    physical = physical.to(tl.int64)
    bounds = summaries + physical * stride_sp + head * stride_sh
    packed = tl.load(codes + physical * stride_cp + head * stride_ch + tokens[:, None] * WIDTH
                     + cols[None, :]).to(tl.int32)
    logits = tl.zeros([PAGE, GROUP_DOT], dtype=tl.float32)
    base = tl.zeros([GROUP_DOT], dtype=tl.float32)
    for part in tl.static_range(8 // BITS):
        dims = part * WIDTH + cols
        lo = tl.load(bounds + dims * stride_sd).to(tl.float32)
        step = (tl.load(bounds + stride_ss + dims * stride_sd).to(tl.float32) - lo) / LEVELS
        q = tl.load(query_row + heads[None, :] * stride_qh + dims[:, None] * stride_qd,
                    mask=heads[None, :] < GROUP, other=0.0).to(tl.float32) * scale
        base += tl.sum(q * lo[:, None], axis=0)
        plane = ((packed >> (part * BITS)) & LEVELS).to(tl.float32)  # [PAGE, WIDTH]
        logits += tl.dot(plane, q * step[:, None], input_precision="tf32x3")
    logits += base[None, :]
    peak = tl.max(logits, axis=0)
    lse = peak + tl.log(tl.sum(tl.exp(logits - peak[None, :]), axis=0))
    tl.store(dst + heads * stride_lg + page, lse, mask=heads < GROUP)


@triton.jit
def _write_new_token(new_keys, new_values, key_cache, value_cache, slot_mapping, b, head,
                     num_slots, stride_knb, stride_knh, stride_knd,
                     stride_vnb, stride_vnh, stride_vnd,
                     stride_kp, stride_kt, stride_kh, stride_kd,
                     stride_vp, stride_vt, stride_vh, stride_vd,
                     HEAD_DIM: tl.constexpr, PAGE: tl.constexpr):
    """Request ``b``'s new key and value of KV head ``head`` into their cache slot (vLLM's
    ``reshape_and_cache_flash`` for one decode token; a negative slot, vLLM's padding, is not
    written)."""
    if b < num_slots:
        slot = tl.load(slot_mapping + b).to(tl.int64)
        if slot >= 0:
            dims = tl.arange(0, HEAD_DIM)
            page = slot // PAGE
            offset = slot % PAGE
            key = tl.load(new_keys + b.to(tl.int64) * stride_knb + head * stride_knh
                          + dims * stride_knd)
            value = tl.load(new_values + b.to(tl.int64) * stride_vnb + head * stride_vnh
                            + dims * stride_vnd)
            tl.store(key_cache + page * stride_kp + offset * stride_kt + head * stride_kh
                     + dims * stride_kd, key.to(key_cache.dtype.element_ty))
            tl.store(value_cache + page * stride_vp + offset * stride_vt + head * stride_vh
                     + dims * stride_vd, value.to(value_cache.dtype.element_ty))


# one build for every batch size: dense_below_pages follows the planned batch (320 / 160 / 80 /
# 40 ... pages), and a specialized int would build once per class (multiple of 16, 1, other)
@triton.jit(do_not_specialize=["dense_below_pages", "mvar_programs", "num_slots"])
def _estimate_kernel(query, key_cache, summaries, codes, block_table, seq_lens, log_masses,
                     new_keys, new_values, value_cache, slot_mapping,
                     stride_qb, stride_qh, stride_qd,
                     stride_kp, stride_kt, stride_kh, stride_kd,
                     stride_sp, stride_sh, stride_ss, stride_sd, stride_cp, stride_ch,
                     stride_bt, stride_lr, stride_lg,
                     stride_knb, stride_knh, stride_knd, stride_vnb, stride_vnh, stride_vnd,
                     stride_vp, stride_vt, stride_vh, stride_vd,
                     num_kv_heads, max_pages, scale, dense_below_pages, mvar_programs,
                     num_slots,
                     GROUP: tl.constexpr, GROUP_DOT: tl.constexpr, CODE_DOT: tl.constexpr,
                     HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_P: tl.constexpr,
                     BITS: tl.constexpr,
                     EXACT: tl.constexpr, WRITE_KV: tl.constexpr, QUERY_AHEAD: tl.constexpr,
                     PDL: tl.constexpr):
    launch.after_previous_kernel(PDL)
    row = tl.program_id(0)
    block = tl.program_id(1)
    b = row // num_kv_heads
    head = row % num_kv_heads
    row_table = block_table + b.to(tl.int64) * stride_bt
    seq_len = tl.load(seq_lens + b)
    pages_in_row = tl.minimum(tl.cdiv(seq_len, PAGE), max_pages)
    last = pages_in_row - 1
    if block == 1:
        if WRITE_KV:  # this step's token first: the current page's keys below include it
            _write_new_token(new_keys, new_values, key_cache, value_cache, slot_mapping, b,
                             head, num_slots, stride_knb, stride_knh, stride_knd,
                             stride_vnb, stride_vnh, stride_vnd,
                             stride_kp, stride_kt, stride_kh, stride_kd,
                             stride_vp, stride_vt, stride_vh, stride_vd, HEAD_DIM, PAGE)
            tl.debug_barrier()  # the block's own global stores, seen by all its threads
        if (pages_in_row > 0) & (seq_len == pages_in_row * PAGE):  # the step filled it
            summarize_page(key_cache, summaries, codes, tl.load(row_table + last), head,
                           stride_kp, stride_kt, stride_kh, stride_kd,
                           stride_sp, stride_sh, stride_ss, stride_sd, stride_cp, stride_ch,
                           HEAD_DIM, PAGE, BITS)
    if pages_in_row <= dense_below_pages:  # Select keeps the whole row: nothing to estimate
        return
    query_row = query + b.to(tl.int64) * stride_qb + head * GROUP * stride_qh
    dst = log_masses + row.to(tl.int64) * stride_lr
    dims = tl.arange(0, HEAD_DIM)

    if block < 2:
        # program 0: the sink, program 1: the current page (no summary yet), exact, one tile
        # each; they come first in the grid so their key reads overlap the mvar blocks. A
        # single page is program 1's alone: its new token may be written by that program.
        if (pages_in_row == 0) | ((block == 0) & (last == 0)):
            return
        page = tl.where(block == 0, 0, last)
        tokens = tl.arange(0, PAGE)
        valid = tokens < seq_len - page * PAGE
        physical = tl.load(row_table + page).to(tl.int64)
        keys = tl.load(key_cache + physical * stride_kp + head * stride_kh
                       + tokens[:, None] * stride_kt + dims[None, :] * stride_kd,
                       mask=valid[:, None], other=0.0)
        if EXACT == "chained":
            keys = keys.to(tl.float32)
            q_next = tl.load(query_row + dims * stride_qd)  # head 0's query
            for g in tl.static_range(GROUP):
                q_g, q_next = _query_head(query_row, q_next, g, dims, scale, stride_qh,
                                          stride_qd, GROUP, QUERY_AHEAD)
                logits = tl.where(valid, tl.sum(keys * q_g[None, :], axis=1), float("-inf"))
                tl.store(dst + g * stride_lg + page, _log_sum_exp(logits))
        else:  # "side by side": the G heads' logits in one [64, GROUP_DOT] tile
            heads = tl.arange(0, GROUP_DOT)
            keys = keys.to(tl.float32)
            tile = tl.zeros([PAGE, GROUP_DOT], dtype=tl.float32)
            for g in tl.static_range(GROUP):
                q_g = tl.load(query_row + g * stride_qh + dims * stride_qd).to(tl.float32) \
                    * scale
                logits = tl.sum(keys * q_g[None, :], axis=1)
                tile = tl.where(heads[None, :] == g, logits[:, None], tile)
            # a page has a valid token (page <= last): every head's peak is finite (padded
            # heads' logits are 0 and not stored)
            tile = tl.where(valid[:, None], tile, float("-inf"))
            peak = tl.max(tile, axis=0)
            lse = peak + tl.log(tl.sum(tl.exp(tile - peak[None, :]), axis=0))
            tl.store(dst + heads * stride_lg + page, lse, mask=heads < GROUP)
        return

    # this program's tiles of the row: an even share of the row's own tiles
    tiles = tl.cdiv(pages_in_row, BLOCK_P)
    share = tl.cdiv(tiles, mvar_programs)
    first_tile = (block - 2) * share
    if BITS > 0:  # page by page: each is a [64, G] product of its codes
        for page in range(tl.maximum(first_tile * BLOCK_P, 1),
                          tl.minimum((first_tile + share) * BLOCK_P, last)):
            _codes_store(query_row, dst, summaries, codes, tl.load(row_table + page), page,
                         head, scale, stride_qh, stride_qd, stride_sp, stride_sh, stride_ss,
                         stride_sd, stride_cp, stride_ch, stride_lg, GROUP, CODE_DOT,
                         HEAD_DIM, PAGE, BITS)
        return
    for tile in range(first_tile, tl.minimum(first_tile + share, tiles)):
        pages = tile * BLOCK_P + tl.arange(0, BLOCK_P)
        middle = (pages > 0) & (pages < last)  # full pages, summarized
        physical = tl.load(row_table + pages, mask=middle, other=0)
        mean, var = _summary_tile(summaries, physical, middle, head, stride_sp, stride_sh,
                                  stride_ss, stride_sd, HEAD_DIM)
        _mvar_store(query_row, dst, mean, var, pages, middle, scale, stride_qh, stride_qd,
                    stride_lg, GROUP, HEAD_DIM, PAGE, QUERY_AHEAD)


def estimate(query, key_cache, summaries, block_table, seq_lens, scale, log_masses,
             options, dense_below_pages=0, programmatic_launch=False, new_kv=None, bits=0):
    """Fill ``log_masses`` ``[batch * num_kv_heads, G, >= max_pages]`` float32 (pages past a
    row's end, and rows of at most ``dense_below_pages`` pages, are not written), and write
    ``summaries`` of every row's current page that is full.

    ``new_kv``: ``(new_keys, new_values, value_cache, slot_mapping)``, request ``b``'s new
    key and value (``[batch, num_kv_heads, head_dim]``) written to slot ``slot_mapping[b]``
    (``b < len(slot_mapping)``, negative: not written) before anything reads the page, so a
    decode step needs no separate cache-write launch. ``options``: the ``KernelOptions``
    whose ``estimate.*`` tuning builds the kernel. ``bits``: the estimator's
    (``config.ESTIMATOR_BITS``, 0 = mvar)."""
    batch, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    max_pages = block_table.shape[1]
    rows = batch * num_kv_heads
    per_row = programs_per_row(rows, max_pages, options)
    # columns 0 and 1: the exact sink and current page of each row; then the mvar programs
    grid = (rows, 2 + per_row)
    # without new_kv the write's code is not compiled: any tensors of the right ranks will do
    new_keys, new_values, value_cache, slot_mapping = new_kv or (query, query, key_cache,
                                                                 seq_lens)
    codes, stride_cp, stride_ch = code_view(summaries, bits)
    launch.on(_estimate_kernel, grid)(
        query, key_cache, summaries, codes, block_table, seq_lens, log_masses,
        new_keys, new_values, value_cache, slot_mapping,
        *query.stride(), *key_cache.stride(), *summaries.stride(), stride_cp, stride_ch,
        block_table.stride(0), log_masses.stride(0), log_masses.stride(1),
        *new_keys.stride(), *new_values.stride(), *value_cache.stride(),
        num_kv_heads, max_pages, scale, dense_below_pages, per_row,
        slot_mapping.shape[0] if new_kv else 0,
        GROUP=group, GROUP_DOT=triton.next_power_of_2(group),
        CODE_DOT=max(16, triton.next_power_of_2(group)),  # tl.dot's smallest N
        HEAD_DIM=head_dim, PAGE=PAGE_SIZE, BLOCK_P=options.value("estimate.pages_per_program"),
        BITS=bits,
        EXACT=options.value("estimate.exact_pages"), WRITE_KV=new_kv is not None,
        QUERY_AHEAD=options.value("estimate.query_head_ahead"),
        num_warps=options.value("estimate.num_warps"),
        maxnreg=max_registers(group, options, bits),
        **launch.options(programmatic_launch, "estimate",
                         options.value("launch.chained")),
    )
    return log_masses
