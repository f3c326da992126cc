"""Sparse against dense on one model, one sequence at a time: token KL, pass-key retrieval and
repeated-passage perplexity, each at several gammas with the fraction of pages read; the
oracle budget analysis (paper Figure 1, section 6.1) and selector ablations at equal reads.

Every measurement prefills dense (as a serving engine does) and runs the decode steps either
dense (transformers' SDPA) or sparse (``SparseDecoding``), from copies of the same prefilled
cache, so dense and sparse see identical prompts, weights and caches.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import math
import random
import time

import torch

from .. import reference, selectors
from . import calibration as head_targets  # (`calibration` names a document count here)
from .hf import SparseDecoding, moira_pages
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
        with sparse or contextlib.nullcontext():
            for _ in range(new_tokens - 1):
                steps.append(self.step(tokens[-1], cache))
                tokens.append(int(steps[-1].argmax()))
        return tokens, steps

    def teacher_forced(self, cache, tokens, sparse=None):
        """Feed ``tokens`` as decode steps from a copy of ``cache``; the log-probabilities after
        each."""
        cache = copy.deepcopy(cache)
        with sparse or contextlib.nullcontext():
            return [self.step(token, cache) for token in tokens]


@dataclasses.dataclass(frozen=True, eq=False)
class Calibrated:
    """An arm with per-(layer, KV head) coverage targets (``moira calibrate``) instead of one
    gamma; ``targets`` ``[layers, kv_heads]`` (a tensor or nested sequences). Its rows carry
    the label ``"<gamma> calibrated"``."""

    gamma: float
    targets: object

    def __str__(self):
        return f"{self.gamma} calibrated"


@dataclasses.dataclass(frozen=True)
class Estimated:
    """An arm at one gamma with another estimator than mvar (``MoiraConfig.estimator``); its
    rows carry the label ``"<gamma> <estimator>"``."""

    gamma: float
    estimator: str

    def __str__(self):
        return f"{self.gamma} {self.estimator}"


def sparse_arm(key):
    """The ``SparseDecoding`` of an arm: a gamma, an ``Estimated`` or a ``Calibrated``."""
    if isinstance(key, Calibrated):
        table = torch.as_tensor(key.targets, dtype=torch.float32)
        return SparseDecoding(select=lambda layer, *inputs: moira_pages(*inputs,
                                                                        gamma=table[layer]))
    if isinstance(key, Estimated):
        return SparseDecoding(gamma=key.gamma, estimator=key.estimator)
    return SparseDecoding(gamma=key)


def label(key):
    """How an arm is named in the rows and tables (JSON-friendly)."""
    return str(key) if isinstance(key, (Calibrated, Estimated)) else key


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


def token_kl(lm, documents, gammas, new_tokens, progress=print, rows=None):
    """Mean token KL(dense || sparse) on each document's dense greedy continuation,
    teacher-forced; the first new token comes from the (dense) prefill and is not counted."""
    rows = [] if rows is None else rows  # the caller's list: rows land as they are made
    for index, doc in enumerate(documents):
        cache, logprobs = lm.prefill(doc)
        tokens, dense_steps = lm.greedy(cache, logprobs, new_tokens)
        for gamma in gammas:
            arm = sparse_arm(gamma)
            sparse_steps = lm.teacher_forced(cache, tokens[:-1], arm)
            kls = [kl(p, q) for p, q in zip(dense_steps, sparse_steps)]
            rows.append(dict(doc=index, gamma=label(gamma), kl=sum(kls) / len(kls),
                             tokens=len(kls),
                             read_fraction=arm.read_fraction))
        progress(f"kl: document {index + 1}/{len(documents)}")
    return rows


RETRIEVAL_DEPTHS = [0.1, 0.3, 0.5, 0.7, 0.9]  # needle depths, swept over the haystacks
PASSAGE_TOKENS = 96  # the repeated passage's length


def text_parts(text_ids, seed=0):
    """Three disjoint thirds of the text: KL (and budget, ablation) documents, retrieval
    haystacks, repeated passages."""
    return windows(text_ids, len(text_ids) // 3, 3, seed=seed)


def passkey_samples(haystack, index, encode, context):
    """Haystack number ``index``'s pass-key samples, single- and 4-key."""
    depth = RETRIEVAL_DEPTHS[index % len(RETRIEVAL_DEPTHS)]
    return [passkey(haystack, encode, context, kind=kind, depth=depth, seed=index)
            for kind in ("single", "multi")]


def repeat_pairs(text_ids, context, documents, passage_tokens=PASSAGE_TOKENS, seed=0):
    """``documents`` (passage, filler) pairs for the repeated-passage task: the passage from
    one window of ``text_ids``, the filler from the next."""
    chunks = windows(text_ids, context, documents + 1, seed=seed)
    rng = random.Random(seed)
    pairs = []
    for chunk, filler in zip(chunks, chunks[1:]):
        start_at = rng.randrange(0, len(chunk) - passage_tokens)
        pairs.append((chunk[start_at : start_at + passage_tokens], filler))
    return pairs


def retrieval(lm, haystacks, encode, decode, context, gammas, answer_tokens=8,
              progress=print, rows=None):
    """Pass-key retrieval, single- and multi-key, needle depth swept over samples: exact match
    of the greedy answer's leading digits, dense and sparse, per sample."""
    rows = [] if rows is None else rows  # the caller's list: rows land as they are made
    for index, haystack in enumerate(haystacks):
        for sample in passkey_samples(haystack, index, encode, context):
            cache, logprobs = lm.prefill(sample.prompt)
            for gamma in [None] + list(gammas):
                arm = None if gamma is None else sparse_arm(gamma)
                tokens, _ = lm.greedy(cache, logprobs, answer_tokens, arm)
                text = decode(tokens).strip()
                digits = text[: len(sample.answer)]
                rows.append(dict(sample=index, kind=sample.kind, depth=sample.depth,
                                 gamma=label(gamma), correct=digits == sample.answer,
                                 output=text,
                                 read_fraction=None if arm is None else arm.read_fraction))
        progress(f"retrieval: haystack {index + 1}/{len(haystacks)}")
    return rows


def repeated_passage_nll(lm, pairs, context, gammas, progress=print, rows=None):
    """Mean NLL over the second copy of a passage repeated after filler, teacher-forced as
    decode steps (the prefill ends at the first token of the copy), dense and sparse."""
    rows = [] if rows is None else rows  # the caller's list: rows land as they are made
    for index, (passage, filler) in enumerate(pairs):
        ids, second = repeated_passage(passage, filler, context)
        cache, _ = lm.prefill(ids[: second + 1])
        targets = ids[second + 1 :]
        for gamma in [None] + list(gammas):
            arm = None if gamma is None else sparse_arm(gamma)
            steps = lm.teacher_forced(cache, targets[:-1], arm)
            nll = [-float(step[token]) for step, token in zip(steps, targets[1:])]
            rows.append(dict(doc=index, gamma=label(gamma), nll=sum(nll) / len(nll),
                             tokens=len(nll),
                             read_fraction=None if arm is None else arm.read_fraction))
        progress(f"repeated passage: document {index + 1}/{len(pairs)}")
    return rows


def _all_pages(layer, query, key_cache, block_table, seq_lens, scale):
    return selectors.window(seq_lens, key_cache.shape[2], block_table.shape[1],
                            sink_pages=0, recent_pages=block_table.shape[1])


def budget_analysis(lm, documents, new_tokens, coverage=0.95, progress=print, rows=None):
    """The oracle coverage set C*(coverage) (Eq. 1, exact attention) of every (layer, KV head,
    decode step) along dense greedy decoding; returns one row per (doc, step, layer, head)."""
    rows = [] if rows is None else rows  # the caller's list: rows land as they are made
    for index, doc in enumerate(documents):
        steps = {}

        def observe(layer, query, key_cache, block_table, seq_lens, scale):
            _, counts = reference.oracle_coverage(query, key_cache, block_table, seq_lens,
                                                  coverage, scale)
            step = steps[layer] = steps.get(layer, -1) + 1
            for head, size in enumerate(counts[0].tolist()):
                rows.append(dict(doc=index, step=step, layer=layer, head=head, size=size,
                                 pages=block_table.shape[1]))

        cache, logprobs = lm.prefill(doc)  # decode with every page: outputs stay dense
        lm.greedy(cache, logprobs, new_tokens, SparseDecoding(select=_all_pages, observe=observe))
        progress(f"budget: document {index + 1}/{len(documents)}")
    return rows


def _cv(values):
    values = torch.tensor(values, dtype=torch.float64)
    return float(values.std(unbiased=False) / values.mean()) if values.mean() > 0 else 0.0


def budget_statistics(rows, quantile=0.9):
    """Figure 1 / section 6.1 statistics from ``budget_analysis`` rows: mean |C*| / pages per
    (layer, head), CVs across layers, across the heads of a layer (per step) and across the
    steps of a (layer, head); and the pages read by one fixed budget and by a per-(layer, head)
    profiled budget that give ``quantile`` of the rows at least the coverage, relative to the
    coverage sets' own size."""
    layers = 1 + max(r["layer"] for r in rows)
    heads = 1 + max(r["head"] for r in rows)
    fraction = [[0.0] * heads for _ in range(layers)]
    groups = {}
    for r in rows:
        groups.setdefault((r["layer"], r["head"]), []).append(r)
    for (layer, head), group in groups.items():
        fraction[layer][head] = sum(r["size"] / r["pages"] for r in group) / len(group)
    per_layer = [sum(r["size"] for r in rows if r["layer"] == layer) for layer in range(layers)]
    by_step = {}
    for r in rows:
        by_step.setdefault((r["doc"], r["step"], r["layer"]), []).append(r["size"])
    by_series = {}
    for r in rows:
        by_series.setdefault((r["doc"], r["layer"], r["head"]), []).append(r["size"])
    sizes = torch.tensor([r["size"] for r in rows], dtype=torch.float64)
    pages = torch.tensor([r["pages"] for r in rows], dtype=torch.float64)
    fixed = torch.quantile(sizes, quantile)
    profiled = 0.0
    for group in groups.values():
        budget = float(torch.quantile(torch.tensor([float(r["size"]) for r in group]), quantile))
        profiled += sum(min(budget, r["pages"]) for r in group)
    return dict(
        coverage_fraction_per_layer_head=fraction,
        mean_coverage_fraction=float((sizes / pages).mean()),
        cv_across_layers=_cv(per_layer),
        cv_across_heads_of_a_layer=sum(map(_cv, by_step.values())) / len(by_step),
        cv_across_steps=sum(map(_cv, by_series.values())) / len(by_series),
        fixed_budget_pages=float(fixed),
        fixed_budget_reads_vs_coverage=float(torch.minimum(fixed, pages).sum() / sizes.sum()),
        profiled_budget_reads_vs_coverage=profiled / float(sizes.sum()),
        rows=len(rows))


def ablation(lm, documents, calibration, new_tokens, gamma=0.98, progress=print,
             rows=None):
    """Selectors at (about) equal reads, by token KL to dense on the dense greedy continuation.

    Per document, the coverage rule at ``gamma`` sets the reads; the other arms get the same
    number of pages per row: fixed K (mvar ranking; at one context length per document this is
    also proportional top-k), K per (layer, KV head) profiled on the ``calibration`` documents
    and scaled to the same total, fixed K with a mean-only estimate, fixed K with Quest's
    bound, and a sink + recent-pages window."""
    profile = None
    for doc in calibration:  # mean pages kept per (layer, KV head) by the coverage rule
        arm = SparseDecoding(gamma=gamma, record_rows=True)
        cache, logprobs = lm.prefill(doc)
        lm.greedy(cache, logprobs, new_tokens, arm)
        counts = {}
        for layer, page_counts, _ in arm.rows:
            counts.setdefault(layer, []).append(page_counts[0].float())
        kept = torch.stack([torch.stack(counts[layer]).mean(0) for layer in sorted(counts)])
        profile = kept if profile is None else profile + kept
    progress("ablation: calibrated")

    rows = [] if rows is None else rows  # the caller's list: rows land as they are made
    for index, doc in enumerate(documents):
        cache, logprobs = lm.prefill(doc)
        tokens, dense_steps = lm.greedy(cache, logprobs, new_tokens)

        def run(name, arm):
            steps = lm.teacher_forced(cache, tokens[:-1], arm)
            kls = [kl(p, q) for p, q in zip(dense_steps, steps)]
            rows.append(dict(doc=index, arm=name, kl=sum(kls) / len(kls),
                             read_fraction=arm.read_fraction))
            return arm

        covered = []  # exact group-mean mass inside each row's list: the estimator's error
        coverage = run(f"coverage gamma={gamma}", SparseDecoding(select=head_targets.checked_pages(
            gamma, lambda *measured: covered.append(measured))))
        rows[-1].update(exact_mass_covered=covered, gamma=gamma)
        run(f"oracle coverage gamma={gamma} (exact masses)", SparseDecoding(
            select=lambda layer, query, key_cache, block_table, seq_lens, scale:
            reference.oracle_coverage(query, key_cache, block_table, seq_lens, gamma, scale)))
        rows_per_step = profile.numel()
        per_row = coverage.pages_read / (len(tokens) - 1) / rows_per_step
        top_k = max(2, round(per_row))
        scaled = torch.clamp((profile * per_row * rows_per_step / profile.sum()).round(), min=2)
        run("fixed K (mvar)", SparseDecoding(top_k=top_k))
        run("profiled K per (layer, head)", SparseDecoding(
            select=lambda layer, *inputs: moira_pages(
                *inputs, top_k=scaled[layer].long().expand(inputs[0].shape[0], -1))))
        run("fixed K, mean-only estimate", SparseDecoding(top_k=top_k, estimator="mean"))
        run("fixed K, Quest bound", SparseDecoding(
            select=lambda layer, query, key_cache, block_table, seq_lens, scale: selectors.quest(
                query, selectors.quest_summaries(key_cache, block_table, seq_lens), block_table,
                seq_lens, top_k)))
        run("sink + recent window", SparseDecoding(
            select=lambda layer, query, key_cache, block_table, seq_lens, scale: selectors.window(
                seq_lens, key_cache.shape[2], block_table.shape[1], recent_pages=top_k - 1)))
        progress(f"ablation: document {index + 1}/{len(documents)}")
    return rows


def summarize_rows(results):
    """Per-gamma tables from the raw rows of ``evaluate``."""
    table = {}
    if "kl" in results:
        for gamma in sorted({row["gamma"] for row in results["kl"]}, key=str):
            rows = [row for row in results["kl"] if row["gamma"] == gamma]
            table.setdefault(str(gamma), {}).update(
                kl=sum(r["kl"] for r in rows) / len(rows),
                kl_read_fraction=sum(r["read_fraction"] for r in rows) / len(rows))
    if "retrieval" in results:
        rows = results["retrieval"]
        dense = {(r["sample"], r["kind"]): float(r["correct"]) for r in rows if r["gamma"] is None}
        keys = sorted(dense)
        table.setdefault("dense", {})["retrieval"] = sum(dense.values()) / len(dense)
        for gamma in sorted({r["gamma"] for r in rows if r["gamma"] is not None}, key=str):
            sparse = {(r["sample"], r["kind"]): float(r["correct"]) for r in rows
                      if r["gamma"] == gamma}
            entry = table.setdefault(str(gamma), {})
            entry["retrieval"] = sum(sparse.values()) / len(sparse)
            entry["retrieval_minus_dense"] = paired_bootstrap([dense[k] for k in keys],
                                                              [sparse[k] for k in keys])
            entry["retrieval_read_fraction"] = sum(
                r["read_fraction"] for r in rows if r["gamma"] == gamma) / len(sparse)
    if "ablation" in results:
        arms = {}
        for r in results["ablation"]:
            arms.setdefault(r["arm"], []).append(r)
        reference_arm = next(iter(arms))
        base = {r["doc"]: r["kl"] for r in arms[reference_arm]}
        table["ablation"] = {
            name: dict(kl=sum(r["kl"] for r in rs) / len(rs),
                       read_fraction=sum(r["read_fraction"] for r in rs) / len(rs),
                       docs_where_coverage_kl_is_lower=sum(base[r["doc"]] < r["kl"] for r in rs))
            for name, rs in arms.items()}
        covered = [c for r in arms[reference_arm] for c in r.get("exact_mass_covered", [])]
        if covered:
            per_head = {}
            for layer, head, mass in covered:
                per_head.setdefault((layer, head), []).append(mass)
            means = sorted((sum(m) / len(m), layer, head) for (layer, head), m in per_head.items())
            masses = [mass for _, _, mass in covered]
            gamma = arms[reference_arm][0]["gamma"]
            table["estimator_error"] = dict(
                gamma=gamma, mean_exact_mass=sum(masses) / len(masses),
                rows_below_gamma_minus_002=sum(m < gamma - 0.02 for m in masses) / len(masses),
                worst_layer_heads=[dict(layer=layer, head=head, mean_exact_mass=mean)
                                   for mean, layer, head in means[:5]])
    if "budget" in results:
        table["budget"] = budget_statistics(results["budget"])
    if "repeat" in results:
        for gamma in [None] + sorted({r["gamma"] for r in results["repeat"]
                                      if r["gamma"] is not None}, key=str):
            rows = [r for r in results["repeat"] if r["gamma"] == gamma]
            entry = table.setdefault("dense" if gamma is None else str(gamma), {})
            entry["repeat_ppl"] = math.exp(sum(r["nll"] for r in rows) / len(rows))
            if gamma is not None:
                entry["repeat_read_fraction"] = sum(r["read_fraction"] for r in rows) / len(rows)
    return table


def _grid(headers, rows):
    """Plain-text columns: the first left-aligned, the others right-aligned."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows)]
    lines = []
    for row in [headers, None, *rows]:
        if row is None:
            lines.append("  ".join("-" * width for width in widths))
            continue
        cells = [str(row[0]).ljust(widths[0])]
        cells += [str(cell).rjust(width) for cell, width in zip(row[1:], widths[1:])]
        lines.append("  ".join(cells).rstrip())
    return lines


def _percent(value):
    return f"{value:.1%}"


def _kl(value):
    return f"{value:.4f}".replace("-0.0000", "0.0000")  # float noise below 0 at gamma = 1


def _interval(value):
    return f"{value['mean']:+.3f} [{value['low']:+.3f}, {value['high']:+.3f}]"


TABLE_COLUMNS = [  # (heading, key of summarize_rows' entry, format)
    ("token KL", "kl", _kl),
    ("KL read", "kl_read_fraction", _percent),
    ("retrieval", "retrieval", "{:.3f}".format),
    ("retr. - dense [95% CI]", "retrieval_minus_dense", _interval),
    ("retr. read", "retrieval_read_fraction", _percent),
    ("repeat ppl", "repeat_ppl", "{:.3f}".format),
    ("repeat read", "repeat_read_fraction", _percent),
]


def format_table(table):
    """``summarize_rows``' table as text: one row per arm (dense, each gamma, its calibrated
    arm) with the tasks' scores and the fraction of pages each read; then the ablation arms,
    the estimator's error and the budget statistics, where measured."""
    arms = [key for key in table if key not in ("ablation", "estimator_error", "budget")]
    # dense first, then by gamma, each gamma before its calibrated arm
    arms.sort(key=lambda key: (0.0, key) if key == "dense" else (float(key.split()[0]), key))
    sections = []  # each a list of lines
    if arms:
        columns = [c for c in TABLE_COLUMNS if any(c[1] in table[arm] for arm in arms)]
        rows = [[arm] + [fmt(table[arm][key]) if key in table[arm] else "-"
                         for _, key, fmt in columns] for arm in arms]
        sections.append(_grid(["gamma"] + [heading for heading, _, _ in columns], rows))
    if "ablation" in table:
        rows = [[name, _kl(arm["kl"]), _percent(arm["read_fraction"]),
                 arm["docs_where_coverage_kl_is_lower"]] for name, arm in table["ablation"].items()]
        sections.append(_grid(["ablation arm (equal reads)", "token KL", "read",
                               "docs with lower KL by coverage"], rows))
    if "estimator_error" in table:
        error = table["estimator_error"]
        worst = ", ".join(f"layer {w['layer']} head {w['head']} {w['mean_exact_mass']:.3f}"
                          for w in error["worst_layer_heads"])
        sections.append([(f"exact mass inside the gamma={error['gamma']} lists: mean "
                          f"{error['mean_exact_mass']:.4f}, rows below gamma - 0.02: "
                          f"{error['rows_below_gamma_minus_002']:.1%}; lowest heads: {worst}")])
    if "budget" in table:
        budget = table["budget"]
        sections.append([
            (f"oracle coverage sets ({budget['rows']} rows): mean "
             f"{budget['mean_coverage_fraction']:.1%} of the pages; CV across layers "
             f"{budget['cv_across_layers']:.2f}, across the heads of a layer "
             f"{budget['cv_across_heads_of_a_layer']:.2f}, across steps "
             f"{budget['cv_across_steps']:.2f}"),
            (f"reads vs the coverage sets: one fixed budget ({budget['fixed_budget_pages']:.0f} "
             f"pages) {budget['fixed_budget_reads_vs_coverage']:.2f}x, a profiled budget per "
             f"(layer, head) {budget['profiled_budget_reads_vs_coverage']:.2f}x")])
    return "\n\n".join("\n".join(lines) for lines in sections)


def evaluate(model, tokenizer_encode, tokenizer_decode, text, *, context, documents, gammas,
             tasks=("kl", "retrieval", "repeat"), new_tokens=32, passage_tokens=PASSAGE_TOKENS,
             seed=0, calibration=5, progress=print, checkpoint=None, tail_ratios=None,
             calibrate_documents=0, estimators=()):
    """Run the chosen measurements; returns ``{"rows": {...}, "table": {...}, "seconds": s}``.

    ``documents`` samples per task, each from a different part of ``text`` (a long string).
    ``tail_ratios`` (``[layers][kv_heads]``, from ``moira calibrate``) adds, for every gamma
    below 1, an arm with per-head targets (``"<gamma> calibrated"``) to KL, retrieval and the
    repeated passage. ``calibrate_documents`` > 0 measures them first, on documents from the
    third of the text the KL and retrieval samples never use (the repeated passage's third,
    which then gets no calibrated arm).
    ``estimators`` (e.g. ``("int2",)``) adds, for every gamma below 1, an arm with that
    estimator (``"<gamma> <estimator>"``) beside mvar's.
    ``checkpoint(rows)``, if given, is called after every document with the rows so far (so a
    long GPU run that is cut short keeps what it measured).
    """
    start = time.perf_counter()
    lm = CausalLM(model)
    text_ids = tokenizer_encode(text)
    parts = text_parts(text_ids, seed)
    results = {}
    if calibrate_documents:
        covered = head_targets.measure(
            lm, windows(parts[2], context, calibrate_documents, seed=seed + 3),
            new_tokens=new_tokens, progress=progress)
        results["calibration"] = covered
        tail_ratios = head_targets.tail_ratios(covered, head_targets.GAMMA)
    plain = list(gammas)
    gammas = plain + [Estimated(g, name) for name in estimators for g in plain if g < 1]
    if tail_ratios is not None:
        gammas += [Calibrated(g, head_targets.targets(tail_ratios, g)) for g in plain if g < 1]

    def report(message):
        progress(message)
        if checkpoint is not None:
            checkpoint(results)

    if "kl" in tasks:
        docs = windows(parts[0], context, documents, seed=seed)
        token_kl(lm, docs, gammas, new_tokens, report, rows=results.setdefault("kl", []))
    if "retrieval" in tasks:
        haystacks = windows(parts[1], context, documents, seed=seed)
        retrieval(lm, haystacks, tokenizer_encode, tokenizer_decode, context, gammas,
                  progress=report, rows=results.setdefault("retrieval", []))
    if "budget" in tasks:
        docs = windows(parts[0], context, documents, seed=seed + 1)
        budget_analysis(lm, docs, new_tokens, progress=report,
                        rows=results.setdefault("budget", []))
    if "ablation" in tasks:
        docs = windows(parts[0], context, documents + calibration, seed=seed + 2)
        ablation(lm, docs[:documents], docs[documents:], new_tokens, progress=report,
                 rows=results.setdefault("ablation", []))
    if "repeat" in tasks:
        if calibrate_documents:  # calibrated on this third of the text: not held out here
            gammas = [g for g in gammas if not isinstance(g, Calibrated)]
        pairs = repeat_pairs(parts[2], context, documents, passage_tokens, seed)
        repeated_passage_nll(lm, pairs, context, gammas, report,
                             rows=results.setdefault("repeat", []))
    # too short a text for disjoint samples: say so (the samples overlap, the bootstrap
    # intervals are then too narrow)
    overlapping = len(parts[0]) // context < documents
    return dict(rows=results, table=summarize_rows(results), overlapping_windows=overlapping,
                seconds=round(time.perf_counter() - start, 1))
