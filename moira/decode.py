"""The public API: page summaries, the graph-safe sparse decode step, and attention over any
selector's page lists.

Tensor conventions (vLLM's):

- ``query`` / ``out``: ``[batch, num_heads, head_dim]``, bf16 or fp16. Query head ``h * G + g``
  belongs to KV head ``h`` (G = num_heads / num_kv_heads).
- ``key_cache`` / ``value_cache``: ``[num_pages, 64, num_kv_heads, head_dim]``, the query's
  dtype, any strides (views of vLLM's packed ``[..., 2 * head_dim]`` K|V tensor work).
- ``block_table``: ``[batch, max_pages_per_seq]`` int32 physical page ids.
- ``seq_lens``: ``[batch]`` int32, tokens in the cache per request, the current token included
  (already written). 0 marks a padded row: its output is zeros. Values are not checked on the
  host (that would sync); a row's pages are clamped to the block table's width.
- ``summaries``: ``[num_pages, num_kv_heads, 2, head_dim]`` (0 = mean, 1 = population variance
  of the page's keys), float32, bf16 or fp16.
- ``page_lists``: ``[batch, num_kv_heads, max_pages]`` int32 *logical* page indices;
  ``page_counts``: ``[batch, num_kv_heads]`` int32, the valid prefix of each list (at most
  its width: not checked).

The caller keeps the ids in range, as for FlashAttention and FlashInfer (checking them would
sync): physical page ids in ``[0, num_pages)``, slots in ``[0, num_pages * 64)``.

Nothing on the decode path reads GPU memory from the host or sizes a launch from a value in
GPU memory, so with a ``DecodeWorkspace`` a whole step can be captured in a CUDA graph and
replayed with new lengths and cache contents.
"""

from __future__ import annotations

import math
import numbers

import torch

from .config import (CACHE_DTYPE_NAMES, MAX_PAGES_PER_SEQ, PAGE_SIZE, SUPPORTED_HEAD_DIMS,
                     MoiraConfig)
from .kernels import estimate as _estimate_module
from .kernels import estimate_select_cuda, interpreting, launch
from .kernels import select as _select_module
from .kernels.attend import attend as _launch_attend
from .kernels.balanced import attend_balanced as _launch_attend_balanced
from .kernels.balanced import merge_balanced as _launch_merge_balanced
from .kernels.estimate import estimate as _launch_estimate
from .kernels.merge import merge as _launch_merge
from .kernels.select import select as _launch_select
from .kernels.summarize import summarize_filled_slots, summarize_pages

CACHE_DTYPES = tuple(getattr(torch, name) for name in CACHE_DTYPE_NAMES)
SUMMARY_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# --------------------------------------------------------------------------------------------
# Argument checks (shapes, dtypes and devices only: values stay on the GPU)
# --------------------------------------------------------------------------------------------


def _require(condition, message):
    if not condition:
        raise ValueError(message)


def _check_tensors(**tensors):
    for name, tensor in tensors.items():
        _require(torch.is_tensor(tensor), f"{name} must be a torch.Tensor, got "
                                          f"{type(tensor).__name__}")


def _check_unit_stride(**tensors):
    """The kernels step through these tensors' last dimension one element at a time."""
    for name, tensor in tensors.items():
        _require(tensor.shape[-1] <= 1 or tensor.stride(-1) == 1,
                 f"{name} must be contiguous in its last dimension, got strides "
                 f"{tuple(tensor.stride())}: pass {name}.contiguous()")


def _check_device(**tensors):
    devices = {t.device for t in tensors.values()}
    names = ", ".join(tensors)
    _require(len(devices) == 1, f"{names} must be on one device, got {sorted(map(str, devices))}")
    device = devices.pop()
    _require(
        device.type == "cuda" or interpreting(),
        f"{names} are on {device}: Moira's kernels need a CUDA device (or TRITON_INTERPRET=1, "
        f"Triton's CPU interpreter, for tests); move the tensors with .cuda()",
    )


def _check_cache(key_cache, value_cache, name="key_cache"):
    _check_tensors(**{name: key_cache})
    _require(key_cache.dim() == 4, f"{name} must be [num_pages, 64, num_kv_heads, head_dim], "
             f"got shape {tuple(key_cache.shape)}")
    if key_cache.dtype not in CACHE_DTYPES:
        fp8 = "float8" in str(key_cache.dtype)
        raise ValueError(
            f"{name} has dtype {key_cache.dtype}: "
            + ("an FP8 KV cache is not supported yet; use a bf16 or fp16 cache "
               "(vLLM: --kv-cache-dtype auto)" if fp8 else "use bfloat16 or float16")
        )
    _require(key_cache.shape[1] == PAGE_SIZE,
             f"{name} has pages of {key_cache.shape[1]} tokens: Moira needs 64-token pages "
             f"(vLLM: --block-size 64)")
    _require(key_cache.shape[3] in SUPPORTED_HEAD_DIMS,
             f"{name} has head_dim {key_cache.shape[3]}, which has no kernel; supported: "
             f"{SUPPORTED_HEAD_DIMS}")
    _require(key_cache.shape[2] >= 1, f"{name} has no KV heads (shape {tuple(key_cache.shape)})")
    if value_cache is not None:  # a tensor: _check_step checked it
        _require(value_cache.shape == key_cache.shape,
                 f"value_cache shape {tuple(value_cache.shape)} must equal key_cache shape "
                 f"{tuple(key_cache.shape)}")
        _require(value_cache.dtype == key_cache.dtype,
                 f"value_cache dtype {value_cache.dtype} must equal key_cache dtype "
                 f"{key_cache.dtype}")


def _check_table(block_table, seq_lens, batch=None):
    _check_tensors(block_table=block_table, seq_lens=seq_lens)
    _require(block_table.dim() == 2 and block_table.dtype == torch.int32,
             f"block_table must be a 2-D int32 tensor [batch, max_pages_per_seq], got "
             f"{block_table.dtype} of shape {tuple(block_table.shape)}")
    _require(seq_lens.dim() == 1 and seq_lens.dtype == torch.int32,
             f"seq_lens must be a 1-D int32 tensor [batch], got {seq_lens.dtype} of shape "
             f"{tuple(seq_lens.shape)}")
    _require(seq_lens.shape[0] == block_table.shape[0],
             f"seq_lens has {seq_lens.shape[0]} rows but block_table has {block_table.shape[0]}")
    _check_unit_stride(block_table=block_table, seq_lens=seq_lens)
    if batch is not None:
        _require(block_table.shape[0] == batch,
                 f"block_table has {block_table.shape[0]} rows but query has batch {batch}")


def _check_step(query, key_cache, value_cache, block_table, seq_lens):
    """Validate a decode step's inputs; return ``(batch, num_heads, num_kv_heads, head_dim)``."""
    _check_tensors(query=query, value_cache=value_cache)
    _require(query.dim() == 3, f"query must be [batch, num_heads, head_dim], got shape "
             f"{tuple(query.shape)}")
    _check_cache(key_cache, value_cache)
    batch, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    _require(batch >= 1, "query has batch 0: a step needs at least one request")
    _require(query.dtype == key_cache.dtype,
             f"query dtype {query.dtype} must equal the cache dtype {key_cache.dtype}")
    _require(head_dim == key_cache.shape[3],
             f"query head_dim {head_dim} must equal the cache head_dim {key_cache.shape[3]}")
    _require(num_heads % num_kv_heads == 0,
             f"query has {num_heads} heads, not a multiple of the cache's {num_kv_heads} KV heads")
    _check_table(block_table, seq_lens, batch)
    _check_device(query=query, key_cache=key_cache, value_cache=value_cache,
                  block_table=block_table, seq_lens=seq_lens)
    return batch, num_heads, num_kv_heads, head_dim


def _check_summaries(summaries, key_cache):
    _check_tensors(summaries=summaries)
    num_pages, _, num_kv_heads, head_dim = key_cache.shape
    expected = (num_pages, num_kv_heads, 2, head_dim)
    _require(tuple(summaries.shape) == expected,
             f"summaries must have shape {expected} ([num_pages, num_kv_heads, 2, head_dim]), "
             f"got {tuple(summaries.shape)}")
    _require(summaries.dtype in SUMMARY_DTYPES,
             f"summaries dtype {summaries.dtype} must be one of {SUMMARY_DTYPES}")
    _check_device(summaries=summaries, key_cache=key_cache)


def _check_out(out, query):
    if out is not None:
        _require(out.shape == query.shape and out.dtype == query.dtype
                 and out.device == query.device,
                 f"out must match query ({tuple(query.shape)}, {query.dtype}, {query.device}), "
                 f"got ({tuple(out.shape)}, {out.dtype}, {out.device})")


def _resolve_scale(scale, head_dim):
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    _require(isinstance(scale, numbers.Real) and not isinstance(scale, bool)
             and math.isfinite(scale) and scale > 0,
             f"scale must be a positive finite float, got {scale!r}")
    return float(scale)


# --------------------------------------------------------------------------------------------
# Workspace
# --------------------------------------------------------------------------------------------


class DecodeWorkspace:
    """Preallocated buffers for decode steps of up to ``max_batch`` requests and
    ``max_pages_per_seq`` pages, so that a step allocates nothing (CUDA-graph safe).

    One workspace serves every layer of a model (layers run one after another). Buffers:

    - ``log_masses`` float32, ``max_batch * num_kv_heads * G * max_pages_per_seq``: Estimate's
      output, viewed per step as ``[batch * num_kv_heads, G, max_pages]``.
    - ``page_lists`` int32 ``[max_batch * num_kv_heads * max_pages_per_seq]`` and
      ``page_counts`` int32 ``[max_batch * num_kv_heads]``: Select's output.
    - ``partial_out`` / ``partial_lse`` float32: Attend's per-chunk partials, sized for the
      largest ``rows * J`` of any batch up to ``max_batch`` (J from ``config``).
    """

    def __init__(self, max_batch, max_pages_per_seq, num_heads, num_kv_heads, head_dim, *,
                 device, config=None):
        _require(config is None or isinstance(config, MoiraConfig),
                 f"config must be a MoiraConfig, got {type(config).__name__}: pass "
                 f"MoiraConfig(...)")
        self.config = config or MoiraConfig()
        for name, value in (("max_batch", max_batch), ("num_heads", num_heads),
                            ("num_kv_heads", num_kv_heads)):
            _require(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                     f"{name} must be a positive int, got {value!r}")
        _require(isinstance(max_pages_per_seq, int) and 1 <= max_pages_per_seq <= MAX_PAGES_PER_SEQ,
                 f"max_pages_per_seq must be an int in [1, {MAX_PAGES_PER_SEQ}], got "
                 f"{max_pages_per_seq!r}")
        _require(num_heads % num_kv_heads == 0,
                 f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
        _require(head_dim in SUPPORTED_HEAD_DIMS,
                 f"head_dim {head_dim} has no kernel; supported: {SUPPORTED_HEAD_DIMS}")
        if self.config.programmatic_launch and torch.device(device).type == "cuda":
            capability = torch.cuda.get_device_capability(device)
            _require(capability >= (9, 0),
                     f"programmatic_launch needs a Hopper-or-newer GPU (sm_90+); "
                     f"{torch.cuda.get_device_name(device)} is sm_{capability[0]}{capability[1]}: "
                     f"set programmatic_launch=False")
        self.max_batch = max_batch
        self.max_pages_per_seq = max_pages_per_seq
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.head_dim = head_dim
        max_rows = max_batch * num_kv_heads
        # rows * max(N_J, ceil(N_T / rows)) <= max(N_J * rows, N_T + rows); balanced: P + rows
        slots = max(self.config.min_chunks_per_row * max_rows,
                    self.config.min_programs + max_rows, self.config.programs + max_rows)
        f32, i32 = torch.float32, torch.int32
        self.log_masses = torch.empty(max_rows * self.group * max_pages_per_seq, dtype=f32,
                                      device=device)
        self.page_lists = torch.empty(max_rows * max_pages_per_seq, dtype=i32, device=device)
        self.page_counts = torch.empty(max_rows, dtype=i32, device=device)
        self.partial_out = torch.empty(slots * self.group * head_dim, dtype=f32, device=device)
        self.partial_lse = torch.empty(slots * self.group, dtype=f32, device=device)

    @classmethod
    def for_step(cls, query, key_cache, block_table, config=None):
        """A workspace that fits exactly this step's shapes."""
        return cls(query.shape[0], block_table.shape[1], query.shape[1], key_cache.shape[2],
                   query.shape[2], device=query.device, config=config)

    def check_fits(self, batch, num_heads, num_kv_heads, head_dim, max_pages, device):
        _require(batch <= self.max_batch,
                 f"workspace holds {self.max_batch} requests, the step has {batch}: build the "
                 f"DecodeWorkspace with a larger max_batch")
        _require(max_pages <= self.max_pages_per_seq,
                 f"workspace holds {self.max_pages_per_seq} pages per request, block_table has "
                 f"{max_pages}: build the DecodeWorkspace with a larger max_pages_per_seq")
        _require((num_kv_heads, num_heads // num_kv_heads, head_dim)
                 == (self.num_kv_heads, self.group, self.head_dim),
                 f"workspace was built for {self.num_kv_heads} KV heads, G={self.group}, "
                 f"head_dim={self.head_dim}; the step has {num_kv_heads}, "
                 f"{num_heads // num_kv_heads}, {head_dim}")
        _require(device == self.page_counts.device,
                 f"workspace is on {self.page_counts.device}, the step on {device}")

    def selection_buffers(self, batch, max_pages):
        """Views ``(log_masses [rows, G, max_pages], page_lists [batch, Hkv, max_pages],
        page_counts [batch, Hkv])`` for a step."""
        rows = batch * self.num_kv_heads
        log_masses = self.log_masses[: rows * self.group * max_pages].view(
            rows, self.group, max_pages)
        page_lists = self.page_lists[: rows * max_pages].view(batch, self.num_kv_heads,
                                                               max_pages)
        page_counts = self.page_counts[:rows].view(batch, self.num_kv_heads)
        return log_masses, page_lists, page_counts


# --------------------------------------------------------------------------------------------
# Public functions
# --------------------------------------------------------------------------------------------


def summarize(key_cache, block_table, seq_lens, summaries=None):
    """Write the summary of every full page that ``block_table`` references.

    Parameters
    ----------
    key_cache : ``[num_pages, 64, num_kv_heads, head_dim]`` bf16/fp16, any strides.
    block_table : ``[batch, max_pages_per_seq]`` int32.
    seq_lens : ``[batch]`` int32; logical page p of request b is summarized if
        ``64 * (p + 1) <= seq_lens[b]``. Partial pages are left untouched.
    summaries : optional ``[num_pages, num_kv_heads, 2, head_dim]`` float32/bf16/fp16 to
        write into; by default a new tensor of the cache's dtype (uninitialized where no full
        page lands).

    Returns
    -------
    summaries : index ``[..., 0, :]`` holds the per-channel mean, ``[..., 1, :]`` the
        population variance of the page's 64 keys.
    """
    _check_cache(key_cache, None)
    _check_table(block_table, seq_lens)
    if summaries is None:
        num_pages, _, num_kv_heads, head_dim = key_cache.shape
        summaries = torch.empty(num_pages, num_kv_heads, 2, head_dim, dtype=key_cache.dtype,
                                device=key_cache.device)
    _check_summaries(summaries, key_cache)
    _check_device(key_cache=key_cache, block_table=block_table, seq_lens=seq_lens)
    return summarize_pages(key_cache, block_table, seq_lens, summaries)


def update_summaries(key_cache, slot_mapping, summaries):
    """Summarize the pages that the slots just written have filled (graph-safe).

    ``slot_mapping`` ``[num_tokens]`` int32/int64 holds each written token's cache slot
    ``page * 64 + offset`` (vLLM's slot mapping; negative entries are padding). Every page whose
    last slot (offset 63) appears is summarized from the cache, so call this after the keys are
    written. Returns ``summaries``.
    """
    _check_cache(key_cache, None)
    _check_slot_mapping(slot_mapping)
    _check_summaries(summaries, key_cache)
    _check_device(key_cache=key_cache, slot_mapping=slot_mapping)
    return summarize_filled_slots(key_cache, slot_mapping, summaries)


def _check_slot_mapping(slot_mapping):
    _check_tensors(slot_mapping=slot_mapping)
    _require(slot_mapping.dim() == 1 and slot_mapping.dtype in (torch.int32, torch.int64),
             f"slot_mapping must be a 1-D int32/int64 tensor, got {slot_mapping.dtype} of shape "
             f"{tuple(slot_mapping.shape)}")
    _check_unit_stride(slot_mapping=slot_mapping)


def _check_new_tokens(new_keys, new_values, slot_mapping, key_cache, value_cache, batch):
    """``sparse_decode``'s cache write: None, or the launch's ``new_kv`` tuple."""
    given = [name for name, tensor in (("new_keys", new_keys), ("new_values", new_values),
                                        ("slot_mapping", slot_mapping)) if tensor is not None]
    if not given:
        return None
    _require(len(given) == 3, f"new_keys, new_values and slot_mapping go together; got only "
                              f"{', '.join(given)}")
    expected = (batch, key_cache.shape[2], key_cache.shape[3])
    for name, tensor in (("new_keys", new_keys), ("new_values", new_values)):
        _require(tuple(tensor.shape) == expected and tensor.dtype == key_cache.dtype,
                 f"{name} must be {key_cache.dtype} [batch, num_kv_heads, head_dim] = "
                 f"{list(expected)}, got {tensor.dtype} of shape {tuple(tensor.shape)}")
    _check_slot_mapping(slot_mapping)
    _check_device(key_cache=key_cache, new_keys=new_keys, new_values=new_values,
                  slot_mapping=slot_mapping)
    return new_keys, new_values, value_cache, slot_mapping


def _check_page_stats(page_stats, query):
    if page_stats is not None:
        _require(page_stats.dtype == torch.int64 and tuple(page_stats.shape) == (2,)
                 and page_stats.device == query.device,
                 f"page_stats must be an int64 tensor of shape (2,) on {query.device}, got "
                 f"{page_stats.dtype} {tuple(page_stats.shape)} on {page_stats.device}")
        _check_unit_stride(page_stats=page_stats)


def _attend_and_merge(query, key_cache, value_cache, block_table, seq_lens, page_lists,
                      page_counts, scale, workspace, out, page_stats=None, planned_batch=None):
    config = workspace.config
    partials = (workspace.partial_out, workspace.partial_lse)
    stats = dict(seq_lens=seq_lens, max_pages=block_table.shape[1], page_stats=page_stats)
    inputs = (query, key_cache, value_cache, block_table, seq_lens, page_lists, page_counts)
    num_kv_heads = key_cache.shape[2]
    if config.schedule == "balanced":
        split = dict(min_pages=config.chunk_pages, programs=config.programs)
        attend_kernel, merge_kernel = _launch_attend_balanced, _launch_merge_balanced
    else:
        # planned for the padded batch of a captured graph, so that an eager step of fewer
        # requests splits each row exactly as the replay does
        rows = (planned_batch or query.shape[0]) * num_kv_heads
        split = dict(chunk_floor=config.chunk_floor(rows),
                     chunks_per_row=config.chunks_per_row(rows, block_table.shape[1]),
                     step_rows=rows, step_programs=config.step_programs)
        attend_kernel, merge_kernel = _launch_attend, _launch_merge
        split["programmatic_launch"] = config.programmatic_launch
    attend_kernel(*inputs, scale=scale, out=out, partial_out=partials[0],
                  partial_lse=partials[1], **split)
    merge_kernel(page_counts, *partials, out, num_kv_heads=num_kv_heads, **split, **stats)
    return out


def attend(query, key_cache, value_cache, block_table, seq_lens, page_lists, page_counts, *,
           scale=None, config=None, workspace=None, out=None, page_stats=None):
    """Exact attention of every (request, KV head) row over the pages of its list.

    Parameters
    ----------
    page_lists : ``[batch, num_kv_heads, max_list]`` int32 logical page indices, each page at
        most once; tokens at or past ``seq_lens[b]`` are masked, and entries outside
        ``[0, max_pages_per_seq)`` read nothing.
    page_counts : ``[batch, num_kv_heads]`` int32, how many entries of each list are valid
        (0: the row's output is zeros).
    scale : softmax scale, default ``1 / sqrt(head_dim)``.
    config : the work split (C, N_J, N_T); with a ``workspace``, only its own config (or None).
    workspace : a ``DecodeWorkspace`` (required to capture the call in a CUDA graph).
    out : optional ``[batch, num_heads, head_dim]`` output tensor.
    page_stats : optional int64 ``[2]`` counters; the call adds (pages listed, pages in the
        rows) summed over all rows, on the GPU (graph-safe; read them whenever convenient).

    Returns
    -------
    out : ``[batch, num_heads, head_dim]``, the query's dtype.
    """
    batch, num_heads, num_kv_heads, head_dim = _check_step(query, key_cache, value_cache,
                                                           block_table, seq_lens)
    _check_tensors(page_lists=page_lists, page_counts=page_counts)
    _require(page_lists.dim() == 3 and page_lists.dtype == torch.int32
             and tuple(page_lists.shape[:2]) == (batch, num_kv_heads),
             f"page_lists must be int32 [batch={batch}, num_kv_heads={num_kv_heads}, max_list], "
             f"got {page_lists.dtype} of shape {tuple(page_lists.shape)}")
    _check_unit_stride(page_lists=page_lists)
    _require(page_counts.dtype == torch.int32
             and tuple(page_counts.shape) == (batch, num_kv_heads),
             f"page_counts must be int32 [batch={batch}, num_kv_heads={num_kv_heads}], got "
             f"{page_counts.dtype} of shape {tuple(page_counts.shape)}")
    _check_device(query=query, page_lists=page_lists, page_counts=page_counts)
    _check_out(out, query)
    _check_page_stats(page_stats, query)
    scale = _resolve_scale(scale, head_dim)
    _check_table_width(block_table)
    _check_config_fits(config, workspace)
    if workspace is None:
        workspace = DecodeWorkspace(batch, block_table.shape[1], num_heads, num_kv_heads,
                                    head_dim, device=query.device, config=config)
    workspace.check_fits(batch, num_heads, num_kv_heads, head_dim, block_table.shape[1],
                         query.device)
    out = torch.empty_like(query) if out is None else out
    return _attend_and_merge(query, key_cache, value_cache, block_table, seq_lens, page_lists,
                             page_counts, scale, workspace, out, page_stats)


def _check_table_width(block_table):
    _require(block_table.shape[1] >= 1,
             "block_table has no columns: a request needs at least one page")
    _require(block_table.shape[1] <= MAX_PAGES_PER_SEQ,
             f"block_table has {block_table.shape[1]} pages per request; Moira supports up to "
             f"{MAX_PAGES_PER_SEQ} ({MAX_PAGES_PER_SEQ * PAGE_SIZE:,} tokens): trim the table to "
             f"the pages in use")


def _check_config_fits(config, workspace):
    """A workspace carries its own config; a different one passed beside it would be ignored."""
    _require(config is None or isinstance(config, MoiraConfig),
             f"config must be a MoiraConfig, got {type(config).__name__}: pass MoiraConfig(...)")
    _require(workspace is None or isinstance(workspace, DecodeWorkspace),
             f"workspace must be a DecodeWorkspace, got {type(workspace).__name__}")
    if config is not None and workspace is not None and config != workspace.config:
        raise ValueError(f"config {config} differs from the workspace's {workspace.config}: "
                         f"pass only the workspace, or build it with this config "
                         f"(DecodeWorkspace(..., config=config))")


def _check_row_values(name, values, batch, num_kv_heads, query):
    """A float32 value per KV head or per (request, KV head), on the query's device."""
    _require(values.dtype == torch.float32
             and tuple(values.shape) in ((num_kv_heads,), (batch, num_kv_heads)),
             f"{name} must be a float32 tensor [num_kv_heads={num_kv_heads}] or "
             f"[batch={batch}, num_kv_heads={num_kv_heads}], got {values.dtype} of shape "
             f"{tuple(values.shape)}")
    _check_device(query=query, **{name: values})


def _estimate_and_select(query, key_cache, summaries, block_table, seq_lens, scale, log_masses,
                         page_lists, page_counts, new_kv, selection):
    """Estimate then Select (``selection``: ``_launch_select``'s keywords), in one launch
    where ``estimate_select_cuda.applies``, the Estimate runs in CUDA and the CUDA Select could
    take the inputs (the fused kernel replaces whichever Select ``select.IMPLEMENTATION``
    names; ``estimate_select_cuda.FUSED = "off"`` keeps it)."""
    num_kv_heads, max_pages = key_cache.shape[2], block_table.shape[1]
    rows, group = log_masses.shape[0], log_masses.shape[1]
    row_values, fractions, row_gammas = _select_module.row_values_of(
        selection["keep_fractions"], selection["gammas"], page_counts)
    if estimate_select_cuda.applies(rows, max_pages, group, selection["ways"],
                                    selection["programmatic_launch"]) \
            and _estimate_module.implementation(query, key_cache, summaries, block_table,
                                                seq_lens, new_kv, log_masses) == "cuda" \
            and _select_module.cuda_can_take(log_masses, seq_lens, page_lists, page_counts,
                                             max_pages, selection["ways"], row_values):
        estimate_select_cuda.estimate_select(
            query, key_cache, summaries, block_table, seq_lens, scale, log_masses, page_lists,
            page_counts, new_kv=new_kv, dense_below_pages=selection["dense_below_pages"],
            gamma=selection["gamma"], top_k=selection["top_k"], ways=selection["ways"],
            row_values=row_values, fractions=fractions, row_gammas=row_gammas,
            build_only=launch.building_only())
        return
    _launch_estimate(query, key_cache, summaries, block_table, seq_lens, scale, log_masses,
                     dense_below_pages=selection["dense_below_pages"],
                     programmatic_launch=selection["programmatic_launch"], new_kv=new_kv)
    _launch_select(log_masses, seq_lens, page_lists, page_counts, num_kv_heads=num_kv_heads,
                   max_pages=max_pages, **selection)


def sparse_decode(query, key_cache, value_cache, summaries, block_table, seq_lens, *,
                  gamma=None, top_k=None, keep_fractions=None, dense_below_pages=None,
                  scale=None, return_pages=False, config=None, workspace=None, out=None,
                  page_stats=None, planned_batch=None, new_keys=None, new_values=None,
                  slot_mapping=None):
    """One sparse decode step: Estimate -> Select -> Attend -> Merge.

    The step also summarizes each row's current page if it is full (``seq_lens`` a multiple of
    64: this step's token filled it), so decode steps need no ``update_summaries`` call; steps
    that write several tokens per row (prefill) do.

    Parameters
    ----------
    query : ``[batch, num_heads, head_dim]`` bf16/fp16, one token per request.
    key_cache, value_cache : ``[num_pages, 64, num_kv_heads, head_dim]``, any strides.
    summaries : ``[num_pages, num_kv_heads, 2, head_dim]`` from ``summarize`` /
        ``update_summaries``; every full page of every row but the current one must be
        summarized (the step writes the current page's summary when it is full).
    block_table : ``[batch, max_pages_per_seq]`` int32.
    seq_lens : ``[batch]`` int32, the current token included (0 = padded row, output zeros).
    gamma : coverage target in (0, 1]; default ``config.gamma`` (0.98). 1.0 keeps every page.
        Or per-row targets, float32 ``[num_kv_heads]`` or ``[batch, num_kv_heads]`` on the
        query's device (e.g. calibrated per head: ``moira calibrate``); their values are not
        checked here (that would read GPU memory), so keep them in (0, 1].
    top_k : fixed-count mode: keep this many pages per row (sink and current page included)
        instead of applying the coverage rule; default ``config.top_k`` (None).
    keep_fractions : fraction mode, float32 ``[num_kv_heads]`` or ``[batch, num_kv_heads]``:
        each row keeps ``max(2, floor(f * pages + 0.5))`` of its pages, the highest-share ones
        (budgets imposed for timing studies; the count is derived on the GPU from
        ``seq_lens``).
    dense_below_pages : rows of at most this many pages read every page and skip Estimate's
        and Select's work; default ``config.dense_below_pages`` (0 = off).
    scale : softmax scale, default ``1 / sqrt(head_dim)``.
    return_pages : also return the page lists and counts.
    config : a ``MoiraConfig`` (default: the paper's); with a ``workspace``, only its own
        config (or None).
    workspace : a ``DecodeWorkspace``; without one, buffers are allocated for this call. Pass
        one to capture the step in a CUDA graph.
    out : optional ``[batch, num_heads, head_dim]`` output tensor.
    page_stats : optional int64 ``[2]`` counters; the step adds (pages read, pages in the
        rows) summed over all rows, on the GPU (graph-safe).
    planned_batch : the batch size Attend plans its work split for, at least ``batch``
        (default ``batch``). How a row is split into chunks depends on how many rows the step
        has, and a CUDA graph captured for a padded batch replays that batch's split: an eager
        step that passes the same padded size computes bit-identical outputs.
    new_keys, new_values, slot_mapping : optional, together: this step's token of each request
        (``[batch, num_kv_heads, head_dim]``, the caches' dtype) and its cache slot
        (``page * 64 + offset``; int32/int64 ``[n]``, request ``b < n`` to slot
        ``slot_mapping[b]``, negative: not written, as vLLM pads). Estimate's launch writes
        them into the caches before any kernel reads them, in place of a separate cache-write
        kernel (vLLM's ``reshape_and_cache_flash``); without them the caches must already hold
        the token.

    Returns
    -------
    out : ``[batch, num_heads, head_dim]`` in the query's dtype; with ``return_pages``,
        ``(out, page_lists, page_counts)``: ``[batch, num_kv_heads, max_pages_per_seq]`` int32
        logical pages (sink first, current page last; entries past the count are unspecified)
        and ``[batch, num_kv_heads]`` int32. These are views into the workspace, overwritten
        by its next step.
    """
    batch, num_heads, num_kv_heads, head_dim = _check_step(query, key_cache, value_cache,
                                                           block_table, seq_lens)
    _check_summaries(summaries, key_cache)
    _check_out(out, query)
    _check_page_stats(page_stats, query)
    _require(planned_batch is None or (isinstance(planned_batch, int)
                                       and planned_batch >= batch),
             f"planned_batch must be an int >= the batch ({batch}), got {planned_batch!r}")
    if keep_fractions is not None:
        _check_row_values("keep_fractions", keep_fractions, batch, num_kv_heads, query)
        _require(top_k is None, "pass either top_k or keep_fractions, not both")
    gammas = None
    if torch.is_tensor(gamma):
        _check_row_values("gamma", gamma, batch, num_kv_heads, query)
        _require(top_k is None and keep_fractions is None,
                 "per-row gamma targets apply to the coverage rule: pass them without top_k or "
                 "keep_fractions")
        gamma, gammas = None, gamma
    max_pages = block_table.shape[1]
    _check_table_width(block_table)
    _check_config_fits(config, workspace)
    if workspace is None:
        workspace = DecodeWorkspace(batch, max_pages, num_heads, num_kv_heads, head_dim,
                                    device=query.device, config=config)
    workspace.check_fits(batch, num_heads, num_kv_heads, head_dim, max_pages, query.device)
    config = workspace.config
    overrides = {name: value for name, value in (("gamma", gamma), ("top_k", top_k),
                                                 ("dense_below_pages", dense_below_pages))
                 if value is not None}
    if overrides:  # validated by the config's own checks
        config = config.replace(**overrides)
    _require(gammas is None or config.top_k is None,
             "per-row gamma targets apply to the coverage rule, and this config sets top_k")
    _require(keep_fractions is None or config.top_k is None,
             f"keep_fractions and the config's top_k={config.top_k} both fix the page count: "
             f"pass a config without top_k")
    scale = _resolve_scale(scale, head_dim)
    out = torch.empty_like(query) if out is None else out

    new_kv = _check_new_tokens(new_keys, new_values, slot_mapping, key_cache, value_cache,
                               batch)
    log_masses, page_lists, page_counts = workspace.selection_buffers(batch, max_pages)
    selection = dict(gamma=config.gamma,
                     top_k=None if keep_fractions is not None else config.top_k,
                     ways=config.bisection_ways_for(max_pages), keep_fractions=keep_fractions,
                     gammas=gammas, dense_below_pages=config.dense_below_pages,
                     programmatic_launch=config.programmatic_launch)
    _estimate_and_select(query, key_cache, summaries, block_table, seq_lens, scale, log_masses,
                         page_lists, page_counts, new_kv, selection)
    _attend_and_merge(query, key_cache, value_cache, block_table, seq_lens, page_lists,
                      page_counts, scale, workspace, out, page_stats, planned_batch)
    return (out, page_lists, page_counts) if return_pages else out
