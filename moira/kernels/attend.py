"""Attend (paper 3.3, Eq. 4, Alg. 2): self-planning split-KV attention over ragged page lists.

Every row (request, KV head) gets the same J programs, fixed at launch from the batch shape
alone. Program (row, j) reads the row's list length n from GPU memory and plans for itself:

    c = max(C, ceil(n / J))      pages per chunk
    m = ceil(n / c)              chunks of this row (at least 1)

and processes pages [j c, min((j + 1) c, n)) or exits if j >= m. (``EVEN_CHUNKS``, off,
makes the m chunks equal instead, c = ceil(n / m): timed slower at 8k x 32.) All G query
heads of the group share each K/V tile (one read of every K/V byte per group). A
single-chunk row writes its output directly; otherwise each chunk writes its normalized
partial output and log-sum-exp for Merge.

With ``step_programs`` T > 0 (``MoiraConfig.step_programs``), C of a row in a step planned
for ``rows`` rows is min(C, max(2, ceil(n * rows / T))): in a step of few rows a short row is
cut finer, so the step still has about T programs (timed on the H200 at batches 1-4,
benchmarks/NOTES.md, sessions 14-15; default 256); steps of T rows or more get Eq. (4)'s
chunk counts.

Bytes: 2 * 64 * D cache elements per listed page, plus q, and the partials of split rows.
"""

import math

import triton
import triton.language as tl

from ..config import PAGE_SIZE
from . import attend_cuda, cuda_build, launch

# tuned on the H200 (benchmarks/NOTES.md, session 4: two pages per tile and two stages are
# 3-6% faster than one page and three stages at 22% of every row, all four shapes)
NUM_WARPS = 4
NUM_STAGES = 2
PAGES_PER_ITER = 2  # listed pages per inner-loop tile ([PAGES_PER_ITER * 64, D]), a power of 2
# a ceiling on registers per thread (Triton's maxnreg; None: ptxas's choice). The default
# build (147 registers, 74 KB of shared memory) fits 3 blocks per SM; one page per tile halves
# the shared memory (39 KB), and then 128 registers fit 4 blocks, 96 five (8 bytes spilled).
# A tuning option (tune_kernels.py --kinds registers). Timed in session 26: one page per tile
# uncapped +6 to +8%, at 128 registers +10 to +22%, at 96 +15% at 8k x 32 and within 2%
# elsewhere, against this default; so ptxas's choice
MAX_REGISTERS = None
# the softmax denominator sums the weights as rounded to the cache dtype for the P @ V product
# (True: the output stays a weighted average, about half the error against float32) or as
# computed in float32 before rounding (False: FA3's convention, so outputs round like FA3's)
SUM_ROUNDED_WEIGHTS = True
# the order and rounding of FA3's main loop (its hdim-128 paged decode also reads 128-token
# tiles): tiles from the last to the first, the running max over raw scores and the scale
# folded into the exponent's fused multiply-add. Exact attention either way; the bf16 weights
# that multiply V are rounded at the same running maxima as FA3's when the split boundaries
# agree, so a row's output should round like FA3's more often (the engine's dense check:
# vllm_checks.py --fa3-arithmetic). False: first to last tile, max in the log2 domain. The
# sm_90 build with it has 255 registers (147 without; the descending loop alone: 152, and a
# plain multiply-subtract instead of tl.fma builds the same 255): a numerics experiment. In
# the engine (session 10) 4.1% of elements were > 1 ulp from FA3 (FA3 at one split: 6.0%;
# the default order 10.6% in session 9, with equal chunks), while greedy tokens parted from
# dense's no later
FA3_TILE_ORDER = False
# a row's chunks of equal length: Eq. (4)'s m = ceil(n / c) chunks, each of ceil(n / m) pages
# instead of c (the last one shorter). As many programs, none longer than Eq. (4)'s, but timed
# on the H200 (session 9, tune_kernels.py --kinds step, 22% of every row) 7% slower at 8k x 32
# (72.2 against 67.4 us) and equal at 32k-131k (within 0.3%): off, Eq. (4) as is
EVEN_CHUNKS = False
# each tile's page ids (list entry -> block table) loaded one tile ahead and carried by the
# loop. Why: Triton's pipeliner gives K and V one shared-memory buffer each when their
# addresses come from loads in the same iteration (the default, at any NUM_STAGES: one tile
# in flight per program, and none while it computes); with the ids carried, NUM_STAGES 3
# gives two buffers (one page per tile: 72 KB, 150 registers, 3 blocks per SM) and 4 three
# (105 KB, 2 blocks per SM), so the next tile loads while this one is computed (sm_90 builds,
# compile_check.py). Both schedules (rows, balanced); FA3_TILE_ORDER's loop, a numerics
# experiment, ignores it. Timed in session 30 (bench_kernels.py's moira_ahead<P><S> arms):
# one page per tile at 3 stages +0 to +1.6% at every shape and spread, 4 stages +1 to +10%
# (2 blocks per SM); ncu: stalls per instruction 13.4 -> 9.9 cycles, DRAM throughput
# unchanged. A program's rate matters only in grids smaller than the GPU (C = 32 at 8k x 32:
# 4 stages 6.5% faster). Off
PAGE_IDS_AHEAD = False
# "auto" (the default), "triton" (this file's kernel) or "cuda" (attend_cuda.cu: the same
# program with CUDA_STAGES pages' K and V in flight by cp.async, each warp copying the tokens it
# computes; built by NVRTC on first use). "auto" runs "cuda" where it can (CUDA tensors on
# sm_80+, bfloat16, head_dim 64 / 128, G <= 16, 16-byte aligned strides, NVRTC found, this
# file's options at their defaults, schedule "rows") and "triton" elsewhere (the CPU's
# interpreter, float16, other head dims, the balanced schedule); "cuda" refuses what it cannot
# run. Why: Triton keeps one K/V tile per program in flight and none while it computes, and
# FlashInfer's pipelined decode kernel is 4-11% faster at equal row lengths. Timed
# (bench_kernels.py's moira_cuda<S> arms): +6 to +30% as first built, +3 to +10% with its
# copies rewritten (session 33); with the tiles swizzled, copies by warp and the next page's
# copy issued before the current page is computed (session 34, 2 stages): -0.0 to -2.1% at
# CV 0, -1.3 to -4.9% on spreads. Session 35 (NVRTC build, two runs on one host): -2.3 to
# +0.6% at CV 0, -1.4 to -4.9% on spreads and real-like lists, flat in spread where Triton is
# not. Session 36, in vLLM (tpot_pairs.sh, Llama-3.1-8B geometry, gamma 0.98): TPOT -1.3 /
# -1.1 / -1.0 / -1.6% at 8k x 32, 16k x 32, 32k x 16, 130k x 4, and vllm_checks.py as close
# to exact as Triton (no element over one bf16 ulp at its head's scale); "auto" since then
IMPLEMENTATION = "auto"
# pages in flight per CUDA program (2-4; shared memory allows 3 / 2 / 1 programs per SM at
# D = 128). Session 34: 2 stages beat 3 on spreads by 2-5% and tied at CV 0 (3 ahead at
# 16k x 32 only, by 2%); 4 was 24-41% slower in session 33
CUDA_STAGES = 2
# Not here: Merge done by each split row's last program in the CUDA kernel (a fence and a
# count per program, the last one merging from the L2 with all its threads, no Merge launch).
# Timed in session 51 (bench_kernels.py's moira_lm): -4.1% at 8k x 32 CV 0 (2 chunks a row),
# +1.0 / +1.6% at 64k x 8 / 131k x 4 CV 0, -0.4 to +1.8% on their spreads (10-19 chunks a
# row: every program waits for its fence and count before it exits). Removed
# Not here (session 55, benchmarks/attend_timeline.py; Attend + Merge on the suite's lists):
# a persistent CUDA Attend, one program per slot taking Eq. (4)'s chunks off an atomic
# counter, at C = 24 / 12 / 8: +0.5 to +8.4% in every cell (the tail shrank at C <= 12, but
# each chunk's ids and first page cost the steady rate and the prefix and counts ~3 us a
# launch); and each stage refilled as soon as its page is computed (two pages in flight while
# a warp waits): -0.5 to +1.8%, a program's tail rate unchanged. Removed
# Not here (session 57, attend_timeline.py): the CUDA program's list entries loaded beside its
# row's count on the guess chunk = C (one L2 round trip off the loads before its first page):
# -0.6 to +1.0 us in Attend + Merge, slower in 7 cells of 12, its programs' prologue (~4.4
# us, the first page's wait in a saturated memory system) unchanged. Removed
# Not here: each page-head's K and V by Hopper's bulk tensor copy (TMA, Triton's tensor
# descriptors) instead of this gather. Timed in session 32 (one page per tile, 2-4 stages,
# with and without the lookahead): +12 to +27% at 22% of the pages at 8k x 32, 32k x 16 and
# 131k x 4, equal at 16k x 32; the copy cannot mask, so V's stale rows were zeroed in
# registers and V staged through shared memory twice (benchmarks/NOTES.md). Removed


@triton.jit
def plan_row(page_counts, b, head, stride_cb, stride_ch, chunk_floor, chunks_per_row,
             step_rows, step_programs, short_pages, EVEN: tl.constexpr):
    """(list length n, pages per chunk c, chunks m) of a row: Eq. (4) with the short-row floor
    (``step_programs`` over ``step_rows``, the planned step's rows; rows of at most
    ``short_pages`` pages, ``short_row_pages``: -1 when off), its chunks made equal with
    ``EVEN`` (``EVEN_CHUNKS``), shared with Merge (``reference.work_split``)."""
    count = tl.load(page_counts + b * stride_cb + head * stride_ch)
    floor = chunk_floor
    if count <= short_pages:  # only where the floor binds: n * rows <= (C - 1) * T, so
        # cdiv's n * rows + T - 1 <= C * T - 1 fits int32 (MoiraConfig: C * T < 2**31)
        floor = tl.maximum(2, tl.cdiv(count * step_rows, step_programs))
    chunk = tl.maximum(floor, tl.cdiv(count, chunks_per_row))
    if EVEN:
        chunk = tl.maximum(tl.cdiv(count, tl.maximum(tl.cdiv(count, chunk), 1)), 1)
    return count, chunk, tl.maximum(tl.cdiv(count, chunk), 1)


def short_row_pages(chunk_floor, step_rows, step_programs):
    """The longest row the short-row floor cuts finer than C: min(C, max(2, ceil(n * rows /
    T))) < C exactly when n * rows <= (C - 1) * T (for C > 2; at C <= 2 it never binds);
    -1 when it is off. Kernels test a row against it before any arithmetic of the floor."""
    if not step_programs or chunk_floor <= 2:
        return -1
    assert chunk_floor * step_programs < 2**31, "the floor is planned in int32: lower T or C"
    return (chunk_floor - 1) * step_programs // step_rows


@triton.jit
def tile_pages(row_pages, row_table, seq_len, i, last, tile_page, offset, max_pages,
               PAGE: tl.constexpr, PAGES_PER_TILE: tl.constexpr):
    """Physical page of every token of the tile of listed pages ``[i, i + PAGES_PER_TILE)``
    (those before ``last``) and whether the token is read: ``(page int64, valid)``."""
    # an entry outside the block table's [0, max_pages) reads nothing (a caller's bad list
    # must not read another request's page)
    if PAGES_PER_TILE == 1:  # one page: its list entry and physical id are scalars
        listed = i < last  # PAGE_IDS_AHEAD looks one tile past a chunk: not past the list
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
    if SUM_ROUNDED:  # the same rounded weights that multiply V (SUM_ROUNDED_WEIGHTS)
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
    Tiles run first to last, or with ``FA3_ORDER`` last to first (``FA3_TILE_ORDER``)."""
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


def implementation(query, key_cache, value_cache):
    """The Attend that runs a call, "triton" or "cuda": ``IMPLEMENTATION`` with "auto" resolved
    (a ValueError for an unknown name, or for "cuda" with an option only Triton has)."""
    triton_only = dict(PAGE_IDS_AHEAD=PAGE_IDS_AHEAD, FA3_TILE_ORDER=FA3_TILE_ORDER,
                       EVEN_CHUNKS=EVEN_CHUNKS, SUM_ROUNDED_WEIGHTS=not SUM_ROUNDED_WEIGHTS)
    if IMPLEMENTATION == "cuda" and any(triton_only.values()):
        raise ValueError(f"attend.IMPLEMENTATION = 'cuda' has none of the Triton kernel's "
                         f"options: set {', '.join(k for k, v in triton_only.items() if v)} "
                         f"back to the default, or use 'triton' or 'auto'")
    head_dim, group = query.shape[2], query.shape[1] // key_cache.shape[2]

    def check():
        if any(triton_only.values()):  # "auto": Triton's kernel has these options
            raise ValueError("an option of the Triton kernel is set")
        attend_cuda.check_inputs(query, key_cache, value_cache, head_dim, group, CUDA_STAGES)

    return cuda_build.resolve("attend.IMPLEMENTATION", IMPLEMENTATION, check, lambda: (
        attend_cuda.usable(cuda_build.device_index(query.device), head_dim, CUDA_STAGES)))


def attend(query, key_cache, value_cache, block_table, seq_lens, page_lists, page_counts, *,
           scale, chunk_floor, chunks_per_row, out, partial_out, partial_lse, step_rows=0,
           step_programs=0, programmatic_launch=False):
    """Launch (batch * KV heads, J) programs. ``partial_out`` ``[>= rows * J * G * D]`` and
    ``partial_lse`` ``[>= rows * J * G]`` are float32 scratch (only split rows write them);
    ``step_rows``: the rows the split is planned for (a captured graph's padded batch)."""
    assert step_rows > 0 or not step_programs, "step_programs needs the planned step_rows"
    batch, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    if implementation(query, key_cache, value_cache) == "cuda":
        return attend_cuda.attend(
            query, key_cache, value_cache, block_table, seq_lens, page_lists, page_counts,
            qk_scale_log2=scale * math.log2(math.e), chunk_floor=chunk_floor,
            chunks_per_row=chunks_per_row, out=out, partial_out=partial_out,
            partial_lse=partial_lse, step_rows=step_rows, step_programs=step_programs,
            short_pages=short_row_pages(chunk_floor, step_rows, step_programs),
            stages=CUDA_STAGES, build_only=launch.building_only())
    launch.on(_attend_kernel, (batch * num_kv_heads, chunks_per_row))(
        query, key_cache, value_cache, block_table, seq_lens, page_lists, page_counts,
        out, partial_out, partial_lse,
        *query.stride(), *key_cache.stride(), *value_cache.stride(),
        block_table.stride(0), *page_lists.stride()[:2], *page_counts.stride(), *out.stride(),
        num_kv_heads, block_table.shape[1], scale * math.log2(math.e), chunk_floor,
        chunks_per_row, step_rows, step_programs,
        short_row_pages(chunk_floor, step_rows, step_programs),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        PAGE=PAGE_SIZE, PAGES_PER_TILE=PAGES_PER_ITER, SUM_ROUNDED=SUM_ROUNDED_WEIGHTS,
        FA3_ORDER=FA3_TILE_ORDER, EVEN_CHUNKS=EVEN_CHUNKS, PAGES_AHEAD=PAGE_IDS_AHEAD,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES, maxnreg=MAX_REGISTERS,
        **launch.options(programmatic_launch, "attend"),
    )
    return out
