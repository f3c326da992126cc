"""Estimate in CUDA C++ (``KernelOptions(estimate="cuda")``): ``estimate.cu``'s kernel, built
by NVRTC on first use and launched through the CUDA driver API (``build``).

The same step as the Triton kernel (the token's cache write, the filled page's summary, the
exact sink and current pages, mvar on the middle pages; the same grid layout and log-masses),
with an mvar program that keeps all of a warp's summary loads in flight at once and sums each
page over its lanes by shuffles (the .cu file says why). It reads bfloat16 (query, caches,
summaries) at head_dim 64 or 128 and up to 8 query heads per KV head; ``check_inputs`` says
what it cannot take.
"""

import ctypes
import functools

import torch
import triton

from . import build

SOURCE = "estimate.cu"  # in this folder (build.source_path)
THREADS = 128  # the .cu file's THREADS
HEAD_DIMS = (64, 128)
MAX_GROUP = 8
# The grid's tuning (``estimate.cuda_target_programs``: 660 programs, five blocks per SM on
# the H200; ``estimate.cuda_min_blocks_per_sm``: the build told to fit 5 blocks so that all
# of a tile's summary loads issue together; ``estimate.cuda_max_tiles_per_program``) and the
# forms measured and rejected: docs/design/estimate.md.


class Params(ctypes.Structure):
    """``Params`` of estimate.cu, field by field (the kernel's one argument)."""

    _fields_ = ([(name, ctypes.c_void_p) for name in (
        "query", "key_cache", "summaries", "block_table", "seq_lens", "log_masses",
        "new_keys", "new_values", "value_cache", "slot_mapping")]
        + [(name, ctypes.c_int64) for name in (
            "stride_qb", "stride_qh", "stride_kp", "stride_kt", "stride_kh", "stride_sp",
            "stride_sh", "stride_ss", "stride_bt", "stride_lr", "stride_lg", "stride_knb",
            "stride_knh", "stride_vnb", "stride_vnh", "stride_vp", "stride_vt", "stride_vh")]
        + [(name, ctypes.c_int) for name in (
            "num_kv_heads", "max_pages", "group", "dense_below_pages", "mvar_programs",
            "num_slots", "first_program")]
        + [("scale", ctypes.c_float)])


def group_pad(group):
    """The build's group: the query heads per KV head rounded up to a power of two."""
    return triton.next_power_of_2(group)


def tile_pages(head_dim, group):
    """Pages an mvar program reads per pass (the .cu file's MvarShape::TILE)."""
    loads = 4 if group_pad(group) >= 8 else 8
    return 4 * loads * (32 // (head_dim // 4))


def programs_per_row(rows, max_pages, head_dim, group, options):
    """J: mvar programs per row, about ``estimate.cuda_target_programs`` over the batch, at
    most one per tile of the block table and enough that none loops over more than
    ``estimate.cuda_max_tiles_per_program`` (so the grid follows the batch shape, not the rows'
    lengths)."""
    table_tiles = triton.cdiv(max_pages, tile_pages(head_dim, group))
    target = options.value("estimate.cuda_target_programs")
    most_tiles = options.value("estimate.cuda_max_tiles_per_program")
    return max(1, min(table_tiles, max(triton.cdiv(target, max(rows, 1)),
                                       triton.cdiv(table_tiles, most_tiles))))


def build_options(min_blocks):
    """NVRTC's defines for a build told to fit ``min_blocks`` blocks per SM."""
    return (f"-DESTIMATE_MIN_BLOCKS={min_blocks}",)


@functools.lru_cache(maxsize=None)
def kernel(device_index, head_dim, group, min_blocks):
    """The loaded function ``moira_estimate_d<D>_g<G padded>`` on a device, built to fit
    ``min_blocks`` blocks per SM."""
    return build.function(device_index, SOURCE,
                               f"moira_estimate_d{head_dim}_g{group_pad(group)}",
                               "estimate", options=build_options(min_blocks))


def check_inputs(query, key_cache, summaries, block_table, seq_lens, new_kv, log_masses):
    """A ValueError naming what the CUDA Estimate cannot read or write, and the fix."""
    prefix = "KernelOptions(estimate='cuda')"
    if query.device.type != "cuda":
        raise ValueError(f"{prefix} runs on CUDA tensors, got {query.device}: use 'triton' "
                         f"(the interpreter) on the CPU")
    head_dim = query.shape[2]
    group = query.shape[1] // key_cache.shape[2]
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"{prefix} is built for head_dim in {HEAD_DIMS}, got {head_dim}: "
                         f"use 'triton'")
    if group > MAX_GROUP:
        raise ValueError(f"{prefix} takes at most {MAX_GROUP} query heads per KV head, got "
                         f"{group}: use 'triton'")
    new_keys, new_values, value_cache, slot_mapping = new_kv or (None,) * 4
    bf16 = [("query", query), ("key_cache", key_cache), ("summaries", summaries)]
    if new_kv:
        bf16 += [("new_keys", new_keys), ("new_values", new_values),
                 ("value_cache", value_cache)]
        if slot_mapping.dtype != torch.int64:
            raise ValueError(f"{prefix} reads slot_mapping as int64, got {slot_mapping.dtype}: "
                             f"use 'triton'")
        if slot_mapping.shape[0] > new_keys.shape[0]:
            raise ValueError(f"{prefix}: slot_mapping has {slot_mapping.shape[0]} slots for "
                             f"{new_keys.shape[0]} new tokens; pass one slot per token")
    for name, tensor in bf16:
        if tensor.dtype != torch.bfloat16:
            raise ValueError(f"{prefix} reads bfloat16, got {name} {tensor.dtype}: use "
                             f"'triton'")
        if tensor.stride(-1) != 1:
            raise ValueError(f"{prefix} needs {name}'s head dim contiguous (strides "
                             f"{tensor.stride()}): use 'triton'")
    # 16-byte loads of the query, the keys and the summaries
    for name, tensor in bf16[:3]:
        if tensor.data_ptr() % 16 or any(s % 8 for s in tensor.stride()[:-1]):
            raise ValueError(f"{prefix} needs {name} aligned to 16 bytes in every stride "
                             f"(strides {tensor.stride()}): use 'triton'")
    for name, tensor, dtype in (("block_table", block_table, torch.int32),
                                ("seq_lens", seq_lens, torch.int32),
                                ("log_masses", log_masses, torch.float32)):
        if tensor.dtype != dtype or tensor.stride(-1) != 1:
            raise ValueError(f"{prefix} reads {name} as {dtype} with its last dim contiguous, "
                             f"got {tensor.dtype} with strides {tensor.stride()}: use 'triton'")


def params(query, key_cache, summaries, block_table, seq_lens, scale, log_masses,
           dense_below_pages, new_kv, mvar_programs, first_program=0):
    """The kernel's ``Params`` for a call (``estimate``'s arguments, ``mvar_programs`` the J
    of every row; ``first_program`` 2 launches the mvar programs alone)."""
    num_kv_heads = key_cache.shape[2]
    group = query.shape[1] // num_kv_heads
    new_keys, new_values, value_cache, slot_mapping = new_kv or (query, query, key_cache,
                                                                 seq_lens)
    return Params(
        query.data_ptr(), key_cache.data_ptr(), summaries.data_ptr(), block_table.data_ptr(),
        seq_lens.data_ptr(), log_masses.data_ptr(), new_keys.data_ptr(), new_values.data_ptr(),
        value_cache.data_ptr(), slot_mapping.data_ptr(),
        query.stride(0), query.stride(1), *key_cache.stride()[:3], *summaries.stride()[:3],
        block_table.stride(0), log_masses.stride(0), log_masses.stride(1),
        new_keys.stride(0), new_keys.stride(1), new_values.stride(0), new_values.stride(1),
        *value_cache.stride()[:3],
        num_kv_heads, block_table.shape[1], group, dense_below_pages, mvar_programs,
        slot_mapping.shape[0] if new_kv else 0, first_program, scale)


def estimate(query, key_cache, summaries, block_table, seq_lens, scale, log_masses, *,
             options, dense_below_pages=0, new_kv=None, build_only=False, parts="all"):
    """Launch ``estimate.cu``'s kernel on the current stream: ``triton.estimate.estimate``'s
    arguments and outputs, inputs that ``check_inputs`` passed. ``parts`` launches only the
    exact programs ("exact": the sink's, and the current page's with the token's write) or only
    the mvar programs ("mvar"), each leaving the others' log-masses unwritten: a measurement of
    what each part costs (``benchmarks/tune.py --kinds estparts``), not a step."""
    if parts not in ("all", "exact", "mvar"):
        raise ValueError(f"parts must be 'all', 'exact' or 'mvar', got {parts!r}")
    batch, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    rows = batch * num_kv_heads
    function = kernel(build.device_index(query.device), head_dim, group,
                      options.value("estimate.cuda_min_blocks_per_sm"))
    if build_only or rows == 0:
        return log_masses
    per_row = programs_per_row(rows, block_table.shape[1], head_dim, group, options)
    call = params(query, key_cache, summaries, block_table, seq_lens, scale, log_masses,
                  dense_below_pages, new_kv, per_row, 2 if parts == "mvar" else 0)
    programs = {"all": 2 + per_row, "exact": 2, "mvar": per_row}[parts]
    build.launch(function, (rows, programs), THREADS, 0, query.device, call)
    return log_masses
