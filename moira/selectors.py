"""Page selectors other than Moira's coverage rule, for baselines and ablations.

Each returns ``(page_lists [batch, num_kv_heads, max_pages] int32, page_counts [batch,
num_kv_heads] int32)`` in the format of ``moira.sparse_decode(return_pages=True)`` (logical
pages in increasing order, so the sink comes first and the current page last), to be read by
``moira.attend``. They are plain PyTorch on any device, with fixed shapes and no host sync
(usable inside a CUDA graph), but unfused: meant for comparisons, not for speed.

- ``window``: the sink pages plus the most recent pages (StreamingLLM / DuoAttention style).
- ``quest``: Quest's bound (Tang et al., 2024): per page and channel the min and max key,
  ``bound = sum_d max(q_d min_d, q_d max_d)``, an upper bound of any key's logit in the page;
  each row keeps the sink, the current page and the pages with the largest bound over the
  group's query heads, ``top_k`` pages in all.
"""

from __future__ import annotations

import torch

from .config import PAGE_SIZE


def _pages_per_row(seq_lens, max_pages):
    return torch.clamp((seq_lens.long() + PAGE_SIZE - 1) // PAGE_SIZE, max=max_pages)


def _compact(keep):
    """``keep`` ``[batch, kv_heads, max_pages]`` bool -> (lists in increasing page order,
    counts); entries past the count are unspecified."""
    max_pages = keep.shape[-1]
    pages = torch.arange(max_pages, device=keep.device)
    order = torch.where(keep, pages, pages + max_pages)  # kept pages sort first, in order
    page_lists = torch.sort(order, dim=-1).values % max_pages
    return page_lists.to(torch.int32), keep.sum(-1).to(torch.int32)


def window(seq_lens, num_kv_heads, max_pages, *, sink_pages=1, recent_pages=8):
    """Keep the first ``sink_pages`` and the last ``recent_pages`` pages of every row."""
    pages = torch.arange(max_pages, device=seq_lens.device)
    count = _pages_per_row(seq_lens, max_pages)[:, None]
    keep = (pages < count) & ((pages < sink_pages) | (pages >= count - recent_pages))
    return _compact(keep[:, None, :].expand(-1, num_kv_heads, -1))


def quest_summaries(key_cache, block_table, seq_lens, summaries=None):
    """Per-channel min and max of the keys of every full page: ``[num_pages, num_kv_heads, 2,
    head_dim]`` (index 0 = min, 1 = max), float32 unless a tensor is passed in."""
    num_pages, _, num_kv_heads, head_dim = key_cache.shape
    if summaries is None:
        summaries = torch.zeros(num_pages, num_kv_heads, 2, head_dim, device=key_cache.device)
    full = torch.arange(block_table.shape[1], device=block_table.device)[None, :] \
        < (seq_lens.long() // PAGE_SIZE)[:, None]
    pages = block_table[full].long()
    keys = key_cache[pages].float()  # [pages, 64, kv_heads, head_dim]
    summaries[pages, :, 0] = keys.amin(dim=1).to(summaries.dtype)
    summaries[pages, :, 1] = keys.amax(dim=1).to(summaries.dtype)
    return summaries


def quest(query, summaries, block_table, seq_lens, top_k):
    """Quest's selection, one list per KV head: the sink, the current page and the pages of
    largest bound (maximum over the group's query heads), ``top_k`` pages per row in all.

    ``query`` ``[batch, num_heads, head_dim]``; ``summaries`` from ``quest_summaries``.
    """
    batch, num_heads, head_dim = query.shape
    num_kv_heads = summaries.shape[1]
    max_pages = block_table.shape[1]
    q = query.float().view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    box = summaries[block_table.long()].float()  # [batch, pages, kv_heads, 2, head_dim]
    # max(q_d lo_d, q_d hi_d) = relu(q_d) hi_d + min(q_d, 0) lo_d: two products, no [.., D] max
    bound = torch.einsum("bhgd,bphd->bhgp", q.clamp(min=0), box[..., 1, :]) \
        + torch.einsum("bhgd,bphd->bhgp", q.clamp(max=0), box[..., 0, :])
    bound = bound.amax(dim=2)  # [batch, kv_heads, pages]
    pages = torch.arange(max_pages, device=query.device)
    count = _pages_per_row(seq_lens, max_pages)[:, None, None]
    forced = (pages == 0) | (pages == count - 1)
    bound = torch.where(forced, torch.inf, torch.where(pages < count, bound, -torch.inf))
    chosen = torch.topk(bound, min(top_k, max_pages), dim=-1).indices
    keep = torch.zeros_like(bound, dtype=torch.bool).scatter_(-1, chosen, True) & (pages < count)
    return _compact(keep)
