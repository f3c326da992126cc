"""Per-(layer, KV head) coverage targets from a calibration run (``moira calibrate``).

The mvar estimate can state a head's coverage too high: on a real model the coverage rule's
lists at gamma = 0.98 can hold less than 0.98 of the exact attention mass, some heads much less
(docs/design/estimate.md). A head's *tail ratio* is the mass its lists leave out, measured
with exact attention along greedy decoding with Moira at gamma (as in serving), over the mass
the rule meant to leave out:

    r = (1 - mean exact mass covered) / (1 - gamma)

Asking that head for ``gamma' = 1 - (1 - gamma) / r`` leaves out about ``1 - gamma`` of the
exact mass, if r holds across documents (how well it does: docs/design/estimate.md). ``targets``
turns the ratios into targets for any gamma; ``moira.sparse_decode`` takes them as its
``gamma`` (a tensor per KV head), the vLLM plugin as ``calibration``.
"""

from __future__ import annotations

import json

import torch

from .. import reference
from .hf import SparseDecoding, moira_pages

# a few calibration steps cannot pin down a head that (nearly) always keeps everything
MIN_RATIO, MAX_RATIO = 0.5, 20.0
GAMMA = 0.98  # the target the tail ratios are measured at, by default


def tail_ratio(mean_covered: float, gamma: float) -> float:
    if not 0 < gamma < 1:
        raise ValueError(f"tail ratios are measured at a gamma in (0, 1), got {gamma!r} (at 1 "
                         f"the rule leaves nothing out)")
    return min(MAX_RATIO, max(MIN_RATIO, (1 - mean_covered) / (1 - gamma)))


def tail_ratios(mean_covered, gamma: float):
    """``tail_ratio`` of every (layer, KV head) of ``measure``'s result."""
    return [[tail_ratio(m, gamma) for m in row] for row in mean_covered]


def targets(tail_ratios, gamma: float) -> torch.Tensor:
    """Coverage targets ``[layers, kv_heads]`` (float32) for ``gamma`` from tail ratios;
    gamma = 1 stays 1 for every head."""
    ratios = torch.as_tensor(tail_ratios, dtype=torch.float64)
    return (1 - (1 - gamma) / ratios).float()


def checked_pages(gamma, record):
    """A ``SparseDecoding`` selector: the coverage rule at ``gamma`` (batch 1) that also
    reports the exact group-mean mass inside each row's list, ``record(layer, head, mass)``."""

    def select(layer, query, key_cache, block_table, seq_lens, scale):
        lists, counts = moira_pages(query, key_cache, block_table, seq_lens, scale, gamma=gamma)
        shares = reference.group_shares(reference.exact_log_masses(
            query, key_cache, block_table, seq_lens, scale))
        for head in range(counts.shape[1]):
            kept = lists[0, head, : counts[0, head]].long()
            record(layer, head, float(shares[0, head, kept].sum()))
        return lists, counts

    return select


def measure(lm, documents, *, gamma=GAMMA, new_tokens=32, progress=print):
    """Mean exact mass inside the coverage rule's lists per (layer, KV head), along each
    document's greedy continuation decoded by Moira at ``gamma`` (the lists it attends over
    are the ones measured): ``[[mean covered per KV head] per layer]``."""
    if not 0 < gamma < 1:
        raise ValueError(f"calibrate at a gamma in (0, 1), got {gamma!r}")
    covered = {}
    select = checked_pages(
        gamma, lambda layer, head, mass: covered.setdefault((layer, head), []).append(mass))
    for index, doc in enumerate(documents):
        cache, logprobs = lm.prefill(doc)
        lm.greedy(cache, logprobs, new_tokens, SparseDecoding(select=select))
        progress(f"calibration: document {index + 1}/{len(documents)}")
    layers = 1 + max(layer for layer, _ in covered)
    heads = 1 + max(head for _, head in covered)
    return [[sum(covered[(layer, head)]) / len(covered[(layer, head)]) for head in range(heads)]
            for layer in range(layers)]


def load(path: str, num_layers: int | None = None, num_kv_heads: int | None = None):
    """The tail ratios ``[layers][kv_heads]`` of a ``moira calibrate`` file, checked against
    the model's shape where given."""
    try:
        with open(path) as f:
            ratios = json.load(f)["tail_ratios"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"moira calibration {path!r}: not a `moira calibrate` result "
                         f"({error}): calibrate the model (`moira calibrate`)") from None
    if (not isinstance(ratios, list) or not ratios
            or any(not isinstance(row, list) or len(row) != len(ratios[0]) for row in ratios)
            or any(isinstance(r, bool) or not isinstance(r, (int, float))
                   for row in ratios for r in row)):
        raise ValueError(f"moira calibration {path!r}: tail_ratios must be a [layers][kv_heads] "
                         f"table of numbers, one row per layer of equal length: recalibrate "
                         f"(`moira calibrate`)")
    shape = (len(ratios), len(ratios[0]))
    if ((num_layers is not None and shape[0] != num_layers)
            or (num_kv_heads is not None and shape[1] != num_kv_heads)):
        raise ValueError(f"moira calibration {path!r} is for {shape[0]} layers x {shape[1]} KV "
                         f"heads, this model has {num_layers} x {num_kv_heads}: calibrate "
                         f"this model (`moira calibrate`)")
    if not all(MIN_RATIO <= r <= MAX_RATIO for row in ratios for r in row):
        raise ValueError(f"moira calibration {path!r}: tail ratios must lie in "
                         f"[{MIN_RATIO}, {MAX_RATIO}]")
    return ratios
