"""Select in CUDA C++ (``KernelOptions(select="cuda")``): ``select.cu``'s kernel, built by
NVRTC on first use (one build per pages-per-thread and K_B) and launched through the CUDA
driver API (``build``).

The same rule and outputs as the Triton kernel, one program per row, on up to 512 threads of
P pages each with one barrier per bisection pass (the .cu file says why); a row that fits in
fewer pages per thread runs with P halved until it does not (lane tiers, as Triton's). It
takes up to 8 query heads per KV head, tables of up to ``max_table_pages(G, K_B)`` pages and
K_B in ``WAYS`` (``check_inputs``). K_B = 64 (``MoiraConfig.bisection_ways``) takes each
pass's sums from a histogram of the row's shares instead of comparing every page with every
threshold (the .cu file's ``bisect_binned``): 4 passes instead of 12. Measured at 131k x 4
alone on the H200, that is faster in fixed-count mode (10.8 against 12.8 us) and slower in
coverage mode (20.7 against 11.9): coverage's 64-bit fixed-point sums go through
shared-memory atomics that sm_90 runs as compare-and-swap loops (ATOMS.CAST.SPIN.64), and
near-equal shares all fall in one bin.
"""

import ctypes
import functools

import torch
import triton

from . import build

SOURCE = "select.cu"  # in this folder (build.source_path)
MAX_GROUP = 8  # the .cu file's MAX_GROUP
MAX_THREADS = 512  # 32 * MAX_WARPS
MAX_PAGES_PER_THREAD = 16  # 32 spills under the 128 registers 512 threads allow
WAYS = (2, 4, 8, 16, 64)  # 64: the binned passes


class Params(ctypes.Structure):
    """``Params`` of select.cu, field by field (the kernel's one argument)."""

    _fields_ = ([(name, ctypes.c_void_p) for name in (
        "log_masses", "seq_lens", "row_values", "page_lists", "page_counts")]
        + [(name, ctypes.c_int64) for name in (
            "stride_lr", "stride_lg", "stride_pb", "stride_ph", "stride_cb", "stride_ch",
            "stride_vb", "stride_vh")]
        + [(name, ctypes.c_int) for name in (
            "num_kv_heads", "max_pages", "group", "top_k", "dense_below_pages", "fixed_count",
            "fractions", "row_gammas")]
        + [("gamma", ctypes.c_float)])


def max_table_pages(group, ways=2):
    """The widest block table a row program takes at K_B = ``ways``: 512 threads of 16 pages,
    or of 8 above 4 query heads per KV head (16 pages of 8 heads spill); half that for the
    binned passes (K_B = 64: their 64-bit sums spilled at 16 pages of 4 heads and 8 of 8
    under NVRTC 13.5)."""
    pages = MAX_PAGES_PER_THREAD if group <= 4 else MAX_PAGES_PER_THREAD // 2
    return MAX_THREADS * (pages // 2 if ways == 64 else pages)


def shape(max_pages):
    """``(threads, pages per thread)`` of a row program for a block table of ``max_pages``
    columns: an eighth of the width in threads (32 to 512), the rest per thread."""
    width = triton.next_power_of_2(max(max_pages, 1))
    threads = min(MAX_THREADS, max(32, width // 8))
    return threads, max(1, width // threads)


def build_options(pages_per_thread, ways, group):
    """NVRTC's defines for one build: P, K_B and G rounded up to a power of two."""
    return (f"-DSELECT_P={pages_per_thread}", f"-DSELECT_WAYS={ways}",
            f"-DSELECT_GROUP={triton.next_power_of_2(group)}")


@functools.lru_cache(maxsize=None)
def kernel(device_index, pages_per_thread, ways, group):
    """The loaded function ``moira_select_p<P>_w<K_B>_g<G padded>`` on a device."""
    return build.function(
        device_index, SOURCE,
        f"moira_select_p{pages_per_thread}_w{ways}_g{triton.next_power_of_2(group)}",
        "select", options=build_options(pages_per_thread, ways, group))


def check_inputs(log_masses, seq_lens, page_lists, page_counts, max_pages, ways, row_values):
    """A ValueError naming what the CUDA Select cannot run, and the fix."""
    prefix = "KernelOptions(select='cuda')"
    if log_masses.device.type != "cuda":
        raise ValueError(f"{prefix} runs on CUDA tensors, got {log_masses.device}: use "
                         f"'triton' (the interpreter) on the CPU")
    if log_masses.shape[1] > MAX_GROUP:
        raise ValueError(f"{prefix} takes at most {MAX_GROUP} query heads per KV head, got "
                         f"{log_masses.shape[1]}: use 'triton'")
    if ways not in WAYS:
        raise ValueError(f"{prefix} is built for K_B in {WAYS}, got {ways}: use 'triton'")
    if max_pages > max_table_pages(log_masses.shape[1], ways):
        raise ValueError(f"{prefix} takes block tables of at most "
                         f"{max_table_pages(log_masses.shape[1], ways)} pages at G = "
                         f"{log_masses.shape[1]} and K_B = {ways}, got {max_pages}: use "
                         f"'triton'")
    tensors = [("log_masses", log_masses, torch.float32), ("seq_lens", seq_lens, torch.int32),
               ("page_lists", page_lists, torch.int32), ("page_counts", page_counts,
                                                         torch.int32)]
    if row_values is not None:
        tensors.append(("keep_fractions / gammas", row_values, torch.float32))
    for name, tensor, dtype in tensors:
        if tensor.dtype != dtype:
            raise ValueError(f"{prefix} reads {name} as {dtype}, got {tensor.dtype}: use "
                             f"'triton'")
    for name, tensor in (("log_masses", log_masses), ("page_lists", page_lists),
                         ("seq_lens", seq_lens)):
        if tensor.stride(-1) != 1:
            raise ValueError(f"{prefix} needs {name}'s last dim contiguous (strides "
                             f"{tensor.stride()}): use 'triton'")


def params(log_masses, seq_lens, page_lists, page_counts, *, num_kv_heads, max_pages, gamma,
           top_k, row_values, fractions, row_gammas, dense_below_pages):
    """The kernel's ``Params`` for a call (``select``'s arguments)."""
    return Params(
        log_masses.data_ptr(), seq_lens.data_ptr(),
        row_values.data_ptr() if row_values is not None else None, page_lists.data_ptr(),
        page_counts.data_ptr(), log_masses.stride(0), log_masses.stride(1),
        *page_lists.stride()[:2], *page_counts.stride(),
        *(row_values.stride() if row_values is not None else (0, 0)),
        num_kv_heads, max_pages, log_masses.shape[1], int(top_k or 0), int(dense_below_pages),
        int(top_k is not None or fractions), int(fractions), int(row_gammas), float(gamma))


def select(log_masses, seq_lens, page_lists, page_counts, *, num_kv_heads, max_pages, gamma,
           top_k, ways, row_values, fractions, row_gammas, dense_below_pages=0,
           build_only=False):
    """Launch ``select.cu``'s kernel on the current stream: ``triton.select.select``'s
    arguments, ``row_values`` already expanded to ``page_counts``' shape (or None), inputs that
    ``check_inputs`` passed."""
    rows, group = log_masses.shape[0], log_masses.shape[1]
    threads, pages_per_thread = shape(max_pages)
    function = kernel(build.device_index(log_masses.device), pages_per_thread, ways, group)
    if build_only or rows == 0:
        return page_lists, page_counts
    call = params(log_masses, seq_lens, page_lists, page_counts, num_kv_heads=num_kv_heads,
                  max_pages=max_pages, gamma=gamma, top_k=top_k, row_values=row_values,
                  fractions=fractions, row_gammas=row_gammas,
                  dense_below_pages=dense_below_pages)
    build.launch(function, (rows, 1), threads, 0, log_masses.device, call)
    return page_lists, page_counts
