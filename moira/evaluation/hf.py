"""Moira's float32 reference as a transformers attention function.

After ``register()``, a model loaded with ``attn_implementation="moira"`` runs exactly as in
serving: prefill (several query tokens) is dense, through PyTorch's causal SDPA; each
decode step (one query token) runs dense too, unless a ``SparseDecoding`` is active, in which
case it runs Moira's Estimate -> Select -> Attend from ``moira.reference`` over a paged view
of the layer's KV cache, and counts the pages it reads.

    register()
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="moira")
    with SparseDecoding(gamma=0.98) as sparse:
        ...                             # decode steps of the model are sparse here
    sparse.read_fraction                # pages read / pages in the cache, over layers and steps

Only unpadded batches are supported (the eval harness runs one sequence at a time), and a
multi-token forward must start from an empty cache (no chunked prefill).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import reference
from ..config import PAGE_SIZE

ATTENTION_NAME = "moira"
_active: SparseDecoding | None = None


ESTIMATORS = ("mvar", "int2", "int4", "mean")


def moira_pages(query, key_cache, block_table, seq_lens, scale, *, gamma=0.98, top_k=None,
                estimator="mvar"):
    """Moira's Estimate -> Select (``moira.reference``): ``(page_lists, page_counts)``, with
    ``MoiraConfig.estimator``'s choices (float32 summaries); ``estimator="mean"`` drops the
    variance term of Eq. 2 (the ablation)."""
    shipped = "mvar" if estimator == "mean" else estimator
    summaries = reference.summarize(key_cache, block_table, seq_lens, estimator=shipped)
    if estimator == "mean":
        summaries[:, :, 1] = 0.0
    log_masses = reference.estimate(query, key_cache, summaries, block_table, seq_lens, scale,
                                    shipped)
    return reference.select(log_masses, seq_lens, gamma=gamma, top_k=top_k)


class SparseDecoding:
    """How decode steps select pages, and the pages they read.

    Parameters
    ----------
    gamma, top_k, estimator : Moira's selection (``moira_pages``): coverage target, or a fixed
        count per row (int or ``[batch, kv_heads]``), and the estimator (``ESTIMATORS``).
    select : instead, any ``select(layer, query [batch, heads, D], key_cache, block_table,
        seq_lens, scale) -> (page_lists, page_counts)`` (e.g. ``moira.selectors``).
    observe : called with the same arguments before selecting (e.g. to record oracle sets).
    record_rows : keep every step's ``(layer, page_counts [batch, kv_heads], pages per row)``
        in ``rows``.
    """

    def __init__(self, gamma=0.98, top_k=None, estimator="mvar", *, select=None, observe=None,
                 record_rows=False):
        if estimator not in ESTIMATORS:
            raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")
        self.select = select or (lambda layer, *inputs: moira_pages(
            *inputs, gamma=gamma, top_k=top_k, estimator=estimator))
        self.observe = observe
        self.record_rows = record_rows
        self.pages_read = 0
        self.pages_total = 0
        self.rows = []

    @property
    def read_fraction(self):
        return self.pages_read / max(self.pages_total, 1)

    def __enter__(self):
        global _active
        if _active is not None:
            raise RuntimeError("a SparseDecoding is already active")
        _active = self
        return self

    def __exit__(self, *exc):
        global _active
        _active = None

    def decode(self, layer, query, key, value, scale):
        """One decode step of one layer: ``query`` ``[batch, heads, 1, D]``, ``key``/``value``
        ``[batch, kv_heads, tokens, D]`` (the whole cache, current token included)."""
        key_cache, value_cache, block_table, seq_lens = paged_view(key, value)
        inputs = (query[:, :, 0], key_cache, block_table, seq_lens, scale)
        if self.observe is not None:
            self.observe(layer, *inputs)
        page_lists, page_counts = self.select(layer, *inputs)
        out = reference.attend(query[:, :, 0], key_cache, value_cache, block_table, seq_lens,
                               page_lists, page_counts, scale=scale)
        pages = block_table.shape[1]
        self.pages_read += int(page_counts.sum())
        self.pages_total += page_counts.numel() * pages
        if self.record_rows:
            self.rows.append((layer, page_counts.cpu(), pages))
        return out.to(query.dtype).unsqueeze(1)  # [batch, 1, heads, D], transformers' layout


def paged_view(key, value):
    """Copy a contiguous cache ``[batch, kv_heads, tokens, D]`` into Moira's paged layout:
    ``(key_cache, value_cache [batch * pages, 64, kv_heads, D], block_table [batch, pages],
    seq_lens [batch])``, request b owning pages ``b * pages ...``; the last page is zero-padded.
    """
    batch, num_kv_heads, tokens, head_dim = key.shape
    pages = -(-tokens // PAGE_SIZE)

    def to_pages(x):
        x = F.pad(x, (0, 0, 0, pages * PAGE_SIZE - tokens))
        x = x.view(batch, num_kv_heads, pages, PAGE_SIZE, head_dim).permute(0, 2, 3, 1, 4)
        return x.reshape(batch * pages, PAGE_SIZE, num_kv_heads, head_dim)

    block_table = torch.arange(batch * pages, dtype=torch.int32, device=key.device)
    seq_lens = torch.full((batch,), tokens, dtype=torch.int32, device=key.device)
    return to_pages(key), to_pages(value), block_table.view(batch, pages), seq_lens


def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The ``"moira"`` attention function (transformers' AttentionInterface signature)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if query.shape[2] > 1 and key.shape[2] != query.shape[2]:
        raise ValueError("moira attention: a multi-token forward must start from an empty cache "
                         "(chunked prefill is not supported by this harness)")
    if query.shape[2] > 1:
        # Prefill of one unpadded sequence: plain causal SDPA, with no materialized mask, so
        # PyTorch can pick its memory-efficient kernel (a 32k-token float32 prefill on the math
        # path holds 14 x 32k x 32k floats, > 100 GB)
        if query.shape[0] != 1:
            raise ValueError("moira attention: this harness runs one unpadded sequence at a "
                             f"time, got a batch of {query.shape[0]}")
        if getattr(module, "sliding_window", None) or kwargs.get("softcap"):
            raise ValueError("moira attention: sliding-window or soft-capped attention is not "
                             "supported (Moira's decode path has neither)")
        # K/V expanded to every query head: PyTorch's memory-efficient kernel, the one that
        # takes float32, refuses grouped-query inputs (enable_gqa) and would fall back to math
        group = query.shape[1] // key.shape[1]
        key, value = (x.repeat_interleave(group, dim=1) for x in (key, value))
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
        return out.transpose(1, 2).contiguous(), None
    if _active is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return _active.decode(module.layer_idx, query, key, value, scale), None


def register():
    """Make ``attn_implementation="moira"`` available to transformers models."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, attention)
