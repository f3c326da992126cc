"""Estimate in CUDA C++ (``estimate.IMPLEMENTATION = "cuda"``): ``estimate_cuda.cu``'s kernel,
built by NVRTC on first use and launched through the CUDA driver API (``cuda_build``).

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

from . import cuda_build

SOURCE = "estimate_cuda.cu"  # in this folder (cuda_build.source_path)
THREADS = 128  # the .cu file's THREADS
HEAD_DIMS = (64, 128)
MAX_GROUP = 8
# mvar programs to launch over the whole batch (the J of each row: about this many over the
# rows, at most one per tile of the table). Each program keeps 4 warps x 8 pages' summaries in
# flight and loops over its share of the row's tiles, so fewer programs than the Triton
# kernel's 2,048 suffice: five blocks fit an SM (MIN_BLOCKS_PER_SM), 660 on the H200. Timed at
# 330 / 660 / 1,320 / 2,640 (session 37): 660 is best or within 0.5 us of it at every shape
TARGET_PROGRAMS = 660
# blocks per SM the build is told to fit (`__launch_bounds__`' second argument; 0: ptxas'
# own choice, 86 registers at G = 4, D = 128, five blocks per SM). ptxas' choice issues 6
# of a tile's 8 summary loads together and the 8th after the next tile's block-table
# entries, an exposed load per tile (its SASS, session 37); told to fit 5 it takes 94
# registers and issues all 8 within the tile's first 181 instructions (the build takes 4 at
# G = 8, where 5 spill). Timed in session 38 (tune_kernels.py --kinds cuda): 5 the fastest
# at every shape but 8k x 32 (15.1 against 14.9 us with 4), 13.7 against 15.2 us with 0 at
# 128k x 4
MIN_BLOCKS_PER_SM = 5
# however many rows the batch has, a row as long as the table is split so that no program
# loops over more tiles than this (the Triton kernel's MAX_TILES_PER_PROGRAM)
MAX_TILES_PER_PROGRAM = 8
# Not here: a row's sink and current page in one exact program (warps 0-1 the sink, 2-3 the
# current page, a thread a token, both pages' keys copied into shared memory by cp.async),
# grid (rows, 1 + J). Timed in session 52 (results/tune-2026-12-03-s52-foldexact.json): in
# the rows' own tables +0.1 / +0.3 / +0.7 / +1.0 us at 8k x 32 / 16k x 32 / 64k x 8 / 128k x 4,
# with the step's token written +0.4 to +1.0; faster only in a 2,048-page table at 8k-16k x 32
# (-1.2 / -0.6). Not profiled; the likely costs: the one program's longer chain, and its
# 36 KB of static shared memory, which every program of the grid reserves (+1.0 us at
# 128k x 4, where it saves 32 programs of 736). Removed
# Not here: the mvar programs on tensor cores (8 pages x the group's heads per mma.m16n8k16,
# each coefficient split into two bf16 for ~16 bits; ~4 warp instructions per page instead of
# ~80). Timed in session 53 (results/tune-2026-12-03-s53-mvarmma-*.json; log-masses within
# 1.9e-6 of this form): with the coefficients in registers the whole kernel was +0.9 / +2.5 /
# +1.8 / +2.6 / +1.2 us at 8k x 32 / 16k x 32 / 32k x 16 / 64k x 8 / 128k x 4; in shared memory
# with the next tile loaded ahead, +0.4 to +4.0. Instructions do not bound the mvar programs:
# alone they read 33.5 MB in 13.7-14.7 us from 32k x 16 on whatever their arithmetic. Removed
# Not here: this kernel chained by programmatic dependent launch (cuLaunchKernelEx; the block
# table, row lengths and sink's keys loaded and the program's summaries prefetched into the L2
# before griddepcontrol.wait). Timed in session 54 after a query copy, in a CUDA graph
# (results/tune-2026-12-03-s54-estpdl.json): +1.3 / +2.5 / +2.6 / +2.4 / +3.5 us at 8k x 32 /
# 16k x 32 / 32k x 16 / 64k x 8 / 128k x 4. Not profiled; likely: the kernel ahead (vLLM's
# rotary, or the copy) never triggers its dependents early, so little could overlap, while
# the prefetches cost every program instructions. Removed


class Params(ctypes.Structure):
    """``Params`` of estimate_cuda.cu, field by field (the kernel's one argument)."""

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


def programs_per_row(rows, max_pages, head_dim, group):
    """J: mvar programs per row, about ``TARGET_PROGRAMS`` over the batch, at most one per tile
    of the block table and enough that none loops over more than ``MAX_TILES_PER_PROGRAM``
    (so the grid follows the batch shape, not the rows' lengths)."""
    table_tiles = triton.cdiv(max_pages, tile_pages(head_dim, group))
    return max(1, min(table_tiles, max(triton.cdiv(TARGET_PROGRAMS, max(rows, 1)),
                                       triton.cdiv(table_tiles, MAX_TILES_PER_PROGRAM))))


def build_options(min_blocks):
    """NVRTC's defines for a build told to fit ``min_blocks`` blocks per SM."""
    return (f"-DESTIMATE_MIN_BLOCKS={min_blocks}",)


@functools.lru_cache(maxsize=None)
def kernel(device_index, head_dim, group, min_blocks):
    """The loaded function ``moira_estimate_d<D>_g<G padded>`` on a device, built to fit
    ``min_blocks`` blocks per SM."""
    return cuda_build.function(device_index, SOURCE,
                               f"moira_estimate_d{head_dim}_g{group_pad(group)}",
                               "estimate.IMPLEMENTATION", options=build_options(min_blocks))


def check_inputs(query, key_cache, summaries, block_table, seq_lens, new_kv, log_masses):
    """A ValueError naming what the CUDA Estimate cannot read or write, and the fix."""
    prefix = "estimate.IMPLEMENTATION = 'cuda'"
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


def estimate(query, key_cache, summaries, block_table, seq_lens, scale, log_masses,
             dense_below_pages=0, new_kv=None, build_only=False, parts="all"):
    """Launch ``estimate_cuda.cu``'s kernel on the current stream: ``estimate.estimate``'s
    arguments and outputs, inputs that ``check_inputs`` passed. ``parts`` launches only the
    exact programs ("exact": the sink's, and the current page's with the token's write) or only
    the mvar programs ("mvar"), each leaving the others' log-masses unwritten: a measurement of
    what each part costs (``tune_kernels.py --kinds estparts``), not a step."""
    if parts not in ("all", "exact", "mvar"):
        raise ValueError(f"parts must be 'all', 'exact' or 'mvar', got {parts!r}")
    batch, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    rows = batch * num_kv_heads
    function = kernel(cuda_build.device_index(query.device), head_dim, group,
                      MIN_BLOCKS_PER_SM)
    if build_only or rows == 0:
        return log_masses
    per_row = programs_per_row(rows, block_table.shape[1], head_dim, group)
    call = params(query, key_cache, summaries, block_table, seq_lens, scale, log_masses,
                  dense_below_pages, new_kv, per_row, 2 if parts == "mvar" else 0)
    programs = {"all": 2 + per_row, "exact": 2, "mvar": per_row}[parts]
    cuda_build.launch(function, (rows, programs), THREADS, 0, query.device, call)
    return log_masses
