"""Sparse against dense on one model, one sequence at a time: token KL, pass-key retrieval and
repeated-passage perplexity, each at several gammas with the fraction of pages read.

Every measurement prefills dense (as a serving engine does) and runs the decode steps either
dense (transformers' SDPA) or sparse (``SparseDecoding``), from copies of the same prefilled
cache, so dense and sparse see identical prompts, weights and caches.
"""

from __future__ import annotations

import copy
import inspect
import math
import random
import time

import torch

from .hf import SparseDecoding
from .tasks import passkey, repeated_passage, windows


class CausalLM:
    """A transformers causal LM loaded with ``attn_implementation="moira"``, driven one sequence
    (batch 1) and one token at a time."""

    def __init__(self, model):
        self.model = model.eval()
        parameters = inspect.signature(model.forward).parameters
        # transformers >= 5.2x names the cache argument `cache`, earlier ones `past_key_values`
        self.cache_argument = "cache" if "cache" in parameters else "past_key_values"
        self.device = next(model.parameters()).device

    def _forward(self, ids, cache):
        out = self.model(torch.tensor([ids], device=self.device), use_cache=True,
                         logits_to_keep=1, **{self.cache_argument: cache})
        cache = out.cache if "cache" in out else out.past_key_values
        return out.logits[0, -1].float(), cache

    @torch.inference_mode()
    def prefill(self, ids):
        """Dense prefill; returns ``(cache, log-probabilities of the next token)``."""
        logits, cache = self._forward(ids, None)
        return cache, torch.log_softmax(logits, -1)

    @torch.inference_mode()
    def step(self, token, cache):
        """One decode step (dense or sparse by the active ``SparseDecoding``); returns the next
        token's log-probabilities. Extends ``cache`` in place."""
        logits, _ = self._forward([token], cache)
        return torch.log_softmax(logits, -1)

    def greedy(self, cache, logprobs, new_tokens, sparse=None):
        """Greedy continuation from a prefilled cache (left unchanged): tokens, and the
        log-probabilities each decode step gave."""
        cache = copy.deepcopy(cache)
        tokens, steps = [int(logprobs.argmax())], []
        with sparse or _Dense():
            for _ in range(new_tokens - 1):
                steps.append(self.step(tokens[-1], cache))
                tokens.append(int(steps[-1].argmax()))
        return tokens, steps

    def teacher_forced(self, cache, tokens, sparse=None):
        """Feed ``tokens`` as decode steps from a copy of ``cache``; the log-probabilities after
        each."""
        cache = copy.deepcopy(cache)
        with sparse or _Dense():
            return [self.step(token, cache) for token in tokens]


class _Dense:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


def _arm(gamma, estimator="mvar"):
    return SparseDecoding(gamma=gamma, estimator=estimator)


def kl(p_log, q_log):
    """KL(p || q) from log-probabilities."""
    return float((p_log.exp() * (p_log - q_log)).sum())


def paired_bootstrap(dense, sparse, *, resamples=10_000, seed=0):
    """Mean of ``sparse - dense`` (per-sample scores) and its 95% bootstrap interval."""
    diffs = torch.tensor(sparse, dtype=torch.float64) - torch.tensor(dense, dtype=torch.float64)
    generator = torch.Generator().manual_seed(seed)
    picks = torch.randint(len(diffs), (resamples, len(diffs)), generator=generator)
    means = diffs[picks].mean(1)
    return dict(mean=float(diffs.mean()), low=float(means.quantile(0.025)),
                high=float(means.quantile(0.975)))


# --------------------------------------------------------------------------------------------
# The measurements
# --------------------------------------------------------------------------------------------


def token_kl(lm, documents, gammas, new_tokens, progress=print):
    """Mean token KL(dense || sparse) on each document's dense greedy continuation,
    teacher-forced; the first new token comes from the (dense) prefill and is not counted."""
    rows = []
    for index, doc in enumerate(documents):
        cache, logprobs = lm.prefill(doc)
        tokens, dense_steps = lm.greedy(cache, logprobs, new_tokens)
        for gamma in gammas:
            arm = _arm(gamma)
            sparse_steps = lm.teacher_forced(cache, tokens[:-1], arm)
            kls = [kl(p, q) for p, q in zip(dense_steps, sparse_steps)]
            rows.append(dict(doc=index, gamma=gamma, kl=sum(kls) / len(kls), tokens=len(kls),
                             read_fraction=arm.read_fraction))
        progress(f"kl: document {index + 1}/{len(documents)}")
    return rows


def retrieval(lm, haystacks, encode, decode, context, gammas, answer_tokens=8,
              progress=print):
    """Pass-key retrieval, single- and multi-key, needle depth swept over samples: exact match
    of the greedy answer's leading digits, dense and sparse, per sample."""
    depths = [0.1, 0.3, 0.5, 0.7, 0.9]
    rows = []
    for index, haystack in enumerate(haystacks):
        for kind in ("single", "multi"):
            sample = passkey(haystack, encode, context, kind=kind,
                             depth=depths[index % len(depths)], seed=index)
            cache, logprobs = lm.prefill(sample.prompt)
            for gamma in [None] + list(gammas):
                arm = None if gamma is None else _arm(gamma)
                tokens, _ = lm.greedy(cache, logprobs, answer_tokens, arm)
                text = decode(tokens).strip()
                digits = text[: len(sample.answer)]
                rows.append(dict(sample=index, kind=kind, depth=sample.depth,
                                 gamma=gamma, correct=digits == sample.answer, output=text,
                                 read_fraction=None if arm is None else arm.read_fraction))
        progress(f"retrieval: haystack {index + 1}/{len(haystacks)}")
    return rows


def repeated_passage_nll(lm, pairs, context, gammas, progress=print):
    """Mean NLL over the second copy of a passage repeated after filler, teacher-forced as
    decode steps (the prefill ends at the first token of the copy), dense and sparse."""
    rows = []
    for index, (passage, filler) in enumerate(pairs):
        ids, second = repeated_passage(passage, filler, context)
        cache, _ = lm.prefill(ids[: second + 1])
        targets = ids[second + 1 :]
        for gamma in [None] + list(gammas):
            arm = None if gamma is None else _arm(gamma)
            steps = lm.teacher_forced(cache, targets[:-1], arm)
            nll = [-float(step[token]) for step, token in zip(steps, targets[1:])]
            rows.append(dict(doc=index, gamma=gamma, nll=sum(nll) / len(nll), tokens=len(nll),
                             read_fraction=None if arm is None else arm.read_fraction))
        progress(f"repeated passage: document {index + 1}/{len(pairs)}")
    return rows


def summarize_rows(results):
    """Per-gamma tables from the raw rows of ``evaluate``."""
    table = {}
    if "kl" in results:
        for gamma in sorted({row["gamma"] for row in results["kl"]}):
            rows = [row for row in results["kl"] if row["gamma"] == gamma]
            table.setdefault(str(gamma), {}).update(
                kl=sum(r["kl"] for r in rows) / len(rows),
                kl_read_fraction=sum(r["read_fraction"] for r in rows) / len(rows))
    if "retrieval" in results:
        rows = results["retrieval"]
        dense = {(r["sample"], r["kind"]): float(r["correct"]) for r in rows if r["gamma"] is None}
        keys = sorted(dense)
        table.setdefault("dense", {})["retrieval"] = sum(dense.values()) / len(dense)
        for gamma in sorted({r["gamma"] for r in rows if r["gamma"] is not None}):
            sparse = {(r["sample"], r["kind"]): float(r["correct"]) for r in rows
                      if r["gamma"] == gamma}
            entry = table.setdefault(str(gamma), {})
            entry["retrieval"] = sum(sparse.values()) / len(sparse)
            entry["retrieval_minus_dense"] = paired_bootstrap([dense[k] for k in keys],
                                                              [sparse[k] for k in keys])
            entry["retrieval_read_fraction"] = sum(
                r["read_fraction"] for r in rows if r["gamma"] == gamma) / len(sparse)
    if "repeat" in results:
        for gamma in [None] + sorted({r["gamma"] for r in results["repeat"]
                                      if r["gamma"] is not None}):
            rows = [r for r in results["repeat"] if r["gamma"] == gamma]
            entry = table.setdefault("dense" if gamma is None else str(gamma), {})
            entry["repeat_ppl"] = math.exp(sum(r["nll"] for r in rows) / len(rows))
    return table


def evaluate(model, tokenizer_encode, tokenizer_decode, text, *, context, documents, gammas,
             tasks=("kl", "retrieval", "repeat"), new_tokens=32, passage_tokens=96, seed=0,
             progress=print):
    """Run the chosen measurements; returns ``{"rows": {...}, "table": {...}, "seconds": s}``.

    ``documents`` samples per task, each from a different part of ``text`` (a long string).
    """
    start = time.perf_counter()
    lm = CausalLM(model)
    text_ids = tokenizer_encode(text)
    # disjoint slices of the text for the three tasks
    parts = windows(text_ids, len(text_ids) // 3, 3, seed=seed)
    results = {}
    if "kl" in tasks:
        docs = windows(parts[0], context, documents, seed=seed)
        results["kl"] = token_kl(lm, docs, gammas, new_tokens, progress)
    if "retrieval" in tasks:
        haystacks = windows(parts[1], context, documents, seed=seed)
        results["retrieval"] = retrieval(lm, haystacks, tokenizer_encode, tokenizer_decode,
                                         context, gammas, progress=progress)
    if "repeat" in tasks:
        chunks = windows(parts[2], context, documents + 1, seed=seed)
        rng = random.Random(seed)
        pairs = []  # the passage from one chunk, the filler from the next
        for chunk, filler in zip(chunks, chunks[1:]):
            start_at = rng.randrange(0, len(chunk) - passage_tokens)
            pairs.append((chunk[start_at : start_at + passage_tokens], filler))
        results["repeat"] = repeated_passage_nll(lm, pairs, context, gammas, progress)
    return dict(rows=results, table=summarize_rows(results),
                seconds=round(time.perf_counter() - start, 1))
