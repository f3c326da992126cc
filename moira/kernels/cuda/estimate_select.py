"""Estimate and Select in one launch (``estimate_select.cu``): one 256-thread program per
row computes the row's log-masses into shared memory with the CUDA Estimate's code and then
selects its pages with the CUDA Select's, so a step's first two kernels become one wave
without the log-masses' round trip through global memory. The outputs are the two kernels'
(lists, counts, the token's cache write, the filled page's summary); the log-masses buffer is
not written.

``KernelOptions.fused`` chooses: "auto" (default) launches it for steps of at least
``fused.min_rows`` rows in block tables of at least ``fused.min_table_pages`` pages whose
Estimate runs in CUDA; "off" never; "on" whenever ``applies`` holds. It replaces whichever
Select ``KernelOptions.select`` names. Steps of few rows stream each row's summaries through
one SM, slower than the two kernels' grid; in a table as narrow as the rows the configured
pair (CUDA Estimate, Triton Select) is as fast (docs/design/select.md).
"""

import ctypes
import functools

import triton

from ...benchmarking import timeline as probes
from . import build
from . import estimate as estimate_cuda
from . import select as select_cuda

SOURCE = "estimate_select.cu"  # in this folder (build.source_path)
THREADS = 256  # the .cu file's THREADS: two of the CUDA Estimate's programs
MAX_SHARED = 96 * 1024  # the log-masses' shared memory per program: two programs per SM

class Params(ctypes.Structure):
    """``Params`` of estimate_select.cu: the two kernels' own, and the shared log-masses'
    row width."""

    _fields_ = [("estimate", estimate_cuda.Params), ("select", select_cuda.Params),
                ("masses_stride", ctypes.c_int), ("timeline", ctypes.c_void_p)]


def pages_per_thread(max_pages):
    """Select's P for a block table of ``max_pages`` columns on ``THREADS`` threads."""
    return triton.next_power_of_2(max(1, triton.cdiv(max_pages, THREADS)))


def shared_bytes(max_pages, group):
    """Dynamic shared memory of a program: its row's log-masses, ``[G padded][max_pages]``
    float32."""
    return estimate_cuda.group_pad(group) * max_pages * 4


def applies(rows, max_pages, group, ways, programmatic_launch, options):
    """Whether a step whose Estimate runs in CUDA launches the fused kernel: ``options.fused``
    ("auto": ``fused.min_rows``, ``fused.min_table_pages``), the table's width (Select's
    per-thread limit on ``THREADS`` threads, the log-masses' shared memory) and no
    programmatic launch (the two kernels' option)."""
    mode = options.fused
    widest = select_cuda.max_table_pages(group, ways) * THREADS // select_cuda.MAX_THREADS
    automatic = mode == "auto" and rows >= options.value("fused.min_rows") \
        and max_pages >= options.value("fused.min_table_pages")
    return (mode == "on" or automatic) \
        and not programmatic_launch and max_pages <= widest \
        and shared_bytes(max_pages, group) <= MAX_SHARED


@functools.lru_cache(maxsize=None)
def kernel(device_index, head_dim, group, pages, ways, timeline=False):
    """The loaded function ``moira_estimate_select_d<D>_g<G padded>_p<P>_w<K_B>`` on a device,
    allowed the shared memory of the widest table its ``pages`` per thread take (the
    attribute is the function's, shared by every table width that launches it);
    ``timeline``: the FUSED_TIMELINE build (``moira.benchmarking.timeline``)."""
    group_pad = estimate_cuda.group_pad(group)
    return build.function(
        device_index, SOURCE, f"moira_estimate_select_d{head_dim}_g{group_pad}_p{pages}_w{ways}",
        "estimate", shared_bytes(THREADS * pages, group),
        options=(f"-DFUSED_D={head_dim}", *select_cuda.build_options(pages, ways, group),
                 *(("-DFUSED_TIMELINE=1",) if timeline else ())))


def estimate_select(query, key_cache, summaries, block_table, seq_lens, scale, log_masses,
                    page_lists, page_counts, *, new_kv, dense_below_pages, gamma, top_k, ways,
                    row_values, fractions, row_gammas, build_only=False):
    """Launch the fused kernel on the current stream: ``estimate_cuda.estimate``'s and
    ``select_cuda.select``'s arguments (inputs both kernels' checks passed, ``applies``
    true); ``log_masses`` gives Select's view of the group (its data is neither read nor
    written)."""
    batch, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    max_pages = block_table.shape[1]
    rows = batch * num_kv_heads
    timeline = probes.buffer("estimate_select", rows)
    function = kernel(build.device_index(query.device), head_dim, group,
                      pages_per_thread(max_pages), ways, timeline is not None)
    if build_only or rows == 0:
        return page_lists, page_counts
    call = Params(
        estimate_cuda.params(query, key_cache, summaries, block_table, seq_lens, scale,
                             log_masses, dense_below_pages, new_kv, mvar_programs=2),
        select_cuda.params(log_masses, seq_lens, page_lists, page_counts,
                           num_kv_heads=num_kv_heads, max_pages=max_pages, gamma=gamma,
                           top_k=top_k, row_values=row_values, fractions=fractions,
                           row_gammas=row_gammas, dense_below_pages=dense_below_pages),
        max_pages, timeline.data_ptr() if timeline is not None else None)
    build.launch(function, (rows, 1), THREADS, shared_bytes(max_pages, group), query.device,
                      call)
    return page_lists, page_counts
