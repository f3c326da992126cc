"""Candidate page-mass estimators, in float32 PyTorch (study code: the accuracy study
``benchmarks/accuracy.py estimators`` compares them; of these Moira's Estimate ships mvar,
int2 and int4, ``MoiraConfig.estimator``).

Every estimator maps one request's scaled queries ``q`` ``[kv_heads, G, D]`` (``s q``) and its
keys ``keys`` ``[pages, 64, kv_heads, D]`` (``valid`` ``[pages, 64]`` marks the tokens in the
sequence) to log page masses ``[kv_heads, G, pages]``. Each reads a per-page summary built
once when the page fills (built here from the keys, each step, for simplicity);
``BYTES[name](D)`` is what it reads per page and KV head at each step, bf16 summaries.
``with_exact_ends`` makes the sink and the current page exact, as Moira's Estimate does.

- ``mvar``: Eq. 2 from the per-channel mean and variance (``moira.reference.estimate``).
- ``quest``: Quest's bound, ``max_t s q.k_t <= sum_d max(s q_d lo_d, s q_d hi_d)``, from the
  per-channel min and max, as the log-mass of one key: a ranking, not a share. ``sub`` tokens
  per box (64 / 32 / 16): the page's mass is the log-sum-exp of its boxes' bounds.
- ``quantized``: every key at ``bits`` bits per channel (2, 4: uniform between the page's
  per-channel min and max, which Quest's box holds, as ``reference.quantize_page``; 1: the
  mean plus or minus the mean absolute deviation, by the sign of the deviation), each token's
  logit from the dequantized key, log-sum-exp'd per page.
- ``landmarks``: ``count`` keys per page stored exactly (chosen when the page fills, by
  ``by``: ``"norm"`` largest key norm, ``"deviation"`` largest standardized distance from the
  page's mean, ``"channel"`` largest standardized deviation in one channel), logaddexp'd with
  mvar over the page's other keys.
- ``mvar_or_quest``: ``logaddexp(mvar, quest bound)``.
- ``two_stage``: Quest's bound keeps the ``keep`` fraction of middle pages with the largest
  bound (over the group's heads); those are scored by ``quantized(bits)``, the rest by mvar.
"""

from __future__ import annotations

import math

import torch

from . import reference
from .config import PAGE_SIZE

NEG = -math.inf


def page_keys(key_cache, block_table, seq_len, b=0):
    """Request b's keys ``[pages, 64, kv_heads, D]`` float32 and ``valid`` ``[pages, 64]``."""
    pages = min(-(-int(seq_len) // PAGE_SIZE), block_table.shape[1])
    keys = key_cache[block_table[b, :pages].long()].float()
    position = torch.arange(pages * PAGE_SIZE, device=keys.device).view(pages, PAGE_SIZE)
    return keys, position < int(seq_len)


def _masked(x, valid, fill):
    return x.masked_fill(~valid[:, :, None, None], fill)


def _moments(keys, valid):
    """Per-channel mean and population variance over the valid tokens: ``[pages, H, D]``."""
    n = valid.sum(1).clamp(min=1).float()[:, None, None]
    mean = _masked(keys, valid, 0.0).sum(1) / n
    var = (_masked(keys - mean[:, None], valid, 0.0) ** 2).sum(1) / n
    return mean, var, n


def _token_log_mass(q, keys, valid):
    """log sum_t exp(q . k_t) per page from per-token keys ``[pages, 64, H, D]``."""
    logits = torch.einsum("hgd,pthd->hgpt", q, keys)
    return torch.logsumexp(logits.masked_fill(~valid[None, None], NEG), dim=-1)


def exact(q, keys, valid):
    """The exact page masses (the oracle)."""
    return _token_log_mass(q, keys, valid)


def mvar(q, keys, valid):
    mean, var, n = _moments(keys, valid)
    return (torch.einsum("hgd,phd->hgp", q, mean) + 0.5 * torch.einsum("hgd,phd->hgp", q * q, var)
            + torch.log(n[:, 0, 0])[None, None])


def _bound(q, lo, hi):
    """Quest's bound of boxes ``lo``/``hi`` ``[..., H, D]`` -> ``[H, G, ...]``."""
    return (torch.einsum("hgd,...hd->hg...", q.clamp(min=0), hi)
            + torch.einsum("hgd,...hd->hg...", q.clamp(max=0), lo))


def quest(q, keys, valid, sub=PAGE_SIZE):
    pages = keys.shape[0]
    boxes = keys.view(pages, PAGE_SIZE // sub, sub, *keys.shape[2:])
    ok = valid.view(pages, PAGE_SIZE // sub, sub)[..., None, None]
    hi = boxes.masked_fill(~ok, NEG).amax(2)  # [pages, boxes, H, D]
    lo = boxes.masked_fill(~ok, math.inf).amin(2)
    filled = ok[:, :, :, 0, 0].sum(2)  # [pages, boxes] tokens per box
    bound = _bound(q, lo.nan_to_num(0.0, 0.0, 0.0), hi.nan_to_num(0.0, 0.0, 0.0))
    bound = bound + torch.log(filled.float())  # empty boxes: -inf
    return torch.logsumexp(bound, dim=-1)


def _dequantized(keys, valid, bits):
    if bits == 1:
        mean, _, n = _moments(keys, valid)
        mad = _masked((keys - mean[:, None]).abs(), valid, 0.0).sum(1) / n
        return mean[:, None] + torch.where(keys >= mean[:, None], 1.0, -1.0) * mad[:, None]
    # the shipped quantizer (float32 bounds here); a partial page's empty slots repeat its
    # first key, which changes neither bound
    keys = torch.where(valid[:, :, None, None], keys, keys[:, :1])
    lo, hi, codes = reference.quantize_page(keys, bits, torch.float32)
    return lo[:, None] + codes * ((hi - lo) / (2**bits - 1))[:, None]


def quantized(q, keys, valid, bits=4):
    return _token_log_mass(q, _dequantized(keys, valid, bits), valid)


def landmarks(q, keys, valid, count=1, by="deviation"):
    mean, var, _ = _moments(keys, valid)
    if by == "norm":
        score = keys.norm(dim=-1)  # [pages, 64, H]
    else:
        z = (keys - mean[:, None]) ** 2 / var[:, None].clamp(min=1e-12)
        score = z.sum(-1) if by == "deviation" else z.amax(-1)
    score = score.masked_fill(~valid[:, :, None], NEG)
    top = score.topk(count, dim=1).indices  # [pages, count, H]
    chosen = torch.zeros_like(score, dtype=torch.bool).scatter_(1, top, True) & valid[:, :, None]
    rest = valid[:, :, None] & ~chosen  # [pages, 64, H]
    # mvar over the other keys, per head
    n = rest.sum(1).clamp(min=1).float()[..., None]  # [pages, H, 1]
    rest_mean = (keys * rest[..., None]).sum(1) / n
    rest_var = (((keys - rest_mean[:, None]) ** 2) * rest[..., None]).sum(1) / n
    others = (torch.einsum("hgd,phd->hgp", q, rest_mean)
              + 0.5 * torch.einsum("hgd,phd->hgp", q * q, rest_var)
              + torch.log(n[..., 0]).T[:, None])
    others = torch.where((rest.sum(1) > 0).T[:, None], others, NEG)
    logits = torch.einsum("hgd,pthd->hgpt", q, keys)
    logits = logits.masked_fill(~chosen.permute(2, 0, 1)[:, None], NEG)
    return torch.logaddexp(others, torch.logsumexp(logits, dim=-1))


def mvar_or_quest(q, keys, valid):
    return torch.logaddexp(mvar(q, keys, valid), quest(q, keys, valid) - math.log(PAGE_SIZE))


def two_stage(q, keys, valid, keep=0.5, bits=2):
    coarse = quest(q, keys, valid).amax(1)  # [H, pages]
    pages = keys.shape[0]
    middle = coarse[:, 1:-1]
    survivors = torch.zeros_like(coarse, dtype=torch.bool)
    if middle.shape[1]:
        count = max(1, round(keep * middle.shape[1]))
        top = middle.topk(min(count, middle.shape[1]), dim=1).indices + 1
        survivors.scatter_(1, top, True)
    fine = quantized(q, keys, valid, bits)
    cheap = mvar(q, keys, valid)
    del pages
    return torch.where(survivors[:, None], fine, cheap)


def with_exact_ends(estimator):
    """``estimator`` with the sink (page 0) and the current (last) page exact."""

    def estimate(q, keys, valid):
        out = estimator(q, keys, valid).clone()
        ends = sorted({0, keys.shape[0] - 1})
        out[..., ends] = exact(q, keys[ends], valid[ends])
        return out

    return estimate


# name -> estimator; every one with exact sink and current page
CANDIDATES = {
    "exact": exact,
    "mvar": mvar,
    "quest": quest,
    "quest-32": lambda q, k, v: quest(q, k, v, sub=32),
    "quest-16": lambda q, k, v: quest(q, k, v, sub=16),
    "int1": lambda q, k, v: quantized(q, k, v, 1),
    "int2": lambda q, k, v: quantized(q, k, v, 2),
    "int4": lambda q, k, v: quantized(q, k, v, 4),
    "landmark1-norm": lambda q, k, v: landmarks(q, k, v, 1, "norm"),
    "landmark2-deviation": lambda q, k, v: landmarks(q, k, v, 2, "deviation"),
    "landmark2-channel": lambda q, k, v: landmarks(q, k, v, 2, "channel"),
    "mvar+quest": mvar_or_quest,
    "two-stage quest/int2 50%": lambda q, k, v: two_stage(q, k, v, 0.5, 2),
    "two-stage quest/int4 30%": lambda q, k, v: two_stage(q, k, v, 0.3, 4),
}


def _box(d):  # a bf16 vector pair (mean/variance or min/max) of D channels
    return 2 * d * 2


# bytes read per page and KV head each step, head_dim d, bf16 summaries and keys
BYTES = {
    "exact": lambda d: PAGE_SIZE * d * 2,
    "mvar": _box,
    "quest": _box,
    "quest-32": lambda d: 2 * _box(d),
    "quest-16": lambda d: 4 * _box(d),
    "int1": lambda d: _box(d) + PAGE_SIZE * d // 8,
    "int2": lambda d: _box(d) + PAGE_SIZE * d * 2 // 8,
    "int4": lambda d: _box(d) + PAGE_SIZE * d * 4 // 8,
    "landmark1-norm": lambda d: _box(d) + d * 2,
    "landmark2-deviation": lambda d: _box(d) + 2 * d * 2,
    "landmark2-channel": lambda d: _box(d) + 2 * d * 2,
    "mvar+quest": lambda d: 2 * _box(d),
    "two-stage quest/int2 50%": lambda d: 2 * _box(d) + 0.5 * PAGE_SIZE * d * 2 // 8,
    "two-stage quest/int4 30%": lambda d: 2 * _box(d) + 0.3 * PAGE_SIZE * d * 4 // 8,
}
