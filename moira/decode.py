"""The public API: page summaries, the graph-safe sparse decode step, and attention over any
selector's page lists.

Tensor conventions (vLLM's):

- ``query`` / ``out``: ``[batch, num_heads, head_dim]``, bf16 or fp16. Query head ``h * G + g``
  belongs to KV head ``h`` (G = num_heads / num_kv_heads).
- ``key_cache`` / ``value_cache``: ``[num_pages, 64, num_kv_heads, head_dim]``, the query's
  dtype, any strides (views of vLLM's packed ``[..., 2 * head_dim]`` K|V tensor work).
- ``block_table``: ``[batch, max_pages_per_seq]`` int32 physical page ids.
- ``seq_lens``: ``[batch]`` int32, tokens in the cache per request, the current token included
  (already written). 0 or a negative length marks a padded row: it reads no page, its output
  is zeros and its page count 0. Values are not checked on the host (that would sync); a row's
  pages are clamped to the block table's width.
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

import torch

from . import checks
from .config import (
    ESTIMATOR_BITS,
    MAX_PAGES_PER_SEQ,
    SUPPORTED_HEAD_DIMS,
    MoiraConfig,
    summary_rows,
)
from .kernels import backends, launch
from .kernels import split as work_split
from .kernels.cuda import attend as cuda_attend
from .kernels.cuda import build as cuda_build
from .kernels.cuda import estimate as cuda_estimate
from .kernels.cuda import estimate_select as cuda_estimate_select
from .kernels.cuda import select as cuda_select
from .kernels.triton import attend as triton_attend
from .kernels.triton import balanced as triton_balanced
from .kernels.triton import estimate as triton_estimate
from .kernels.triton import merge as triton_merge
from .kernels.triton import select as triton_select
from .kernels.triton.summarize import summarize_filled_slots, summarize_pages

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

    ``backends`` says which kernel each stage runs here (``config.kernels`` resolved for the
    device once, at creation; an explicit "cuda" that cannot run on it raises then).
    """

    def __init__(self, max_batch, max_pages_per_seq, num_heads, num_kv_heads, head_dim, *,
                 device, config=None):
        checks.require(config is None or isinstance(config, MoiraConfig),
                       f"config must be a MoiraConfig, got {type(config).__name__}: pass "
                       f"MoiraConfig(...)")
        self.config = config or MoiraConfig()
        for name, value in (("max_batch", max_batch), ("num_heads", num_heads),
                            ("num_kv_heads", num_kv_heads)):
            checks.require(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                           f"{name} must be a positive int, got {value!r}")
        checks.require(isinstance(max_pages_per_seq, int)
                       and 1 <= max_pages_per_seq <= MAX_PAGES_PER_SEQ,
                       f"max_pages_per_seq must be an int in [1, {MAX_PAGES_PER_SEQ}], got "
                       f"{max_pages_per_seq!r}")
        checks.require(num_heads % num_kv_heads == 0,
                       f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
        checks.require(head_dim in SUPPORTED_HEAD_DIMS,
                       f"head_dim {head_dim} has no kernel; supported: {SUPPORTED_HEAD_DIMS}")
        if self.config.programmatic_launch and torch.device(device).type == "cuda":
            capability = torch.cuda.get_device_capability(device)
            checks.require(capability >= (9, 0),
                           f"programmatic_launch needs a Hopper-or-newer GPU (sm_90+); "
                           f"{torch.cuda.get_device_name(device)} is "
                           f"sm_{capability[0]}{capability[1]}: set programmatic_launch=False")
        self.backends = backends.resolve(self.config.kernels, device, head_dim,
                                         num_heads // num_kv_heads, self.config.schedule,
                                         self.config.estimator)
        """The kernel each stage runs on this workspace's device: ``{"estimate", "select",
        "attend": "cuda" | "triton", "fused": "auto" | "on" | "off"}`` (``KernelOptions``
        resolved; a call the CUDA kernel cannot take runs Triton under "auto")."""
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
        checks.require(batch <= self.max_batch,
                       f"workspace holds {self.max_batch} requests, the step has {batch}: "
                       f"build the DecodeWorkspace with a larger max_batch")
        checks.require(max_pages <= self.max_pages_per_seq,
                       f"workspace holds {self.max_pages_per_seq} pages per request, "
                       f"block_table has {max_pages}: build the DecodeWorkspace with a larger "
                       f"max_pages_per_seq")
        checks.require((num_kv_heads, num_heads // num_kv_heads, head_dim)
                       == (self.num_kv_heads, self.group, self.head_dim),
                       f"workspace was built for {self.num_kv_heads} KV heads, G={self.group}, "
                       f"head_dim={self.head_dim}; the step has {num_kv_heads}, "
                       f"{num_heads // num_kv_heads}, {head_dim}")
        checks.require(device == self.page_counts.device,
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


def summarize(key_cache, block_table, seq_lens, summaries=None, *, estimator="mvar"):
    """Write the summary of every full page that ``block_table`` references.

    Parameters
    ----------
    key_cache : ``[num_pages, 64, num_kv_heads, head_dim]`` bf16/fp16, any strides.
    block_table : ``[batch, max_pages_per_seq]`` int32.
    seq_lens : ``[batch]`` int32; logical page p of request b is summarized if
        ``64 * (p + 1) <= seq_lens[b]``. Partial pages are left untouched.
    summaries : optional ``[num_pages, num_kv_heads, rows, head_dim]`` float32/bf16/fp16 to
        write into (pages no full page of the table lands on keep their values); by default a
        new tensor of the cache's dtype, zeros where no full page lands (an empty batch
        returns all zeros). ``rows = moira.config.summary_rows(estimator, itemsize)``.
    estimator : the ``MoiraConfig.estimator`` the summaries are for.

    Returns
    -------
    summaries : ``"mvar"``: ``[..., 0, :]`` the per-channel mean, ``[..., 1, :]`` the
        population variance of the page's 64 keys. ``"int2"`` / ``"int4"``: the per-channel
        min and max, then the keys' codes as bytes (``moira.config.summary_rows``).
    """
    checks.cache(key_cache, None)
    checks.table(block_table, seq_lens)
    checks.estimator(estimator)
    if summaries is None:
        num_pages, _, num_kv_heads, head_dim = key_cache.shape
        rows = summary_rows(estimator, key_cache.element_size())
        summaries = torch.zeros(num_pages, num_kv_heads, rows, head_dim, dtype=key_cache.dtype,
                                device=key_cache.device)
    checks.summaries(summaries, key_cache, estimator)
    checks.device(key_cache=key_cache, block_table=block_table, seq_lens=seq_lens)
    return summarize_pages(key_cache, block_table, seq_lens, summaries,
                           ESTIMATOR_BITS[estimator])


def update_summaries(key_cache, slot_mapping, summaries, *, estimator="mvar"):
    """Summarize the pages that the slots just written have filled (graph-safe).

    ``slot_mapping`` ``[num_tokens]`` int32/int64 holds each written token's cache slot
    ``page * 64 + offset`` (vLLM's slot mapping; negative entries are padding). Every page whose
    last slot (offset 63) appears is summarized from the cache, so call this after the keys are
    written. ``estimator``: as for ``summarize``. Returns ``summaries``.
    """
    checks.cache(key_cache, None)
    checks.slots(slot_mapping)
    checks.summaries(summaries, key_cache, estimator)
    checks.device(key_cache=key_cache, slot_mapping=slot_mapping)
    return summarize_filled_slots(key_cache, slot_mapping, summaries, ESTIMATOR_BITS[estimator])


def _attend_and_merge(query, key_cache, value_cache, block_table, seq_lens, page_lists,
                      page_counts, scale, workspace, out, page_stats=None, planned_batch=None):
    config, options = workspace.config, workspace.config.kernels
    partial_out, partial_lse = workspace.partial_out, workspace.partial_lse
    stats = dict(seq_lens=seq_lens, max_pages=block_table.shape[1], page_stats=page_stats)
    inputs = (query, key_cache, value_cache, block_table, seq_lens, page_lists, page_counts)
    num_kv_heads = key_cache.shape[2]
    if config.schedule == "balanced":
        split = dict(min_pages=config.chunk_pages, programs=config.programs)
        triton_balanced.attend_balanced(*inputs, scale=scale, out=out, partial_out=partial_out,
                                        partial_lse=partial_lse, options=options, **split)
        triton_balanced.merge_balanced(page_counts, partial_out, partial_lse, out,
                                       num_kv_heads=num_kv_heads, **split, **stats)
        return out
    # planned for the padded batch of a captured graph, so that an eager step of fewer
    # requests splits each row exactly as the replay does
    rows = (planned_batch or query.shape[0]) * num_kv_heads
    split = work_split.rows_plan(config, rows, block_table.shape[1])
    runs = backends.attend(workspace, query, key_cache, value_cache)
    if runs == "cuda":
        try:  # a kernel that cannot be built: Triton's under "auto" (backends.build_failed)
            cuda_attend.attend(
                *inputs, qk_scale_log2=scale * math.log2(math.e), out=out,
                partial_out=partial_out, partial_lse=partial_lse,
                short_pages=work_split.short_row_pages(split["chunk_floor"], rows,
                                                       config.step_programs),
                stages=options.value("attend.cuda_stages"), build_only=launch.building_only(),
                **split)
        except cuda_build.BuildError as error:
            runs = backends.build_failed(workspace, "attend", error)
    if runs == "triton":
        triton_attend.attend(*inputs, scale=scale, out=out, partial_out=partial_out,
                             partial_lse=partial_lse, options=options,
                             programmatic_launch=config.programmatic_launch, **split)
    triton_merge.merge(page_counts, partial_out, partial_lse, out, num_kv_heads=num_kv_heads,
                       programmatic_launch=config.programmatic_launch,
                       even_chunks=options.value("attend.even_chunks"),
                       chained=options.value("launch.chained"), **split, **stats)
    return out


def attend(query, key_cache, value_cache, block_table, seq_lens, page_lists, page_counts, *,
           scale=None, config=None, workspace=None, out=None, page_stats=None):
    """Exact attention of every (request, KV head) row over the pages of its list.

    Parameters
    ----------
    page_lists : ``[batch, num_kv_heads, max_list]`` int32 logical page indices, each page at
        most once (a ValueError otherwise; not checked while a CUDA graph is captured, where
        the check's synchronization is not allowed); tokens at or past ``seq_lens[b]`` are
        masked, and entries outside ``[0, max_pages_per_seq)`` read nothing.
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
    batch, num_heads, num_kv_heads, head_dim = checks.step(query, key_cache, value_cache,
                                                           block_table, seq_lens)
    checks.tensors(page_lists=page_lists, page_counts=page_counts)
    checks.require(page_lists.dim() == 3 and page_lists.dtype == torch.int32
                   and tuple(page_lists.shape[:2]) == (batch, num_kv_heads),
                   f"page_lists must be int32 [batch={batch}, num_kv_heads={num_kv_heads}, "
                   f"max_list], got {page_lists.dtype} of shape {tuple(page_lists.shape)}")
    checks.unit_stride(page_lists=page_lists)
    checks.require(page_counts.dtype == torch.int32
                   and tuple(page_counts.shape) == (batch, num_kv_heads),
                   f"page_counts must be int32 [batch={batch}, num_kv_heads={num_kv_heads}], got "
                   f"{page_counts.dtype} of shape {tuple(page_counts.shape)}")
    checks.device(query=query, page_lists=page_lists, page_counts=page_counts)
    checks.out(out, query)
    checks.page_stats(page_stats, query)
    scale = checks.scale(scale, head_dim)
    checks.table_width(block_table)
    checks.distinct_pages(page_lists, page_counts, seq_lens, block_table.shape[1])
    _check_config_fits(config, workspace)
    if workspace is None:
        workspace = DecodeWorkspace(batch, block_table.shape[1], num_heads, num_kv_heads,
                                    head_dim, device=query.device, config=config)
    workspace.check_fits(batch, num_heads, num_kv_heads, head_dim, block_table.shape[1],
                         query.device)
    out = torch.empty_like(query) if out is None else out
    return _attend_and_merge(query, key_cache, value_cache, block_table, seq_lens, page_lists,
                             page_counts, scale, workspace, out, page_stats)


def _check_config_fits(config, workspace):
    """A workspace carries its own config; a different one passed beside it would be ignored."""
    checks.require(config is None or isinstance(config, MoiraConfig),
                   f"config must be a MoiraConfig, got {type(config).__name__}: pass "
                   f"MoiraConfig(...)")
    checks.require(workspace is None or isinstance(workspace, DecodeWorkspace),
                   f"workspace must be a DecodeWorkspace, got {type(workspace).__name__}")
    if config is not None and workspace is not None and config != workspace.config:
        raise ValueError(f"config {config} differs from the workspace's {workspace.config}: "
                         f"pass only the workspace, or build it with this config "
                         f"(DecodeWorkspace(..., config=config))")


def _estimate_and_select(query, key_cache, summaries, block_table, seq_lens, scale, log_masses,
                         page_lists, page_counts, new_kv, selection, workspace):
    """Estimate then Select (``selection``: the Select launchers' keywords), in one CUDA launch
    where ``backends.fused`` holds (it then replaces whichever Select is configured)."""
    options = workspace.config.kernels
    num_kv_heads, max_pages = key_cache.shape[2], block_table.shape[1]
    ways, pdl = selection["ways"], selection["programmatic_launch"]
    dense_below_pages = selection["dense_below_pages"]
    row_values, fractions, row_gammas = triton_select.row_values_of(
        selection["keep_fractions"], selection["gammas"], page_counts)
    estimate_runs = backends.estimate(workspace, query, key_cache, summaries, block_table,
                                      seq_lens, new_kv, log_masses)
    rule = dict(gamma=selection["gamma"], top_k=selection["top_k"], ways=ways,
                row_values=row_values, fractions=fractions, row_gammas=row_gammas,
                dense_below_pages=dense_below_pages, build_only=launch.building_only())
    # a CUDA kernel that cannot be built or loaded raises at its first launch, before it
    # writes anything: Triton's runs instead under "auto" (backends.build_failed)
    if backends.fused(workspace, estimate_runs, log_masses, seq_lens, page_lists, page_counts,
                      max_pages, ways, row_values, pdl):
        try:
            cuda_estimate_select.estimate_select(
                query, key_cache, summaries, block_table, seq_lens, scale, log_masses,
                page_lists, page_counts, new_kv=new_kv, **rule)
            return
        except cuda_build.BuildError as error:
            backends.build_failed(workspace, "fused", error)
    if estimate_runs == "cuda":
        try:
            cuda_estimate.estimate(query, key_cache, summaries, block_table, seq_lens, scale,
                                   log_masses, options=options,
                                   dense_below_pages=dense_below_pages, new_kv=new_kv,
                                   build_only=launch.building_only())
        except cuda_build.BuildError as error:
            estimate_runs = backends.build_failed(workspace, "estimate", error)
    if estimate_runs == "triton":
        triton_estimate.estimate(query, key_cache, summaries, block_table, seq_lens, scale,
                                 log_masses, options, dense_below_pages=dense_below_pages,
                                 programmatic_launch=pdl, new_kv=new_kv,
                                 bits=ESTIMATOR_BITS[workspace.config.estimator])
    select_runs = backends.select(workspace, log_masses, seq_lens, page_lists, page_counts,
                                  max_pages, ways, row_values)
    if select_runs == "cuda":
        try:
            cuda_select.select(log_masses, seq_lens, page_lists, page_counts,
                               num_kv_heads=num_kv_heads, max_pages=max_pages, **rule)
        except cuda_build.BuildError as error:
            select_runs = backends.build_failed(workspace, "select", error)
    if select_runs == "triton":
        triton_select.select(log_masses, seq_lens, page_lists, page_counts,
                             num_kv_heads=num_kv_heads, max_pages=max_pages, options=options,
                             **selection)


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
    summaries : ``[num_pages, num_kv_heads, rows, head_dim]`` from ``summarize`` /
        ``update_summaries`` for ``config.estimator``; every full page of every row but the
        current one must be summarized (the step writes the current page's summary when it is
        full).
    block_table : ``[batch, max_pages_per_seq]`` int32.
    seq_lens : ``[batch]`` int32, the current token included (0 or negative = padded row,
        output zeros).
    gamma : coverage target in (0, 1]; default ``config.gamma`` (0.98). 1.0 keeps every page.
        Not with ``top_k`` (a ValueError: the count would override it). Or per-row targets,
        float32 ``[num_kv_heads]`` or ``[batch, num_kv_heads]`` on the query's device (e.g.
        calibrated per head: ``moira calibrate``): checked to lie in (0, 1] where they are in
        host memory; on a GPU they are not read here (that would sync), and the kernels
        saturate: a target of 1 or more keeps every page, one at or below the sink's and
        current page's shares keeps those two (docs/design/select.md).
    top_k : fixed-count mode: keep this many pages per row (sink and current page included)
        instead of applying the coverage rule; default ``config.top_k`` (None).
    keep_fractions : fraction mode, float32 ``[num_kv_heads]`` or ``[batch, num_kv_heads]``:
        each row keeps ``max(2, floor(f * pages + 0.5))`` of its pages, the highest-share ones
        (budgets imposed for timing studies; the count is derived on the GPU from
        ``seq_lens``). Checked to lie in (0, 1] in host memory; on a GPU a fraction of 1 or
        more keeps every page, one of 0 or less two pages.
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
    batch, num_heads, num_kv_heads, head_dim = checks.step(query, key_cache, value_cache,
                                                           block_table, seq_lens)
    checks.out(out, query)
    checks.page_stats(page_stats, query)
    checks.require(planned_batch is None or (isinstance(planned_batch, int)
                                       and planned_batch >= batch),
                   f"planned_batch must be an int >= the batch ({batch}), got {planned_batch!r}")
    checks.require(gamma is None or torch.is_tensor(gamma) or top_k is None,
                   f"pass either gamma ({gamma!r}) or top_k ({top_k!r}), not both: top_k fixes "
                   f"the page count, and gamma would be ignored")
    if keep_fractions is not None:
        checks.row_values("keep_fractions", keep_fractions, batch, num_kv_heads, query)
        checks.require(top_k is None, "pass either top_k or keep_fractions, not both")
    gammas = None
    if torch.is_tensor(gamma):
        checks.row_values("gamma", gamma, batch, num_kv_heads, query)
        checks.require(top_k is None and keep_fractions is None,
                       "per-row gamma targets apply to the coverage rule: pass them without "
                       "top_k or keep_fractions")
        gamma, gammas = None, gamma
    max_pages = block_table.shape[1]
    checks.table_width(block_table)
    _check_config_fits(config, workspace)
    if workspace is None:
        workspace = DecodeWorkspace(batch, max_pages, num_heads, num_kv_heads, head_dim,
                                    device=query.device, config=config)
    workspace.check_fits(batch, num_heads, num_kv_heads, head_dim, max_pages, query.device)
    config = workspace.config
    checks.summaries(summaries, key_cache, config.estimator)
    overrides = {name: value for name, value in (("gamma", gamma), ("top_k", top_k),
                                                 ("dense_below_pages", dense_below_pages))
                 if value is not None}
    if overrides:  # validated by the config's own checks
        config = config.replace(**overrides)
    checks.require(gammas is None or config.top_k is None,
                   "per-row gamma targets apply to the coverage rule, and this config sets top_k")
    checks.require(gamma is None or config.top_k is None,
                   f"gamma={gamma!r} applies to the coverage rule, and the config's "
                   f"top_k={config.top_k} fixes the page count: pass a config without top_k")
    checks.require(keep_fractions is None or config.top_k is None,
                   f"keep_fractions and the config's top_k={config.top_k} both fix the page count: "
                   f"pass a config without top_k")
    scale = checks.scale(scale, head_dim)
    out = torch.empty_like(query) if out is None else out

    new_kv = checks.new_tokens(new_keys, new_values, slot_mapping, key_cache, value_cache,
                               batch)
    log_masses, page_lists, page_counts = workspace.selection_buffers(batch, max_pages)
    selection = dict(gamma=config.gamma,
                     top_k=None if keep_fractions is not None else config.top_k,
                     ways=config.bisection_ways_for(max_pages), keep_fractions=keep_fractions,
                     gammas=gammas, dense_below_pages=config.dense_below_pages,
                     programmatic_launch=config.programmatic_launch)
    _estimate_and_select(query, key_cache, summaries, block_table, seq_lens, scale, log_masses,
                         page_lists, page_counts, new_kv, selection, workspace)
    _attend_and_merge(query, key_cache, value_cache, block_table, seq_lens, page_lists,
                      page_counts, scale, workspace, out, page_stats, planned_batch)
    return (out, page_lists, page_counts) if return_pages else out
