"""Attend in CUDA C++ (``KernelOptions(attend="cuda")``): ``attend.cu``'s kernel, built by
NVRTC on first use and launched through the CUDA driver API (``build``).

The kernel is Attend's Triton kernel with a deeper K/V pipeline (the .cu file says why); the
same plan, partials and outputs, so Merge and the rest of the step are unchanged. It runs by
default where it can (``KernelOptions(attend="auto")``: ``check_inputs``, ``usable``); it
covers the default Attend only (tunings ``attend.page_ids_ahead``, ``attend.fa3_tile_order``,
``attend.even_chunks``, float32 weight sums and the balanced schedule are the Triton kernel's).
"""

import ctypes
import functools

import torch

from ...benchmarking import timeline as probes
from ...config import PAGE_SIZE
from . import build

SOURCE = "attend.cu"  # in this folder (build.source_path)
# the .cu file's THREADS and STAGED_IDS (its PAGE is config.PAGE_SIZE)
THREADS = 128
STAGED_IDS = 256
HEAD_DIMS = (64, 128)
MAX_GROUP = 16  # query heads per KV head: the 16 rows of mma.m16n8k16

class Params(ctypes.Structure):
    """``Params`` of attend.cu, field by field (the kernel's one argument)."""

    _fields_ = ([(name, ctypes.c_void_p) for name in (
        "query", "key_cache", "value_cache", "block_table", "seq_lens", "page_lists",
        "page_counts", "out", "partial_out", "partial_lse")]
        + [(name, ctypes.c_int64) for name in (
            "stride_qb", "stride_qh", "stride_kp", "stride_kt", "stride_kh", "stride_vp",
            "stride_vt", "stride_vh", "stride_bt", "stride_pb", "stride_ph", "stride_cb",
            "stride_ch", "stride_ob", "stride_oh", "stride_od")]
        + [(name, ctypes.c_int) for name in (
            "num_kv_heads", "max_pages", "group", "chunk_floor", "chunks_per_row", "step_rows",
            "step_programs", "short_pages")]
        + [("qk_scale_log2", ctypes.c_float), ("timeline", ctypes.c_void_p)])


def shared_bytes(head_dim, stages):
    """Dynamic shared memory of a program: the stages' K and V pages and the staged page ids
    (int64) and token counts (int32); the end's merge reuses it."""
    return stages * 2 * PAGE_SIZE * head_dim * 2 + STAGED_IDS * (8 + 4)


@functools.lru_cache(maxsize=None)
def kernel(device_index, head_dim, stages, timeline=False):
    """The loaded function ``moira_attend_d<D>_s<S>`` on a device (its module loaded once);
    ``timeline``: the ATTEND_TIMELINE build (``moira.benchmarking.timeline``)."""
    limit = torch.cuda.get_device_properties(device_index).shared_memory_per_block_optin
    if shared_bytes(head_dim, stages) > limit:
        raise ValueError(f"tuning 'attend.cuda_stages' = {stages} needs "
                         f"{shared_bytes(head_dim, stages)} bytes of shared memory per "
                         f"program at head_dim {head_dim}; this GPU allows {limit}: "
                         f"lower 'attend.cuda_stages'")
    return build.function(device_index, SOURCE, f"moira_attend_d{head_dim}_s{stages}",
                               "attend", shared_bytes(head_dim, stages),
                               options=("-DATTEND_TIMELINE=1",) if timeline else ())


def check_inputs(query, key_cache, value_cache, head_dim, group, stages):
    """A ValueError naming what the CUDA Attend cannot read, and the fix."""
    if query.device.type != "cuda":
        raise ValueError(f"KernelOptions(attend='cuda') runs on CUDA tensors, got "
                         f"{query.device}: use 'triton' (the interpreter) on the CPU")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"KernelOptions(attend='cuda') is built for head_dim in "
                         f"{HEAD_DIMS}, got {head_dim}: use 'triton'")
    if group > MAX_GROUP:
        raise ValueError(f"KernelOptions(attend='cuda') takes at most {MAX_GROUP} query "
                         f"heads per KV head, got {group}: use 'triton'")
    if stages not in (2, 3, 4):
        raise ValueError(f"tuning 'attend.cuda_stages' must be 2, 3 or 4, got {stages}")
    for name, tensor in (("query", query), ("key_cache", key_cache),
                         ("value_cache", value_cache)):
        if tensor.dtype != torch.bfloat16:
            raise ValueError(f"KernelOptions(attend='cuda') reads bfloat16, got {name} "
                             f"{tensor.dtype}: use 'triton'")
        if tensor.stride(-1) != 1:
            raise ValueError(f"KernelOptions(attend='cuda') needs {name}'s head dim "
                             f"contiguous (stride {tensor.stride()}): use 'triton'")
    # 16-byte copies of the caches, 4-byte loads of the query
    for name, tensor, unit in (("key_cache", key_cache, 8), ("value_cache", value_cache, 8),
                               ("query", query, 2)):
        if tensor.data_ptr() % (2 * unit) or any(s % unit for s in tensor.stride()[:-1]):
            raise ValueError(f"KernelOptions(attend='cuda') needs {name} aligned to "
                             f"{2 * unit} bytes in every stride (strides {tensor.stride()}): "
                             f"use 'triton'")


@functools.lru_cache(maxsize=None)
def usable(index, head_dim, stages):
    """Whether device ``index`` can build and run this kernel at ``head_dim`` and ``stages``
    (``KernelOptions(attend="auto")``): sm_80+, the stages' shared memory, libnvrtc."""
    properties = torch.cuda.get_device_properties(index)
    return shared_bytes(head_dim, stages) <= properties.shared_memory_per_block_optin \
        and build.can_run(index, "Attend")


def attend(query, key_cache, value_cache, block_table, seq_lens, page_lists, page_counts, *,
           qk_scale_log2, chunk_floor, chunks_per_row, out, partial_out, partial_lse,
           step_rows, step_programs, short_pages, stages, build_only=False):
    """Launch ``attend.cu``'s kernel on the current stream: the arguments of
    ``triton.attend.attend`` (the scale already in log2 units, the short-row bound computed), inputs
    that ``check_inputs`` passed."""
    batch, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    timeline = probes.buffer("attend", batch * num_kv_heads * chunks_per_row)
    function = kernel(build.device_index(query.device), head_dim, stages,
                      timeline is not None)
    if build_only:
        return out
    params = Params(
        query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), block_table.data_ptr(),
        seq_lens.data_ptr(), page_lists.data_ptr(), page_counts.data_ptr(), out.data_ptr(),
        partial_out.data_ptr(), partial_lse.data_ptr(),
        query.stride(0), query.stride(1), key_cache.stride(0), key_cache.stride(1),
        key_cache.stride(2), value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_table.stride(0), page_lists.stride(0), page_lists.stride(1),
        page_counts.stride(0), page_counts.stride(1), *out.stride(),
        num_kv_heads, block_table.shape[1], group, chunk_floor, chunks_per_row, step_rows,
        step_programs, short_pages, qk_scale_log2,
        timeline.data_ptr() if timeline is not None else None)
    build.launch(function, (batch * num_kv_heads, chunks_per_row), THREADS,
                      shared_bytes(head_dim, stages), query.device, params)
    return out
