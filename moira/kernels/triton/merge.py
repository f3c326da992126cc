"""Merge: log-sum-exp combination of the chunks of every split row.

    lse = log sum_j exp(lse_j)      out = sum_j exp(lse_j - lse) * out_j

One program per (row, query head) re-derives the row's chunk count m from its list length (same
plan as Attend) and exits if m = 1 (Attend already wrote that row). Chunks without keys have
lse = -inf and weigh nothing; a row whose chunks are all empty gets zeros.

Optionally (``page_stats``), program (row, 0) also adds the row's list length and its number of
pages to two int64 counters: "how much did it skip" at the cost of one atomic per row, inside
the same kernel (and CUDA graph) instead of extra reductions per layer.
"""

import triton
import triton.language as tl

from ...config import PAGE_SIZE
from .. import launch
from ..split import short_row_pages
from .attend import plan_row
from .combine import add_page_stats, merged


@triton.jit
def _merge_kernel(page_counts, partial_out, partial_lse, out, seq_lens, page_stats,
                  stride_cb, stride_ch, stride_ob, stride_oh, stride_od,
                  num_kv_heads, max_pages, chunk_floor, chunks_per_row, step_rows,
                  step_programs, short_pages, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                  SPLITS_PAD: tl.constexpr,
                  SPLITS_PER_LOAD: tl.constexpr, HAS_STATS: tl.constexpr, PAGE: tl.constexpr,
                  EVEN_CHUNKS: tl.constexpr, PDL: tl.constexpr):
    launch.after_previous_kernel(PDL)
    row = tl.program_id(0)
    g = tl.program_id(1)
    b = row // num_kv_heads
    head = row % num_kv_heads
    count, _, num_chunks = plan_row(page_counts, b, head, stride_cb, stride_ch,
                                    chunk_floor, chunks_per_row, step_rows, step_programs,
                                    short_pages, EVEN_CHUNKS)
    if HAS_STATS:
        if g == 0:
            add_page_stats(page_stats, seq_lens, b, count, max_pages, PAGE)
    if num_chunks == 1:
        return
    result = merged(partial_out, partial_lse, row.to(tl.int64) * chunks_per_row, num_chunks, g,
                    GROUP, HEAD_DIM, SPLITS_PAD, SPLITS_PER_LOAD)
    dims = tl.arange(0, HEAD_DIM)
    tl.store(out + b.to(tl.int64) * stride_ob + (head * GROUP + g) * stride_oh
             + dims * stride_od, result.to(out.dtype.element_ty))


def merge(page_counts, partial_out, partial_lse, out, *, num_kv_heads, chunk_floor,
          chunks_per_row, step_rows=0, step_programs=0, seq_lens=None, max_pages=0,
          page_stats=None, programmatic_launch=False, even_chunks=False,
          chained=launch.CHAINED):
    """Write ``out`` ``[batch, num_heads, head_dim]`` for every row Attend split; with
    ``page_stats`` (int64 ``[2]``), also add (listed pages, pages of the rows: min(ceil(seq_len
    / page), max_pages)) summed over all rows. ``even_chunks``: Attend's
    ``attend.even_chunks``, so both plan the same chunks; ``chained``: ``"launch.chained"``."""
    assert step_rows > 0 or not step_programs, "step_programs needs the planned step_rows"
    batch, num_heads, head_dim = out.shape
    group = num_heads // num_kv_heads
    has_stats = page_stats is not None
    launch.on(_merge_kernel, (batch * num_kv_heads, group))(
        page_counts, partial_out, partial_lse, out,
        seq_lens if has_stats else page_counts, page_stats if has_stats else page_counts,
        *page_counts.stride(), *out.stride(), num_kv_heads, max_pages, chunk_floor,
        chunks_per_row, step_rows, step_programs,
        short_row_pages(chunk_floor, step_rows, step_programs),
        GROUP=group, HEAD_DIM=head_dim, SPLITS_PAD=triton.next_power_of_2(chunks_per_row),
        SPLITS_PER_LOAD=min(32, triton.next_power_of_2(chunks_per_row)), HAS_STATS=has_stats,
        PAGE=PAGE_SIZE, EVEN_CHUNKS=even_chunks, num_warps=4,
        **launch.options(programmatic_launch, "merge", chained),
    )
    return out
