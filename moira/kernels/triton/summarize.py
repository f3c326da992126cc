"""Page summaries: what Estimate reads of a full page instead of its 64 keys.

``BITS`` 0 (``"mvar"``): per-channel mean and population variance. ``BITS`` 2 / 4
(``"int2"`` / ``"int4"``): per-channel min and max, then every key's codes, ``BITS`` bits per
channel, as bytes (layout: ``moira.config.summary_rows``; spec: ``reference.quantize_page``).

Two launchers over one device function: ``summarize_pages`` for every full page a block table
references (after prefill), and ``summarize_filled_slots`` for the pages whose last slot a step
has just written (prefill chunks; graph-safe, its grid is the slot count). A decode step needs
neither: Estimate calls ``summarize_page`` for the page the step's token filled.

Bytes: each summarized page reads 64 keys (64 * D elements) and writes 2 * D values, plus
64 * D * BITS / 8 code bytes.
"""

import torch
import triton
import triton.language as tl

from ...config import PAGE_SIZE
from .. import launch


@triton.jit
def summarize_page(key_cache, summaries, codes, page, head,
                   stride_kp, stride_kt, stride_kh, stride_kd,
                   stride_sp, stride_sh, stride_ss, stride_sd, stride_cp, stride_ch,
                   HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BITS: tl.constexpr):
    """Summarize physical page ``page`` of KV head ``head``; ``codes``: the summaries' bytes
    from row 2 on (unused for mvar)."""
    tokens = tl.arange(0, PAGE)
    page = page.to(tl.int64)  # page * stride can pass 2**31 in a large cache
    src = key_cache + page * stride_kp + head * stride_kh + tokens[:, None] * stride_kt
    dst = summaries + page * stride_sp + head * stride_sh
    if BITS == 0:
        dims = tl.arange(0, HEAD_DIM)
        keys = tl.load(src + dims[None, :] * stride_kd).to(tl.float32)
        mean = tl.sum(keys, axis=0) / PAGE
        centered = keys - mean[None, :]  # two passes on chip: no cancellation in E[k^2] - E[k]^2
        var = tl.sum(centered * centered, axis=0) / PAGE
        tl.store(dst + dims * stride_sd, mean.to(summaries.dtype.element_ty))
        tl.store(dst + stride_ss + dims * stride_sd, var.to(summaries.dtype.element_ty))
    else:
        # byte j of a token packs channels j, j + WIDTH, ...: each pass takes one such slice
        WIDTH: tl.constexpr = HEAD_DIM * BITS // 8
        LEVELS: tl.constexpr = (1 << BITS) - 1
        cols = tl.arange(0, WIDTH)
        packed = tl.zeros([PAGE, WIDTH], dtype=tl.int32)
        for part in tl.static_range(8 // BITS):
            dims = part * WIDTH + cols
            keys = tl.load(src + dims[None, :] * stride_kd).to(tl.float32)
            # tl.min / tl.max skip NaN: a NaN key makes its channel's min NaN here, as the
            # spec's, so the page's estimate is NaN and Select keeps it
            nan = tl.max((keys != keys).to(tl.int32), axis=0) > 0
            lo = tl.where(nan, float("nan"), tl.min(keys, axis=0)).to(summaries.dtype.element_ty)
            hi = tl.max(keys, axis=0).to(summaries.dtype.element_ty)
            tl.store(dst + dims * stride_sd, lo)
            tl.store(dst + stride_ss + dims * stride_sd, hi)
            # codes against the stored (rounded) bounds, which Estimate dequantizes with
            lo = lo.to(tl.float32)
            step = (hi.to(tl.float32) - lo) / LEVELS
            scaled = tl.where(step[None, :] > 0,
                              (keys - lo[None, :]) / tl.where(step > 0, step, 1.0)[None, :], 0.0)
            code = tl.minimum(tl.maximum(tl.floor(scaled + 0.5), 0.0), LEVELS).to(tl.int32)
            packed = packed | (code << (part * BITS))
        tl.store(codes + page * stride_cp + head * stride_ch + tokens[:, None] * WIDTH
                 + cols[None, :], packed.to(tl.uint8))


def code_view(summaries, estimator_bits):
    """``(codes, stride_cp, stride_ch)``: the summaries' bytes from row 2 on, the kernels'
    ``codes`` argument (the summaries themselves for mvar, never read)."""
    if estimator_bits == 0:
        return summaries, 0, 0
    raw = summaries.view(torch.uint8)[:, :, 2:]  # [pages, kv_heads, rows - 2, D * itemsize]
    return raw, raw.stride(0), raw.stride(1)


@triton.jit
def _summarize_pages_kernel(key_cache, summaries, codes, block_table, seq_lens,
                            stride_kp, stride_kt, stride_kh, stride_kd,
                            stride_sp, stride_sh, stride_ss, stride_sd, stride_cp, stride_ch,
                            stride_bt,
                            HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BITS: tl.constexpr):
    logical = tl.program_id(0)
    b = tl.program_id(1)
    head = tl.program_id(2)
    if logical >= tl.load(seq_lens + b) // PAGE:  # partial or absent page: untouched
        return
    page = tl.load(block_table + b.to(tl.int64) * stride_bt + logical)
    summarize_page(key_cache, summaries, codes, page, head,
                   stride_kp, stride_kt, stride_kh, stride_kd,
                   stride_sp, stride_sh, stride_ss, stride_sd, stride_cp, stride_ch,
                   HEAD_DIM, PAGE, BITS)


@triton.jit
def _summarize_filled_slots_kernel(key_cache, summaries, codes, slot_mapping,
                                   stride_kp, stride_kt, stride_kh, stride_kd,
                                   stride_sp, stride_sh, stride_ss, stride_sd,
                                   stride_cp, stride_ch,
                                   HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
                                   BITS: tl.constexpr):
    slot = tl.load(slot_mapping + tl.program_id(0)).to(tl.int64)
    head = tl.program_id(1)
    if (slot < 0) | (slot % PAGE != PAGE - 1):  # padding, or the page is not full yet
        return
    summarize_page(key_cache, summaries, codes, slot // PAGE, head,
                   stride_kp, stride_kt, stride_kh, stride_kd,
                   stride_sp, stride_sh, stride_ss, stride_sd, stride_cp, stride_ch,
                   HEAD_DIM, PAGE, BITS)


def summarize_pages(key_cache, block_table, seq_lens, summaries, bits=0):
    """Summarize every full page of every row (grid: pages x batch x KV heads); ``bits``: the
    estimator's (``config.ESTIMATOR_BITS``)."""
    _, _, num_kv_heads, head_dim = key_cache.shape
    batch, max_pages = block_table.shape
    if batch == 0 or max_pages == 0:
        return summaries
    codes, stride_cp, stride_ch = code_view(summaries, bits)
    launch.on(_summarize_pages_kernel, (max_pages, batch, num_kv_heads))(
        key_cache, summaries, codes, block_table, seq_lens,
        *key_cache.stride(), *summaries.stride(), stride_cp, stride_ch, block_table.stride(0),
        HEAD_DIM=head_dim, PAGE=PAGE_SIZE, BITS=bits, num_warps=4,
    )
    return summaries


def summarize_filled_slots(key_cache, slot_mapping, summaries, bits=0):
    """Summarize the page of every slot in ``slot_mapping`` that is a page's last (offset 63)."""
    _, _, num_kv_heads, head_dim = key_cache.shape
    if slot_mapping.numel() == 0:
        return summaries
    codes, stride_cp, stride_ch = code_view(summaries, bits)
    launch.on(_summarize_filled_slots_kernel, (slot_mapping.numel(), num_kv_heads))(
        key_cache, summaries, codes, slot_mapping,
        *key_cache.stride(), *summaries.stride(), stride_cp, stride_ch,
        HEAD_DIM=head_dim, PAGE=PAGE_SIZE, BITS=bits, num_warps=4,
    )
    return summaries
