"""Attend (paper 3.3, Eq. 4, Alg. 2): self-planning split-KV attention over ragged page lists.

Every row (request, KV head) gets the same J programs, fixed at launch from the batch shape
alone. Program (row, j) reads the row's list length n from GPU memory and plans for itself:

    c = max(C, ceil(n / J))      pages per chunk
    m = ceil(n / c)              chunks of this row (at least 1)

and processes pages [j c, min((j + 1) c, n)) or exits if j >= m. (``attend.even_chunks``,
off, makes the m chunks equal instead, c = ceil(n / m): timed slower at 8k x 32.) All G query
heads of the group share each K/V tile (one read of every K/V byte per group). A
single-chunk row writes its output directly; otherwise each chunk writes its normalized
partial output and log-sum-exp for Merge.

With ``step_programs`` T > 0 (``MoiraConfig.step_programs``), C of a row in a step planned
for ``rows`` rows is min(C, max(2, ceil(n * rows / T))): in a step of few rows a short row is
cut finer, so the step still has about T programs (timed on the H200 at batches 1-4,
docs/design/work-split.md; default 256); steps of T rows or more get Eq. (4)'s chunk
counts.

Bytes: 2 * 64 * D cache elements per listed page, plus q, and the partials of split rows.
"""

import math

import triton
import triton.language as tl

from ...config import PAGE_SIZE
from .. import launch
from ..split import short_row_pages


@triton.jit
def plan_row(page_counts, b, head, stride_cb, stride_ch, chunk_floor, chunks_per_row,
             step_rows, step_programs, short_pages, EVEN: tl.constexpr):
    """(list length n, pages per chunk c, chunks m) of a row: Eq. (4) with the short-row floor
    (``step_programs`` over ``step_rows``, the planned step's rows; rows of at most
    ``short_pages`` pages, ``short_row_pages``: -1 when off), its chunks made equal with
    ``EVEN`` (tuning ``attend.even_chunks``), shared with Merge (``reference.work_split``)."""
    count = tl.load(page_counts + b * stride_cb + head * stride_ch)
    floor = chunk_floor
    if count <= short_pages:  # only where the floor binds: n * rows <= (C - 1) * T, so
        # cdiv's n * rows + T - 1 <= C * T - 1 fits int32 (MoiraConfig: C * T < 2**31)
        floor = tl.maximum(2, tl.cdiv(count * step_rows, step_programs))
    chunk = tl.maximum(floor, tl.cdiv(count, chunks_per_row))
    if EVEN:
        chunk = tl.maximum(tl.cdiv(count, tl.maximum(tl.cdiv(count, chunk), 1)), 1)
    return count, chunk, tl.maximum(tl.cdiv(count, chunk), 1)


@triton.jit
def tile_pages(row_pages, row_table, seq_len, i, last, tile_page, offset, max_pages,
               PAGE: tl.constexpr, PAGES_PER_TILE: tl.constexpr):
    """Physical page of every token of the tile of listed pages ``[i, i + PAGES_PER_TILE)``
    (those before ``last``) and whether the token is read: ``(page int64, valid)``."""
    # an entry outside the block table's [0, max_pages) reads nothing (a caller's bad list
    # must not read another request's page)
    if PAGES_PER_TILE == 1:  # one page: its list entry and physical id are scalars
        listed = i < last  # attend.page_ids_ahead looks a tile past a chunk: not past the list
        logical = tl.load(row_pages + i, mask=listed, other=-1)
        in_table = (logical >= 0) & (logical < max_pages)
        valid = in_table & (logical * PAGE + offset < seq_len)  # and the current page's tail
        page = tl.load(row_table + logical, mask=in_table, other=0).to(tl.int64)
    else:  # several pages: one list entry per token
        slot = i + tile_page
        listed = slot < last
        logical = tl.load(row_pages + slot, mask=listed, other=0)
        in_table = listed & (logical >= 0) & (logical < max_pages)
        valid = in_table & (logical * PAGE + offset < seq_len)
        page = tl.load(row_table + logical, mask=in_table, other=0).to(tl.int64)
    return page, valid


@triton.jit
def attend_tile(q, key_cache, value_cache, page, valid, head,
                running_max, running_sum, acc, offset, dims,
                stride_kp, stride_kt, stride_kh, stride_kd,
                stride_vp, stride_vt, stride_vh, stride_vd, qk_scale_log2,
                SUM_ROUNDED: tl.constexpr, FA3_ORDER: tl.constexpr):
    """One tile of tokens (physical ``page`` and ``valid`` per token, ``tile_pages``) folded
    into the online softmax: ``(running_max, running_sum, acc)``. The running max is in the
    log2 domain, or with ``FA3_ORDER`` in raw scores, the scale folded into the exponent."""
    key_rows = page * stride_kp + offset * stride_kt
    value_rows = page * stride_vp + offset * stride_vt
    keys = tl.load(key_cache + head * stride_kh + key_rows[:, None]
                   + dims[None, :] * stride_kd, mask=valid[:, None], other=0.0)
    values = tl.load(value_cache + head * stride_vh + value_rows[:, None]
                     + dims[None, :] * stride_vd, mask=valid[:, None], other=0.0)
    if FA3_ORDER:  # FA3's rounding: exp2(s * scale - max(s) * scale), one fused multiply-add
        logits = tl.where(valid[None, :], tl.dot(q, tl.trans(keys)), float("-inf"))
        new_max = tl.maximum(running_max, tl.max(logits, axis=1))
        finite_max = tl.where(new_max == float("-inf"), 0.0, new_max)  # fully masked so far
        rescale = tl.exp2((running_max - finite_max) * qk_scale_log2)  # 0 before any key
        weights = tl.exp2(tl.fma(logits, qk_scale_log2, -(finite_max * qk_scale_log2)[:, None]))
    else:
        logits = tl.dot(q, tl.trans(keys)) * qk_scale_log2
        logits = tl.where(valid[None, :], logits, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(logits, axis=1))
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # fully masked so far
        rescale = tl.exp2(running_max - shift)
        weights = tl.exp2(logits - shift[:, None])
    probs = weights.to(values.dtype)
    if SUM_ROUNDED:  # the same rounded weights that multiply V (attend.sum_rounded_weights)
        running_sum = running_sum * rescale + tl.sum(probs.to(tl.float32), axis=1)
    else:
        running_sum = running_sum * rescale + tl.sum(weights, axis=1)
    acc = acc * rescale[:, None] + tl.dot(probs, values)
    return new_max, running_sum, acc


@triton.jit
def attend_segment(query, key_cache, value_cache, block_table, seq_lens, page_lists, b, head,
                   first, last,
                   stride_qb, stride_qh, stride_qd,
                   stride_kp, stride_kt, stride_kh, stride_kd,
                   stride_vp, stride_vt, stride_vh, stride_vd,
                   stride_bt, stride_pb, stride_ph, max_pages, qk_scale_log2,
                   GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                   PAGE: tl.constexpr, PAGES_PER_TILE: tl.constexpr,
                   SUM_ROUNDED: tl.constexpr, FA3_ORDER: tl.constexpr,
                   PAGES_AHEAD: tl.constexpr = False):
    """Attention of the G query heads of row (b, head) over its listed pages ``[first, last)``:
    ``(output [GROUP_PAD, D] float32, lse [GROUP_PAD])``; zeros and lse = -inf without keys.
    Tiles run first to last, or with ``FA3_ORDER`` last to first (``attend.fa3_tile_order``)."""
    groups = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(query + b.to(tl.int64) * stride_qb + (head * GROUP + groups)[:, None] * stride_qh
                + dims[None, :] * stride_qd, mask=groups[:, None] < GROUP, other=0.0)
    seq_len = tl.load(seq_lens + b)
    row_pages = page_lists + b.to(tl.int64) * stride_pb + head * stride_ph
    row_table = block_table + b.to(tl.int64) * stride_bt
    tokens = tl.arange(0, PAGE * PAGES_PER_TILE)
    tile_page = tokens // PAGE  # which of the tile's pages a token belongs to
    offset = tokens % PAGE

    running_max = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
    if FA3_ORDER:
        last_tile = first + (tl.cdiv(last - first, PAGES_PER_TILE) - 1) * PAGES_PER_TILE
        for t in range(0, tl.cdiv(last - first, PAGES_PER_TILE)):
            page, valid = tile_pages(row_pages, row_table, seq_len, last_tile - t * PAGES_PER_TILE,
                                     last, tile_page, offset, max_pages, PAGE, PAGES_PER_TILE)
            running_max, running_sum, acc = attend_tile(
                q, key_cache, value_cache, page, valid, head, running_max, running_sum, acc,
                offset, dims, stride_kp, stride_kt, stride_kh, stride_kd,
                stride_vp, stride_vt, stride_vh, stride_vd, qk_scale_log2, SUM_ROUNDED, FA3_ORDER)
        running_max = running_max * qk_scale_log2  # to the log2 domain, as below
    elif PAGES_AHEAD:  # the next tile's page ids loaded a tile ahead, carried by the loop
        page, valid = tile_pages(row_pages, row_table, seq_len, first, last, tile_page, offset,
                                 max_pages, PAGE, PAGES_PER_TILE)
        for i in range(first, last, PAGES_PER_TILE):
            next_page, next_valid = tile_pages(row_pages, row_table, seq_len, i + PAGES_PER_TILE,
                                               last, tile_page, offset, max_pages, PAGE,
                                               PAGES_PER_TILE)
            running_max, running_sum, acc = attend_tile(
                q, key_cache, value_cache, page, valid, head, running_max, running_sum, acc,
                offset, dims, stride_kp, stride_kt, stride_kh, stride_kd,
                stride_vp, stride_vt, stride_vh, stride_vd, qk_scale_log2, SUM_ROUNDED, FA3_ORDER)
            page = next_page
            valid = next_valid
    else:
        for i in range(first, last, PAGES_PER_TILE):
            page, valid = tile_pages(row_pages, row_table, seq_len, i, last, tile_page, offset,
                                     max_pages, PAGE, PAGES_PER_TILE)
            running_max, running_sum, acc = attend_tile(
                q, key_cache, value_cache, page, valid, head, running_max, running_sum, acc,
                offset, dims, stride_kp, stride_kt, stride_kh, stride_kd,
                stride_vp, stride_vt, stride_vh, stride_vd, qk_scale_log2, SUM_ROUNDED, FA3_ORDER)

    empty = running_sum == 0.0
    running_sum = tl.where(empty, 1.0, running_sum)
    lse = tl.where(empty, float("-inf"),
                   (running_max + tl.log2(running_sum)) * 0.6931471805599453)
    return acc / running_sum[:, None], lse


@triton.jit
def _attend_kernel(query, key_cache, value_cache, block_table, seq_lens, page_lists, page_counts,
                   out, partial_out, partial_lse,
                   stride_qb, stride_qh, stride_qd,
                   stride_kp, stride_kt, stride_kh, stride_kd,
                   stride_vp, stride_vt, stride_vh, stride_vd,
                   stride_bt, stride_pb, stride_ph, stride_cb, stride_ch,
                   stride_ob, stride_oh, stride_od,
                   num_kv_heads, max_pages, qk_scale_log2, chunk_floor, chunks_per_row,
                   step_rows, step_programs, short_pages,
                   GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                   PAGE: tl.constexpr, PAGES_PER_TILE: tl.constexpr, SUM_ROUNDED: tl.constexpr,
                   FA3_ORDER: tl.constexpr, EVEN_CHUNKS: tl.constexpr, PDL: tl.constexpr,
                   PAGES_AHEAD: tl.constexpr = False):
    launch.after_previous_kernel(PDL)
    row = tl.program_id(0)
    chunk_id = tl.program_id(1)
    b = row // num_kv_heads
    head = row % num_kv_heads
    count, chunk, num_chunks = plan_row(page_counts, b, head, stride_cb, stride_ch,
                                        chunk_floor, chunks_per_row, step_rows,
                                        step_programs, short_pages, EVEN_CHUNKS)
    if chunk_id >= num_chunks:
        return

    start = chunk_id * chunk
    result, lse = attend_segment(
        query, key_cache, value_cache, block_table, seq_lens, page_lists, b, head, start,
        tl.minimum(start + chunk, count), stride_qb, stride_qh, stride_qd,
        stride_kp, stride_kt, stride_kh, stride_kd, stride_vp, stride_vt, stride_vh, stride_vd,
        stride_bt, stride_pb, stride_ph, max_pages, qk_scale_log2,
        GROUP, GROUP_PAD, HEAD_DIM, PAGE, PAGES_PER_TILE, SUM_ROUNDED, FA3_ORDER, PAGES_AHEAD)
    groups = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_DIM)
    heads = head * GROUP + groups
    head_mask = groups[:, None] < GROUP
    if num_chunks == 1:
        tl.store(out + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh
                 + dims[None, :] * stride_od, result.to(out.dtype.element_ty), mask=head_mask)
    else:
        slot = (row.to(tl.int64) * chunks_per_row + chunk_id) * GROUP + groups
        tl.store(partial_out + slot[:, None] * HEAD_DIM + dims[None, :], result, mask=head_mask)
        tl.store(partial_lse + slot, lse, mask=groups < GROUP)


def attend(query, key_cache, value_cache, block_table, seq_lens, page_lists, page_counts, *,
           scale, chunk_floor, chunks_per_row, out, partial_out, partial_lse, options,
           step_rows=0, step_programs=0, programmatic_launch=False):
    """Launch (batch * KV heads, J) programs. ``partial_out`` ``[>= rows * J * G * D]`` and
    ``partial_lse`` ``[>= rows * J * G]`` are float32 scratch (only split rows write them);
    ``step_rows``: the rows the split is planned for (a captured graph's padded batch);
    ``options``: the ``KernelOptions`` whose ``attend.*`` tuning builds the kernel."""
    assert step_rows > 0 or not step_programs, "step_programs needs the planned step_rows"
    batch, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    tuned = options.value
    launch.on(_attend_kernel, (batch * num_kv_heads, chunks_per_row))(
        query, key_cache, value_cache, block_table, seq_lens, page_lists, page_counts,
        out, partial_out, partial_lse,
        *query.stride(), *key_cache.stride(), *value_cache.stride(),
        block_table.stride(0), *page_lists.stride()[:2], *page_counts.stride(), *out.stride(),
        num_kv_heads, block_table.shape[1], scale * math.log2(math.e), chunk_floor,
        chunks_per_row, step_rows, step_programs,
        short_row_pages(chunk_floor, step_rows, step_programs),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        PAGE=PAGE_SIZE, PAGES_PER_TILE=tuned("attend.pages_per_iter"),
        SUM_ROUNDED=tuned("attend.sum_rounded_weights"),
        FA3_ORDER=tuned("attend.fa3_tile_order"), EVEN_CHUNKS=tuned("attend.even_chunks"),
        PAGES_AHEAD=tuned("attend.page_ids_ahead"), num_warps=tuned("attend.num_warps"),
        num_stages=tuned("attend.num_stages"), maxnreg=tuned("attend.max_registers"),
        **launch.options(programmatic_launch, "attend",
                         options.value("launch.chained")),
    )
    return out
