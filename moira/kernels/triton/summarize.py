"""Page summaries: per-channel mean and population variance of a page's 64 keys.

Two launchers over one device function: ``summarize_pages`` for every full page a block table
references (after prefill), and ``summarize_filled_slots`` for the pages whose last slot a step
has just written (prefill chunks; graph-safe, its grid is the slot count). A decode step needs
neither: Estimate calls ``summarize_page`` for the page the step's token filled.

Bytes: each summarized page reads 64 keys (64 * D elements) and writes 2 * D values.
"""

import triton
import triton.language as tl

from ...config import PAGE_SIZE
from .. import launch


@triton.jit
def summarize_page(key_cache, summaries, page, head,
                    stride_kp, stride_kt, stride_kh, stride_kd,
                    stride_sp, stride_sh, stride_ss, stride_sd,
                    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr):
    tokens = tl.arange(0, PAGE)
    dims = tl.arange(0, HEAD_DIM)
    page = page.to(tl.int64)  # page * stride can pass 2**31 in a large cache
    keys = tl.load(key_cache + page * stride_kp + head * stride_kh
                   + tokens[:, None] * stride_kt + dims[None, :] * stride_kd).to(tl.float32)
    mean = tl.sum(keys, axis=0) / PAGE
    centered = keys - mean[None, :]  # two passes on chip: no cancellation in E[k^2] - E[k]^2
    var = tl.sum(centered * centered, axis=0) / PAGE
    dst = summaries + page * stride_sp + head * stride_sh + dims * stride_sd
    tl.store(dst, mean.to(summaries.dtype.element_ty))
    tl.store(dst + stride_ss, var.to(summaries.dtype.element_ty))


@triton.jit
def _summarize_pages_kernel(key_cache, summaries, block_table, seq_lens,
                            stride_kp, stride_kt, stride_kh, stride_kd,
                            stride_sp, stride_sh, stride_ss, stride_sd,
                            stride_bt,
                            HEAD_DIM: tl.constexpr, PAGE: tl.constexpr):
    logical = tl.program_id(0)
    b = tl.program_id(1)
    head = tl.program_id(2)
    if logical >= tl.load(seq_lens + b) // PAGE:  # partial or absent page: untouched
        return
    page = tl.load(block_table + b.to(tl.int64) * stride_bt + logical)
    summarize_page(key_cache, summaries, page, head,
                    stride_kp, stride_kt, stride_kh, stride_kd,
                    stride_sp, stride_sh, stride_ss, stride_sd, HEAD_DIM, PAGE)


@triton.jit
def _summarize_filled_slots_kernel(key_cache, summaries, slot_mapping,
                                   stride_kp, stride_kt, stride_kh, stride_kd,
                                   stride_sp, stride_sh, stride_ss, stride_sd,
                                   HEAD_DIM: tl.constexpr, PAGE: tl.constexpr):
    slot = tl.load(slot_mapping + tl.program_id(0)).to(tl.int64)
    head = tl.program_id(1)
    if (slot < 0) | (slot % PAGE != PAGE - 1):  # padding, or the page is not full yet
        return
    summarize_page(key_cache, summaries, slot // PAGE, head,
                    stride_kp, stride_kt, stride_kh, stride_kd,
                    stride_sp, stride_sh, stride_ss, stride_sd, HEAD_DIM, PAGE)


def summarize_pages(key_cache, block_table, seq_lens, summaries):
    """Summarize every full page of every row (grid: pages x batch x KV heads)."""
    _, _, num_kv_heads, head_dim = key_cache.shape
    batch, max_pages = block_table.shape
    if batch == 0 or max_pages == 0:
        return summaries
    launch.on(_summarize_pages_kernel, (max_pages, batch, num_kv_heads))(
        key_cache, summaries, block_table, seq_lens,
        *key_cache.stride(), *summaries.stride(), block_table.stride(0),
        HEAD_DIM=head_dim, PAGE=PAGE_SIZE, num_warps=4,
    )
    return summaries


def summarize_filled_slots(key_cache, slot_mapping, summaries):
    """Summarize the page of every slot in ``slot_mapping`` that is a page's last (offset 63)."""
    _, _, num_kv_heads, head_dim = key_cache.shape
    if slot_mapping.numel() == 0:
        return summaries
    launch.on(_summarize_filled_slots_kernel, (slot_mapping.numel(), num_kv_heads))(
        key_cache, summaries, slot_mapping,
        *key_cache.stride(), *summaries.stride(),
        HEAD_DIM=head_dim, PAGE=PAGE_SIZE, num_warps=4,
    )
    return summaries
