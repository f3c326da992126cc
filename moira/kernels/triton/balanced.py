"""Attend and Merge with a balanced global split (``MoiraConfig(schedule="balanced")``).

Eq. (4) splits each row on its own: J programs per row, chunks of c pages. When the total work
is a few waves of programs, the last wave runs part-empty (at 22% of a 131k x 4 step: 608
programs of 24 pages on 132 SMs x 3 slots, 1.5 waves). Here the P programs split the
*concatenation* of all rows' lists instead, still planning on the GPU from the counts alone:

    every program loads all rows' counts n_r and their prefix sums (a few KiB)
    W = sum n_r pages;  P' = clamp(ceil(W / C), 1, P) programs work (each >= C pages)
    program p takes global pages [floor(p W / P'), floor((p + 1) W / P'))

A program's range can span several rows; its piece of row r is a segment, written directly to
the output if it is the whole row, else as a partial in slot p + r (along the ordered segments,
p + r grows by exactly one per segment, so the slots of the P' + R possible segments never
collide). Merge finds a row's segments from the same plan: the programs containing its first
and last page, slots [p_first + r, p_last + r]. Every program does at most ceil(W / P') pages,
whatever the spread of row lengths, and P is fixed at launch (CUDA-graph safe).
"""

import math

import triton
import triton.language as tl

from ...config import PAGE_SIZE
from .. import launch
from .attend import attend_segment
from .combine import add_page_stats, merged


@triton.jit
def global_plan(page_counts, stride_cb, stride_ch, num_kv_heads, num_rows, min_pages,
                num_programs, ROWS_PAD: tl.constexpr):
    """(row ids, counts, inclusive prefix sums, total pages W, working programs P')."""
    rows = tl.arange(0, ROWS_PAD)
    counts = tl.load(page_counts + (rows // num_kv_heads) * stride_cb
                     + (rows % num_kv_heads) * stride_ch, mask=rows < num_rows, other=0)
    ends = tl.cumsum(counts, axis=0)
    total = tl.sum(counts, axis=0)
    programs = tl.minimum(tl.maximum(tl.cdiv(total, min_pages), 1), num_programs)
    return rows, counts, ends, total.to(tl.int64), programs.to(tl.int64)


@triton.jit
def program_of(page, total, programs):
    """The program whose range [floor(p W / P'), floor((p + 1) W / P')) holds global page x."""
    return ((page + 1) * programs + total - 1) // total - 1


@triton.jit
def _attend_balanced_kernel(query, key_cache, value_cache, block_table, seq_lens, page_lists,
                            page_counts, out, partial_out, partial_lse,
                            stride_qb, stride_qh, stride_qd,
                            stride_kp, stride_kt, stride_kh, stride_kd,
                            stride_vp, stride_vt, stride_vh, stride_vd,
                            stride_bt, stride_pb, stride_ph, stride_cb, stride_ch,
                            stride_ob, stride_oh, stride_od,
                            num_kv_heads, num_rows, max_pages, qk_scale_log2, min_pages,
                            num_programs,
                            GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                            HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
                            PAGES_PER_TILE: tl.constexpr, ROWS_PAD: tl.constexpr,
                            SUM_ROUNDED: tl.constexpr, FA3_ORDER: tl.constexpr,
                            PAGES_AHEAD: tl.constexpr):
    p = tl.program_id(0).to(tl.int64)
    rows, counts, ends, total, programs = global_plan(
        page_counts, stride_cb, stride_ch, num_kv_heads, num_rows, min_pages, num_programs,
        ROWS_PAD)
    if p >= programs:
        return
    start = p * total // programs
    stop = (p + 1) * total // programs
    groups = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_DIM)
    head_mask = groups[:, None] < GROUP
    row = tl.sum((ends <= start).to(tl.int32), axis=0)  # the row holding global page `start`
    position = start
    while position < stop:
        row_end = tl.sum(tl.where(rows == row, ends, 0), axis=0).to(tl.int64)
        row_start = row_end - tl.sum(tl.where(rows == row, counts, 0), axis=0)
        segment_end = tl.minimum(stop, row_end)
        if segment_end > position:  # rows without pages are skipped (Merge writes their zeros)
            b = row // num_kv_heads
            head = row % num_kv_heads
            heads = head * GROUP + groups
            result, lse = attend_segment(
                query, key_cache, value_cache, block_table, seq_lens, page_lists, b, head,
                (position - row_start).to(tl.int32), (segment_end - row_start).to(tl.int32),
                stride_qb, stride_qh, stride_qd, stride_kp, stride_kt, stride_kh, stride_kd,
                stride_vp, stride_vt, stride_vh, stride_vd, stride_bt, stride_pb, stride_ph,
                max_pages, qk_scale_log2, GROUP, GROUP_PAD, HEAD_DIM, PAGE, PAGES_PER_TILE,
                SUM_ROUNDED, FA3_ORDER, PAGES_AHEAD)
            if (position == row_start) & (segment_end == row_end):  # the whole row
                tl.store(out + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh
                         + dims[None, :] * stride_od, result.to(out.dtype.element_ty),
                         mask=head_mask)
            else:
                slot = (p + row) * GROUP + groups
                tl.store(partial_out + slot[:, None] * HEAD_DIM + dims[None, :], result,
                         mask=head_mask)
                tl.store(partial_lse + slot, lse, mask=groups < GROUP)
        position = segment_end
        row += 1


@triton.jit
def _merge_balanced_kernel(page_counts, partial_out, partial_lse, out, seq_lens, page_stats,
                           stride_cb, stride_ch, stride_ob, stride_oh, stride_od,
                           num_kv_heads, num_rows, max_pages, min_pages, num_programs,
                           GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                           SPLITS_PAD: tl.constexpr, SPLITS_PER_LOAD: tl.constexpr,
                           HAS_STATS: tl.constexpr, PAGE: tl.constexpr,
                           ROWS_PAD: tl.constexpr):
    row = tl.program_id(0)
    g = tl.program_id(1)
    b = row // num_kv_heads
    head = row % num_kv_heads
    rows, counts, ends, total, programs = global_plan(
        page_counts, stride_cb, stride_ch, num_kv_heads, num_rows, min_pages, num_programs,
        ROWS_PAD)
    count = tl.sum(tl.where(rows == row, counts, 0), axis=0)
    row_end = tl.sum(tl.where(rows == row, ends, 0), axis=0).to(tl.int64)
    if HAS_STATS:
        if g == 0:
            add_page_stats(page_stats, seq_lens, b, count, max_pages, PAGE)
    dims = tl.arange(0, HEAD_DIM)
    destination = out + b.to(tl.int64) * stride_ob + (head * GROUP + g) * stride_oh \
        + dims * stride_od
    if count == 0:
        tl.store(destination, tl.zeros([HEAD_DIM], dtype=out.dtype.element_ty))
    else:
        first = program_of(row_end - count, total, programs)
        last = program_of(row_end - 1, total, programs)
        if last > first:  # else Attend wrote the row
            result = merged(partial_out, partial_lse, first + row, last - first + 1, g, GROUP,
                            HEAD_DIM, SPLITS_PAD, SPLITS_PER_LOAD)
            tl.store(destination, result.to(out.dtype.element_ty))


def _rows_pad(num_rows):
    return max(16, triton.next_power_of_2(num_rows))


def attend_balanced(query, key_cache, value_cache, block_table, seq_lens, page_lists,
                    page_counts, *, scale, min_pages, programs, out, partial_out, partial_lse,
                    options):
    """Launch ``programs`` programs over all rows' pages. ``partial_out``
    ``[>= (programs + rows) * G * D]`` and ``partial_lse`` ``[>= (programs + rows) * G]``;
    ``options``: the ``KernelOptions`` whose ``attend.*`` tuning builds the kernel."""
    tuned = options.value
    batch, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    rows = batch * num_kv_heads
    launch.on(_attend_balanced_kernel, (programs,))(
        query, key_cache, value_cache, block_table, seq_lens, page_lists, page_counts,
        out, partial_out, partial_lse,
        *query.stride(), *key_cache.stride(), *value_cache.stride(),
        block_table.stride(0), *page_lists.stride()[:2], *page_counts.stride(), *out.stride(),
        num_kv_heads, rows, block_table.shape[1], scale * math.log2(math.e), min_pages,
        programs,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        PAGE=PAGE_SIZE, PAGES_PER_TILE=tuned("attend.pages_per_iter"), ROWS_PAD=_rows_pad(rows),
        SUM_ROUNDED=tuned("attend.sum_rounded_weights"), FA3_ORDER=tuned("attend.fa3_tile_order"),
        PAGES_AHEAD=tuned("attend.page_ids_ahead"), num_warps=tuned("attend.num_warps"),
        num_stages=tuned("attend.num_stages"),
    )
    return out


def merge_balanced(page_counts, partial_out, partial_lse, out, *, num_kv_heads, min_pages,
                   programs, seq_lens=None, max_pages=0, page_stats=None):
    """Write every row of ``out``: merged split rows, zeros for rows without pages (and, with
    ``page_stats``, add the rows' pages read and present, as ``merge.merge`` does)."""
    batch, num_heads, head_dim = out.shape
    group = num_heads // num_kv_heads
    rows = batch * num_kv_heads
    has_stats = page_stats is not None
    launch.on(_merge_balanced_kernel, (rows, group))(
        page_counts, partial_out, partial_lse, out,
        seq_lens if has_stats else page_counts, page_stats if has_stats else page_counts,
        *page_counts.stride(), *out.stride(), num_kv_heads, rows, max_pages, min_pages,
        programs,
        GROUP=group, HEAD_DIM=head_dim, SPLITS_PAD=triton.next_power_of_2(programs),
        SPLITS_PER_LOAD=min(32, triton.next_power_of_2(programs)), HAS_STATS=has_stats,
        PAGE=PAGE_SIZE, ROWS_PAD=_rows_pad(rows), num_warps=4,
    )
    return out
