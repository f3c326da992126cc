"""A synthetic long context whose attention has the structure of real models' decode steps.

Random keys give nearly uniform attention, which says nothing about selection. Here each KV
head gets a profile, and its keys are built so that the current query's attention has:

- an attention sink (the first tokens draw a large share),
- a local window (recent tokens draw more, decaying with distance),
- a few scattered "needle" pages, where one or two outlying keys carry most of the page's mass
  (what the variance term of mvar is for: the page mean hides them),
- a diffuse background whose spread differs per head, and
- a few outlier key channels with large values on every token, as in trained models.

Logits are controlled through one direction u per KV head, supported on a few channels: the
group's queries point along u (with per-query-head noise), and key t carries
``relevance[t] * u / (scale * sqrt(D))`` plus noise, so the logit of key t is about
``relevance[t]``.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .config import PAGE_SIZE

# Per-profile logits: sink (first 4 tokens), local window (peak, tokens), needle passages (pages,
# tokens per passage, logit), background (std of a per-page offset, std per token).
PROFILES = {
    "sink+local": dict(sink=11.0, window=7.0, window_tokens=512, needles=0, passage=0,
                       needle=0.0, page_std=1.2, token_std=0.5),
    "retrieval": dict(sink=8.0, window=4.0, window_tokens=128, needles=6, passage=16,
                      needle=8.0, page_std=1.0, token_std=0.5),
    "diffuse": dict(sink=3.0, window=1.0, window_tokens=128, needles=0, passage=0,
                    needle=0.0, page_std=0.3, token_std=0.3),
    "heavy-tail": dict(sink=7.0, window=3.0, window_tokens=256, needles=2, passage=8,
                       needle=6.0, page_std=2.0, token_std=0.8),
}


@dataclasses.dataclass
class SyntheticContext:
    """Inputs of one decode step (see ``moira.decode`` for the layouts)."""

    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    profiles: list[str]  # per KV head


def _relevance(context_len, profile, generator):
    """Target logit of every token of one row."""
    p = PROFILES[profile]
    pages = -(-context_len // PAGE_SIZE)
    page_offset = torch.randn(pages, generator=generator) * p["page_std"]
    relevance = page_offset.repeat_interleave(PAGE_SIZE)[:context_len]
    relevance += torch.randn(context_len, generator=generator) * p["token_std"]
    relevance[: min(4, context_len)] += p["sink"]
    distance = torch.arange(context_len - 1, -1, -1, dtype=torch.float32)
    window = p["window_tokens"]
    relevance += p["window"] * torch.exp(-3 * distance / window) * (distance < window)
    if p["needles"] and pages > 4:
        for page in (torch.randperm(pages - 3, generator=generator)[: p["needles"]] + 1).tolist():
            start = page * PAGE_SIZE + int(torch.randint(0, PAGE_SIZE - p["passage"] + 1, (1,),
                                                         generator=generator))
            relevance[start : start + p["passage"]] += p["needle"]
    return relevance


def synthetic_context(context_len=16384, *, batch=1, num_kv_heads=4, group=4, head_dim=64,
                      dtype=torch.bfloat16, device="cpu", seed=0, spare_pages=7):
    """Build a paged KV cache, block table and query with realistic attention structure.

    Rows get ``context_len`` tokens minus a few per request (so lengths differ and the last
    page is partial); KV head h gets profile ``list(PROFILES)[h % 4]``. Physical pages are
    shuffled, and ``spare_pages`` unused pages are allocated besides.
    """
    generator = torch.Generator().manual_seed(seed)
    scale = 1.0 / math.sqrt(head_dim)
    lengths = [max(1, context_len - 37 * b) for b in range(batch)]
    max_pages = -(-max(lengths) // PAGE_SIZE)
    total_pages = batch * max_pages + spare_pages
    profiles = [list(PROFILES)[h % len(PROFILES)] for h in range(num_kv_heads)]

    keys = torch.randn(total_pages, PAGE_SIZE, num_kv_heads, head_dim, generator=generator)
    values = torch.randn(total_pages, PAGE_SIZE, num_kv_heads, head_dim, generator=generator)
    values += torch.randn(num_kv_heads, head_dim, generator=generator)  # values share a mean
    outlier_channels = torch.randperm(head_dim, generator=generator)[:3]
    keys[..., outlier_channels] += 6.0
    block_table = torch.randperm(total_pages, generator=generator)[: batch * max_pages]
    block_table = block_table.view(batch, max_pages).to(torch.int32)
    query = torch.empty(batch, num_kv_heads * group, head_dim)

    for b, length in enumerate(lengths):
        pages = block_table[b, : -(-length // PAGE_SIZE)].long()
        for h, profile in enumerate(profiles):
            # trained heads score along a few dominant channels, which is what makes a
            # per-channel variance informative
            direction = torch.zeros(head_dim)
            channels = torch.randperm(head_dim, generator=generator)[:4]
            direction[channels] = torch.rand(4, generator=generator) + 0.5
            direction /= direction.norm()
            row_keys = keys[pages, :, h].reshape(-1, head_dim)[:length]
            # remove the random keys' own component along u, then set it to the target logit
            row_keys -= (row_keys @ direction)[:, None] * direction
            relevance = _relevance(length, profile, generator)
            row_keys += (relevance / (scale * math.sqrt(head_dim)))[:, None] * direction
            padded = torch.zeros(len(pages) * PAGE_SIZE, head_dim)
            padded[:length] = row_keys
            keys[pages, :, h] = padded.view(len(pages), PAGE_SIZE, head_dim)
            noise = torch.randn(group, head_dim, generator=generator) * 0.15
            query[b, h * group : (h + 1) * group] = math.sqrt(head_dim) * direction + noise

    return SyntheticContext(
        query=query.to(dtype=dtype, device=device),
        key_cache=keys.to(dtype=dtype, device=device),
        value_cache=values.to(dtype=dtype, device=device),
        block_table=block_table.to(device),
        seq_lens=torch.tensor(lengths, dtype=torch.int32, device=device),
        profiles=profiles,
    )


# --------------------------------------------------------------------------------------------
# Budgets with a realistic spread, for timing studies (random weights say nothing about which
# pages a trained model needs, so speed is measured at stated read fractions)
# --------------------------------------------------------------------------------------------


def spread_fractions(count, mean, cv, generator=None):
    """``count`` fractions in [0, 1] with the given mean and coefficient of variation:
    lognormal quantiles in a random order, clipped to 1 and rescaled to the mean; sigma is
    bisected so the *clipped* values have the CV (as far as the clip allows). float64."""
    if cv == 0:
        return torch.full((count,), float(mean), dtype=torch.float64)
    normal = torch.distributions.Normal(0.0, 1.0)
    z = normal.icdf((torch.arange(count, dtype=torch.float64) + 0.5) / count)
    z = z[torch.randperm(count, generator=generator)]

    def clipped(sigma):
        f = torch.exp(sigma * z - sigma * sigma / 2)
        for _ in range(50):
            f = (f * mean / f.mean()).clamp(0.0, 1.0)
        return f

    low, high = 0.0, 4.0
    for _ in range(40):
        sigma = (low + high) / 2
        f = clipped(sigma)
        if (f.std(unbiased=False) / f.mean()).item() < cv:
            low = sigma
        else:
            high = sigma
    return clipped((low + high) / 2)


def layer_head_fractions(mean, num_layers, num_kv_heads, *, head_cv=0.7, layer_ratio=68 / 9,
                         seed=0):
    """Per-(layer, KV head) read fractions ``[num_layers, num_kv_heads]`` float32 shaped like the
    paper's Figure 1a: per-layer means spread geometrically over a ``layer_ratio`` range (9% to
    68% there), the largest in layer 0 (the first layer needs most of its context), the others
    in a random order, averaging ``mean``; within a layer, fractions with CV ``head_cv``."""
    generator = torch.Generator().manual_seed(seed)
    steps = torch.arange(num_layers, dtype=torch.float64) / max(num_layers - 1, 1)
    profile = layer_ratio ** steps
    profile = profile.flip(0)[torch.cat([torch.zeros(1, dtype=torch.long),
                                         1 + torch.randperm(num_layers - 1,
                                                            generator=generator)])]
    layer_means = (profile * mean / profile.mean()).clamp(max=1.0)
    rows = [spread_fractions(num_kv_heads, float(m), head_cv, generator) for m in layer_means]
    return torch.stack(rows).float()
