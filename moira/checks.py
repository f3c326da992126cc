"""Argument checks of the public functions: shapes, dtypes, devices and strides only.

Values stay on the GPU (reading them would sync the host and break CUDA-graph capture), so ids
and lengths are the caller's to keep in range, as for FlashAttention and FlashInfer; values in
host memory cost no sync and are checked where a kernel would misread them (per-row targets
and fractions). Each check raises a ValueError that names the argument and the fix.
"""

from __future__ import annotations

import math
import numbers

import torch

from .config import (
    CACHE_DTYPE_NAMES,
    ESTIMATOR_BITS,
    MAX_PAGES_PER_SEQ,
    PAGE_SIZE,
    SUPPORTED_HEAD_DIMS,
    summary_rows,
)
from .kernels import interpreting

CACHE_DTYPES = tuple(getattr(torch, name) for name in CACHE_DTYPE_NAMES)
SUMMARY_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def require(condition, message):
    if not condition:
        raise ValueError(message)


def tensors(**tensors):
    for name, tensor in tensors.items():
        require(torch.is_tensor(tensor), f"{name} must be a torch.Tensor, got "
                                          f"{type(tensor).__name__}")


def unit_stride(**tensors):
    """The kernels step through these tensors' last dimension one element at a time."""
    for name, tensor in tensors.items():
        require(tensor.shape[-1] <= 1 or tensor.stride(-1) == 1,
                f"{name} must be contiguous in its last dimension, got strides "
                f"{tuple(tensor.stride())}: pass {name}.contiguous()")


def device(**tensors):
    devices = {t.device for t in tensors.values()}
    names = ", ".join(tensors)
    require(len(devices) == 1, f"{names} must be on one device, got {sorted(map(str, devices))}")
    device = devices.pop()
    require(
        device.type == "cuda" or interpreting(),
        f"{names} are on {device}: Moira's kernels need a CUDA device (or TRITON_INTERPRET=1, "
        f"Triton's CPU interpreter, for tests); move the tensors with .cuda()",
    )


def cache(key_cache, value_cache, name="key_cache"):
    tensors(**{name: key_cache})
    require(key_cache.dim() == 4, f"{name} must be [num_pages, 64, num_kv_heads, head_dim], "
            f"got shape {tuple(key_cache.shape)}")
    if key_cache.dtype not in CACHE_DTYPES:
        fp8 = "float8" in str(key_cache.dtype)
        raise ValueError(
            f"{name} has dtype {key_cache.dtype}: "
            + ("an FP8 KV cache is not supported yet; use a bf16 or fp16 cache "
               "(vLLM: --kv-cache-dtype auto)" if fp8 else "use bfloat16 or float16")
        )
    require(key_cache.shape[1] == PAGE_SIZE,
            f"{name} has pages of {key_cache.shape[1]} tokens: Moira needs 64-token pages "
            f"(vLLM: --block-size 64)")
    require(key_cache.shape[3] in SUPPORTED_HEAD_DIMS,
            f"{name} has head_dim {key_cache.shape[3]}, which has no kernel; supported: "
            f"{SUPPORTED_HEAD_DIMS}")
    require(key_cache.shape[2] >= 1, f"{name} has no KV heads (shape {tuple(key_cache.shape)})")
    if value_cache is not None:  # a tensor: _check_step checked it
        require(value_cache.shape == key_cache.shape,
                f"value_cache shape {tuple(value_cache.shape)} must equal key_cache shape "
                f"{tuple(key_cache.shape)}")
        require(value_cache.dtype == key_cache.dtype,
                f"value_cache dtype {value_cache.dtype} must equal key_cache dtype "
                f"{key_cache.dtype}")


def table(block_table, seq_lens, batch=None):
    tensors(block_table=block_table, seq_lens=seq_lens)
    require(block_table.dim() == 2 and block_table.dtype == torch.int32,
            f"block_table must be a 2-D int32 tensor [batch, max_pages_per_seq], got "
            f"{block_table.dtype} of shape {tuple(block_table.shape)}")
    require(seq_lens.dim() == 1 and seq_lens.dtype == torch.int32,
            f"seq_lens must be a 1-D int32 tensor [batch], got {seq_lens.dtype} of shape "
            f"{tuple(seq_lens.shape)}")
    require(seq_lens.shape[0] == block_table.shape[0],
            f"seq_lens has {seq_lens.shape[0]} rows but block_table has {block_table.shape[0]}")
    unit_stride(block_table=block_table, seq_lens=seq_lens)
    if batch is not None:
        require(block_table.shape[0] == batch,
                f"block_table has {block_table.shape[0]} rows but query has batch {batch}")


def step(query, key_cache, value_cache, block_table, seq_lens):
    """Validate a decode step's inputs; return ``(batch, num_heads, num_kv_heads, head_dim)``."""
    tensors(query=query, value_cache=value_cache)
    require(query.dim() == 3, f"query must be [batch, num_heads, head_dim], got shape "
            f"{tuple(query.shape)}")
    cache(key_cache, value_cache)
    batch, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    require(batch >= 1, "query has batch 0: a step needs at least one request")
    require(query.dtype == key_cache.dtype,
            f"query dtype {query.dtype} must equal the cache dtype {key_cache.dtype}")
    require(head_dim == key_cache.shape[3],
            f"query head_dim {head_dim} must equal the cache head_dim {key_cache.shape[3]}")
    require(num_heads % num_kv_heads == 0,
            f"query has {num_heads} heads, not a multiple of the cache's {num_kv_heads} KV heads")
    table(block_table, seq_lens, batch)
    device(query=query, key_cache=key_cache, value_cache=value_cache,
           block_table=block_table, seq_lens=seq_lens)
    return batch, num_heads, num_kv_heads, head_dim


def estimator(name):
    require(name in ESTIMATOR_BITS,
            f"estimator must be one of {sorted(ESTIMATOR_BITS)}, got {name!r}")


def summaries(summaries, key_cache, estimator_name="mvar"):
    """Shape, dtype and device of ``estimator_name``'s summaries (``config.summary_rows``)."""
    estimator(estimator_name)
    tensors(summaries=summaries)
    require(summaries.dtype in SUMMARY_DTYPES,
            f"summaries dtype {summaries.dtype} must be one of {SUMMARY_DTYPES}")
    num_pages, _, num_kv_heads, head_dim = key_cache.shape
    rows = summary_rows(estimator_name, summaries.element_size())
    expected = (num_pages, num_kv_heads, rows, head_dim)
    if tuple(summaries.shape) != expected:
        built_for = [name for name in ESTIMATOR_BITS
                     if summaries.dim() == 4 and summaries.shape[2]
                     == summary_rows(name, summaries.element_size())]
        hint = (f": these look built for estimator={built_for[0]!r}; summarize with "
                f"estimator={estimator_name!r} or use config estimator={built_for[0]!r}"
                if built_for and tuple(summaries.shape[:2]) + tuple(summaries.shape[3:])
                == (num_pages, num_kv_heads, head_dim) else "")
        raise ValueError(f"summaries for estimator={estimator_name!r} must have shape "
                         f"{expected} ([num_pages, num_kv_heads, {rows}, head_dim] in "
                         f"{summaries.dtype}), got {tuple(summaries.shape)}{hint}")
    if ESTIMATOR_BITS[estimator_name]:  # the codes are read as the rows' bytes, in order
        require(summaries.stride(3) == 1 and summaries.stride(2) == head_dim,
                f"summaries for estimator={estimator_name!r} must have contiguous rows "
                f"(strides [..., {head_dim}, 1]), got strides {summaries.stride()}: pass "
                f"summaries.contiguous()")
    device(summaries=summaries, key_cache=key_cache)


def distinct_pages(page_lists, page_counts, seq_lens, max_pages):
    """No row lists one of its pages twice among its first ``page_counts`` entries (Attend
    would count it twice; entries past the row's pages read nothing and may repeat). One
    synchronizing reduction, so it is skipped while a CUDA graph is captured (there the
    lists' contract is the caller's, as Select's lists meet it)."""
    if page_lists.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    width = page_lists.shape[-1]
    columns = torch.arange(width, device=page_lists.device)
    entries = page_lists.long()
    pages = ((seq_lens.long().clamp(min=0) + PAGE_SIZE - 1) // PAGE_SIZE).clamp(max=max_pages)
    read = ((columns < page_counts[..., None].long()) & (entries >= 0)
            & (entries < pages[:, None, None]))
    # entries that read nothing become distinct negatives, so only real pages can collide
    keys = torch.where(read, entries, -1 - columns).sort(dim=-1).values
    repeated = (keys[..., 1:] == keys[..., :-1]) & (keys[..., 1:] >= 0)
    if bool(repeated.any()):
        b, h, j = (int(i) for i in torch.nonzero(repeated)[0])
        raise ValueError(f"page_lists: row (request {b}, KV head {h}) lists page "
                         f"{int(keys[b, h, j])} more than once, and attend would count it "
                         f"each time: pass each page at most once per row (e.g. "
                         f"torch.unique over the row's entries)")


def out(out, query):
    if out is not None:
        require(out.shape == query.shape and out.dtype == query.dtype
                and out.device == query.device,
                f"out must match query ({tuple(query.shape)}, {query.dtype}, {query.device}), "
                f"got ({tuple(out.shape)}, {out.dtype}, {out.device})")


def scale(scale, head_dim):
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    require(isinstance(scale, numbers.Real) and not isinstance(scale, bool)
            and math.isfinite(scale) and scale > 0,
            f"scale must be a positive finite float, got {scale!r}")
    return float(scale)




def slots(slot_mapping):
    tensors(slot_mapping=slot_mapping)
    require(slot_mapping.dim() == 1 and slot_mapping.dtype in (torch.int32, torch.int64),
            f"slot_mapping must be a 1-D int32/int64 tensor, got {slot_mapping.dtype} of shape "
            f"{tuple(slot_mapping.shape)}")
    unit_stride(slot_mapping=slot_mapping)


def new_tokens(new_keys, new_values, slot_mapping, key_cache, value_cache, batch):
    """``sparse_decode``'s cache write: None, or the launch's ``new_kv`` tuple."""
    given = [name for name, tensor in (("new_keys", new_keys), ("new_values", new_values),
                                        ("slot_mapping", slot_mapping)) if tensor is not None]
    if not given:
        return None
    require(len(given) == 3, f"new_keys, new_values and slot_mapping go together; got only "
                              f"{', '.join(given)}")
    expected = (batch, key_cache.shape[2], key_cache.shape[3])
    for name, tensor in (("new_keys", new_keys), ("new_values", new_values)):
        require(tuple(tensor.shape) == expected and tensor.dtype == key_cache.dtype,
                f"{name} must be {key_cache.dtype} [batch, num_kv_heads, head_dim] = "
                f"{list(expected)}, got {tensor.dtype} of shape {tuple(tensor.shape)}")
    slots(slot_mapping)
    device(key_cache=key_cache, new_keys=new_keys, new_values=new_values,
           slot_mapping=slot_mapping)
    return new_keys, new_values, value_cache, slot_mapping


def page_stats(page_stats, query):
    if page_stats is not None:
        require(page_stats.dtype == torch.int64 and tuple(page_stats.shape) == (2,)
                and page_stats.device == query.device,
                f"page_stats must be an int64 tensor of shape (2,) on {query.device}, got "
                f"{page_stats.dtype} {tuple(page_stats.shape)} on {page_stats.device}")
        unit_stride(page_stats=page_stats)


def table_width(block_table):
    require(block_table.shape[1] >= 1,
            "block_table has no columns: a request needs at least one page")
    require(block_table.shape[1] <= MAX_PAGES_PER_SEQ,
            f"block_table has {block_table.shape[1]} pages per request; Moira supports up to "
            f"{MAX_PAGES_PER_SEQ} ({MAX_PAGES_PER_SEQ * PAGE_SIZE:,} tokens): trim the table to "
            f"the pages in use")


def row_values(name, values, batch, num_kv_heads, query):
    """A float32 value per KV head or per (request, KV head), on the query's device; in (0, 1]
    where the values are in host memory (reading GPU memory would sync: there the kernels
    saturate values outside, docs/design/select.md)."""
    tensors(**{name: values})
    require(values.dtype == torch.float32
            and tuple(values.shape) in ((num_kv_heads,), (batch, num_kv_heads)),
            f"{name} must be a float32 tensor [num_kv_heads={num_kv_heads}] or "
            f"[batch={batch}, num_kv_heads={num_kv_heads}], got {values.dtype} of shape "
            f"{tuple(values.shape)}")
    device(query=query, **{name: values})
    if values.device.type == "cpu":
        bad = ~((values > 0) & (values <= 1))  # NaN too
        require(not bool(bad.any()),
                f"{name} must lie in (0, 1], got {values[bad].flatten()[:4].tolist()} "
                f"({int(bad.sum())} of {values.numel()} outside)")
