"""Shared builders and the flash-attention tolerance rule."""

import ctypes

import pytest
import torch

from moira import MoiraConfig
from moira.config import PAGE_SIZE
from moira.kernels.cuda import build as cuda_build

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# tests that build a CUDA kernel with NVRTC (on the CPU too: registers, struct layouts)
needs_nvrtc = pytest.mark.skipif(cuda_build.nvrtc_library() is None, reason="needs libnvrtc")

# Exercises multi-chunk rows, chunk boundaries and Merge at interpreter-friendly sizes:
# J = max(3, ceil(8 / rows)), c = max(2, ceil(n / J)).
SMALL_SPLIT = MoiraConfig(chunk_pages=2, min_chunks_per_row=3, min_programs=8)


def make_cache(num_pages, num_kv_heads, head_dim, dtype=torch.bfloat16, layout="contiguous"):
    """Random K and V caches ``[num_pages, 64, num_kv_heads, head_dim]``.

    layout: "contiguous"; "packed" (views of one ``[..., 2 * head_dim]`` tensor, vLLM's NHD
    K|V); "hnd" (permuted views of ``[num_pages, num_kv_heads, 64, head_dim]``);
    "packed_hnd" (vLLM's HND cache, ``VLLM_KV_CACHE_LAYOUT=HND``: permuted views of one
    ``[num_pages, num_kv_heads, 64, 2 * head_dim]`` tensor, a page-head's K|V rows
    interleaved)."""
    shape = (num_pages, PAGE_SIZE, num_kv_heads, head_dim)
    if layout == "contiguous":
        return (torch.randn(shape, device=DEVICE).to(dtype),
                torch.randn(shape, device=DEVICE).to(dtype))
    if layout == "packed":
        kv = torch.randn(num_pages, PAGE_SIZE, num_kv_heads, 2 * head_dim, device=DEVICE)
        kv = kv.to(dtype)
        return kv[..., :head_dim], kv[..., head_dim:]
    if layout == "packed_hnd":
        kv = torch.randn(num_pages, num_kv_heads, PAGE_SIZE, 2 * head_dim, device=DEVICE)
        kv = kv.to(dtype).transpose(1, 2)
        return kv[..., :head_dim], kv[..., head_dim:]
    if layout == "hnd":
        k, v = (torch.randn(num_pages, num_kv_heads, PAGE_SIZE, head_dim, device=DEVICE)
                .to(dtype).transpose(1, 2) for _ in range(2))
        return k, v
    raise ValueError(layout)


def make_table(seq_lens, num_pages, extra_columns=1):
    """A block table of distinct random physical pages, wide enough for the longest row plus
    ``extra_columns``, and the int32 ``seq_lens`` tensor."""
    seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
    width = max(1, -(-int(seq_lens.max()) // PAGE_SIZE)) + extra_columns
    assert len(seq_lens) * width <= num_pages, "cache too small for distinct pages"
    table = torch.randperm(num_pages)[: len(seq_lens) * width].view(len(seq_lens), width)
    return table.to(torch.int32).to(DEVICE), seq_lens.to(DEVICE)


def make_query(batch, num_heads, head_dim, dtype=torch.bfloat16):
    return torch.randn(batch, num_heads, head_dim, device=DEVICE).to(dtype)


def poisoned(*shape, dtype=torch.bfloat16):
    """A tensor of NaNs: any element a kernel fails to write stays NaN."""
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


def assert_attention_close(out, out_ref, out_lowp):
    """flash-attention's rule: the kernel's error against the float32 reference is at most twice
    that of the same reference computed in low precision, plus float32 noise."""
    assert not torch.isnan(out).any(), "unwritten (NaN) output elements"
    out, out_ref, out_lowp = out.cpu(), out_ref.float().cpu(), out_lowp.cpu()
    atol = 2 * (out_ref + 0.3 - 0.3 - out_ref).abs().max().item()
    error = (out.float() - out_ref).abs().max().item()
    baseline = (out_lowp.float() - out_ref).abs().max().item()
    assert error <= 2 * baseline + atol, f"error {error:.3e} > 2 x bf16 reference {baseline:.3e}"


C_TYPES = {ctypes.c_int64: "long long", ctypes.c_int: "int", ctypes.c_float: "float"}


def struct_mirror_checks(params, extra_fields=0):
    """C++20 lines, to append to a kernel's .cu, that compile only if its ``Params`` has the
    ctypes mirror ``params``' size, field names in order (designated initializers must follow
    the declaration order), field types (pointers as pointers) and exactly its number of
    fields plus ``extra_fields`` (an aggregate initializer with one value per field). Names,
    order and types fix the offsets (both sides follow the platform's C layout);
    ``__builtin_offsetof`` is not used: NVRTC 13.0 does not know it."""
    fields = params._fields_
    checks = ["template <class A, class B> struct same { static constexpr bool value = false; };",
              "template <class A> struct same<A, A> { static constexpr bool value = true; };",
              "template <class A> struct pointer { static constexpr bool value = false; };",
              "template <class A> struct pointer<A*> { static constexpr bool value = true; };",
              f'static_assert(sizeof(Params) == {ctypes.sizeof(params)}, "size");']
    for name, kind in fields:
        test = (f"pointer<decltype(Params::{name})>" if kind is ctypes.c_void_p
                else f"same<decltype(Params::{name}), {C_TYPES[kind]}>")
        checks.append(f'static_assert({test}::value, "type of {name}");')
    values = ["nullptr" if kind is ctypes.c_void_p else "0" for _, kind in fields]
    designated = ", ".join(f".{name} = {value}" for (name, _), value in zip(fields, values))
    checks.append(f"__device__ Params in_order{{{designated}}};")
    checks.append(f"__device__ Params every_field{{{', '.join(values + ['0'] * extra_fields)}}};")
    return checks


def check_struct_mirror(file_name, params, retyped, swapped, more_checks=(), options=()):
    """A kernel's .cu (``file_name`` in moira/kernels) with ``struct_mirror_checks(params)`` and
    ``more_checks`` (C++ lines) compiles for sm_90 under NVRTC ``options``, and no longer does
    with one initializer too many, with a field retyped on the kernel's side (``retyped``:
    ``(old, new, field)``, source bytes and the field's name) or with two fields of one type
    swapped there (``swapped``: ``(old, new)``; same offsets by type, wrong by name)."""
    from moira.kernels.cuda import build as cuda_build

    with open(cuda_build.source_path(file_name), "rb") as f:
        source = f.read()

    def compile_checked(kernel_source, extra_fields=0):
        checks = [*struct_mirror_checks(params, extra_fields), *more_checks]
        return cuda_build.compile_cubin(kernel_source + b"\n" + "\n".join(checks).encode(),
                                        "90", ["-std=c++20", *options])

    compile_checked(source)
    with pytest.raises(RuntimeError, match="too many initializer"):
        compile_checked(source, extra_fields=1)
    for (old, new), error in (((retyped[0], retyped[1]), f"type of {retyped[2]}"),
                              (swapped, "out-of-order initializers")):
        assert old in source
        with pytest.raises(RuntimeError, match=error):
            compile_checked(source.replace(old, new))
