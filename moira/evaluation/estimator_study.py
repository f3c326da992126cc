"""Page-mass estimators against the exact masses on retrieval prompts (batch 1, float32).

Per sample: prefill the prompt but its last token, then decode the answer densely from that
token (every answer token is a decode step), stopping once the answer is complete. Along these
answer steps, at every layer and KV head, each estimator of ``moira.estimators`` (sink and
current page exact) is compared with the exact page masses: the exact mass inside the pages it
keeps at fixed read fractions and by the coverage rule at each gamma (with the pages that
keeps), and, on *needle rows* (a middle page holds at least ``NEEDLE_SHARE`` of the exact
group-mean share), that page's rank under the estimate and its estimated against exact share.

Then every *arm* (an estimator with a fixed fraction of each row's pages, or with the coverage
rule at a gamma) decodes the same answer steps teacher-forced on the dense answer: token
KL(dense || arm) per step and whether the arm's argmax reproduces the dense answer at every
step, which is exactly when its own greedy decode would give the same answer. An arm is
counted correct on a sample when dense answers correctly and the arm reproduces it.
"""

from __future__ import annotations

import copy
import math

import torch

from .. import estimators, reference
from .experiments import _all_pages, kl
from .hf import SparseDecoding
from .tasks import NEEDLE_TASKS, check_answer, may_still_answer

FRACTIONS = (0.15, 0.25, 0.4)  # read fractions the estimators are compared at
GAMMAS = (0.9, 0.95, 0.98)
NEEDLE_SHARE = 0.3


def _inputs(query, key_cache, block_table, seq_lens, scale):
    keys, valid = estimators.page_keys(key_cache, block_table, seq_lens[0])
    q = reference._grouped_query(query, 0, key_cache.shape[2], scale)
    return q, keys, valid


def _kept_fraction(shares, fraction):
    """Pages kept at a read fraction: sink, current page and the largest middle shares."""
    pages = shares.shape[-1]
    count = max(2, math.floor(fraction * pages + 0.5))
    if pages <= count:
        return torch.ones(pages, dtype=torch.bool)
    keep = torch.zeros(pages, dtype=torch.bool)
    keep[[0, pages - 1]] = True
    order = torch.sort(shares[1:-1], descending=True, stable=True).indices
    keep[order[: count - 2] + 1] = True
    return keep


def _kept_coverage(shares, gamma):
    pages = shares.shape[-1]
    if pages <= 2:
        return torch.ones(pages, dtype=torch.bool)
    tau, _ = reference.coverage_threshold(shares, gamma)
    keep = shares >= tau
    keep[[0, pages - 1]] = True
    return keep


def empty_stats(fractions=FRACTIONS, gammas=GAMMAS):
    return dict(rows=0, covered_at_fraction=[0.0] * len(fractions),
                pages_at_gamma=[0.0] * len(gammas), covered_at_gamma=[0.0] * len(gammas),
                needle_rows=0, needle_rank=0.0, needle_kept_at_fraction=[0] * len(fractions),
                needle_log10_share_ratio=0.0, needle_exact_share=0.0, needle_estimated_share=0.0)


class Observer:
    """A ``SparseDecoding`` observer: every estimator against the exact masses, per decode
    step (``steps[step][name]`` holds that step's sums, ``needle_heads[step]`` the (layer, KV
    head) of each needle row)."""

    def __init__(self, names, fractions=FRACTIONS, gammas=GAMMAS):
        self.names, self.fractions, self.gammas = list(names), fractions, gammas
        self.steps, self.needle_heads = [], []

    def __call__(self, layer, query, key_cache, block_table, seq_lens, scale):
        if layer == 0 or not self.steps:
            self.steps.append({name: empty_stats(self.fractions, self.gammas)
                               for name in self.names})
            self.needle_heads.append([])
        q, keys, valid = _inputs(query, key_cache, block_table, seq_lens, scale)
        exact = reference.group_shares(estimators.exact(q, keys, valid)[None])[0].double()
        heads, pages = exact.shape
        if pages <= 2:
            return
        ends = exact[:, 0] + exact[:, -1]  # [H]
        middle = exact[:, 1:-1]
        top = middle.argmax(1)  # [H]
        needle = middle.max(1).values >= NEEDLE_SHARE
        self.needle_heads[-1] += [(layer, h) for h in range(heads) if needle[h]]
        counts = [max(2, math.floor(f * pages + 0.5)) - 2 for f in self.fractions]
        for name in self.names:
            estimate = estimators.with_exact_ends(estimators.CANDIDATES[name])(q, keys, valid)
            shares = reference.group_shares(estimate[None])[0].double()  # [H, P]
            row = shares[:, 1:-1]
            order = torch.sort(row, dim=1, descending=True, stable=True).indices
            exact_sorted = torch.cumsum(torch.gather(middle, 1, order), 1)  # [H, P - 2]
            est_sorted = torch.cumsum(torch.gather(row, 1, order), 1)
            stats = self.steps[-1][name]
            stats["rows"] += heads
            for i, count in enumerate(counts):
                kept = ends + (exact_sorted[:, min(count, pages - 2) - 1] if count > 0 else 0.0)
                stats["covered_at_fraction"][i] += float(kept.sum())
            for i, gamma in enumerate(self.gammas):
                target = gamma - shares[:, 0] - shares[:, -1]  # [H]
                # the fewest middle pages (by estimate) whose estimated share reaches target
                reached = (est_sorted < target[:, None]).sum(1) + 1
                kept_count = torch.where(target <= 0, 0, reached.clamp(max=pages - 2))
                if gamma >= 1.0:
                    kept_count = torch.full_like(kept_count, pages - 2)
                covered = torch.where(kept_count > 0, torch.gather(
                    exact_sorted, 1, (kept_count - 1).clamp(min=0)[:, None])[:, 0], 0.0)
                stats["pages_at_gamma"][i] += float(((kept_count + 2) / pages).sum())
                stats["covered_at_gamma"][i] += float((ends + covered).sum())
            if not bool(needle.any()):
                continue
            rank = (row > torch.gather(row, 1, top[:, None])).sum(1)  # 0: the estimate's first
            for h in torch.nonzero(needle).flatten().tolist():
                t = int(top[h])
                stats["needle_rows"] += 1
                stats["needle_rank"] += int(rank[h]) / (pages - 2)
                for i, count in enumerate(counts):
                    stats["needle_kept_at_fraction"][i] += int(rank[h]) < count
                estimated, true = float(row[h, t]), float(middle[h, t])
                stats["needle_exact_share"] += true
                stats["needle_estimated_share"] += estimated
                stats["needle_log10_share_ratio"] += math.log10(max(estimated, 1e-30) / true)

    def totals(self, steps):
        """The sums over the first ``steps`` decode steps, per estimator."""
        out = {name: empty_stats(self.fractions, self.gammas) for name in self.names}
        for step in self.steps[:steps]:
            for name, stats in step.items():
                for key, value in stats.items():
                    if isinstance(value, list):
                        out[name][key] = [a + b for a, b in zip(out[name][key], value)]
                    else:
                        out[name][key] += value
        return out


def arm_selector(name, mode, value):
    """A ``SparseDecoding`` selector: estimator ``name`` (sink and current page exact), with a
    fixed read fraction (``mode="fraction"``) or the coverage rule (``mode="gamma"``)."""
    estimate = estimators.with_exact_ends(estimators.CANDIDATES[name])

    def select(layer, query, key_cache, block_table, seq_lens, scale):
        q, keys, valid = _inputs(query, key_cache, block_table, seq_lens, scale)
        log_masses = estimate(q, keys, valid)[None]
        if mode == "gamma":
            return reference.select(log_masses, seq_lens, gamma=value)
        count = max(2, math.floor(value * keys.shape[0] + 0.5))
        return reference.select(log_masses, seq_lens, top_k=count)

    return select


def arm_label(name, mode, value):
    return f"{name} @ {'read' if mode == 'fraction' else 'gamma'} {value:g}"


def run_sample(lm, sample, decode, names, arms, max_new_tokens=24):
    """One sample: the dense answer with every estimator's statistics, then every arm.
    ``arms``: ``(estimator name, "fraction" | "gamma", value)``. Returns a JSON-ready dict."""
    prompt = sample.prompt
    cache, _ = lm.prefill(prompt[:-1])
    observer = Observer(names)
    work = copy.deepcopy(cache)
    tokens, dense_steps, correct = [], [], False
    with SparseDecoding(select=_all_pages, observe=observer):
        token = prompt[-1]
        for _ in range(max_new_tokens):
            dense_steps.append(lm.step(token, work))
            token = int(dense_steps[-1].argmax())
            tokens.append(token)
            if check_answer(decode(tokens), sample.answers):
                correct = True
                break
            if not may_still_answer(decode(tokens), sample.answers):
                break
    steps = len(tokens)
    out = dict(task=sample.task, depth=sample.depth, answers=list(sample.answers),
               dense_output=decode(tokens), dense_correct=correct, steps=steps,
               needle_heads=sorted({h for step in observer.needle_heads[:steps] for h in step}),
               stats=observer.totals(steps), arms={})
    for name, mode, value in arms:
        arm = SparseDecoding(select=arm_selector(name, mode, value))
        forced = lm.teacher_forced(cache, [prompt[-1]] + tokens[:-1], arm)
        same = all(int(step.argmax()) == token for step, token in zip(forced, tokens))
        kls = [kl(p, q) for p, q in zip(dense_steps, forced)]
        out["arms"][arm_label(name, mode, value)] = dict(
            estimator=name, mode=mode, value=value, correct=correct and same,
            reproduces_dense=same, kl=sum(kls) / len(kls), read_fraction=arm.read_fraction)
    return out


def summarize(samples, fractions=FRACTIONS, gammas=GAMMAS):
    """Per task (and ``"all"``): dense accuracy, each arm's accuracy, KL and pages read, and
    each estimator's statistics (means over rows / needle rows)."""
    by_task = {}
    for sample in samples:
        by_task.setdefault(sample["task"], []).append(sample)
    by_task["all"] = list(samples)
    table = {}
    for task, group in by_task.items():
        entry = dict(samples=len(group),
                     dense_accuracy=sum(s["dense_correct"] for s in group) / len(group),
                     arms={}, estimators={})
        for label in group[0]["arms"]:
            rows = [s["arms"][label] for s in group if label in s["arms"]]
            entry["arms"][label] = dict(
                estimator=rows[0]["estimator"], mode=rows[0]["mode"], value=rows[0]["value"],
                accuracy=sum(r["correct"] for r in rows) / len(rows),
                kl=sum(r["kl"] for r in rows) / len(rows),
                read_fraction=sum(r["read_fraction"] for r in rows) / len(rows))
        for name in group[0]["stats"]:
            total = empty_stats(fractions, gammas)
            for s in group:
                for key, value in s["stats"][name].items():
                    total[key] = ([a + b for a, b in zip(total[key], value)]
                                  if isinstance(value, list) else total[key] + value)
            rows, needles = max(total["rows"], 1), max(total["needle_rows"], 1)
            entry["estimators"][name] = dict(
                covered_at_fraction={f"{f:g}": c / rows
                                     for f, c in zip(fractions, total["covered_at_fraction"])},
                pages_at_gamma={f"{g:g}": p / rows
                                for g, p in zip(gammas, total["pages_at_gamma"])},
                covered_at_gamma={f"{g:g}": c / rows
                                  for g, c in zip(gammas, total["covered_at_gamma"])},
                needle_rows=total["needle_rows"],
                needle_mean_rank_fraction=total["needle_rank"] / needles,
                needle_kept_at_fraction={
                    f"{f:g}": k / needles
                    for f, k in zip(fractions, total["needle_kept_at_fraction"])},
                needle_mean_exact_share=total["needle_exact_share"] / needles,
                needle_mean_estimated_share=total["needle_estimated_share"] / needles,
                needle_mean_log10_share_ratio=total["needle_log10_share_ratio"] / needles)
        table[task] = entry
    return table


STUDY_TASKS = ("passkey",) + NEEDLE_TASKS


def task_samples(task, count, encode, prose_ids, context, *, seed=0):
    """``count`` samples of ``task`` (``STUDY_TASKS``): haystacks from ``prose_ids`` (windows
    drawn by a seed of the task's own) or, for the ``code-*`` tasks, synthetic code; needle
    depth swept over ``RETRIEVAL_DEPTHS``."""
    from . import tasks
    from .experiments import RETRIEVAL_DEPTHS

    depths = [RETRIEVAL_DEPTHS[i % len(RETRIEVAL_DEPTHS)] for i in range(count)]
    task_seed = seed + 1 + STUDY_TASKS.index(task)
    if task.startswith("code-"):
        haystacks = []
        for i in range(count):
            lines = context // 4
            while True:
                ids = encode(tasks.code_haystack(lines, seed=task_seed * 1000 + i))
                if len(ids) >= context:
                    break
                lines *= 2
            haystacks.append(ids)
    else:
        haystacks = tasks.windows(prose_ids, context, count, seed=task_seed)
    out = []
    for i, (haystack, depth) in enumerate(zip(haystacks, depths)):
        if task == "passkey":
            sample = tasks.passkey(haystack, encode, context, kind="single", depth=depth,
                                   seed=task_seed * 1000 + i)
            out.append(tasks.NeedleSample(sample.prompt, (sample.answer,), "passkey", depth,
                                          len(encode(f" The pass key is {sample.answer}. "
                                                     f"Remember it. {sample.answer} is the "
                                                     f"pass key."))))
        else:
            out.append(tasks.needle_task(task, haystack, encode, context, depth=depth,
                                         seed=task_seed * 1000 + i))
    return out
