"""Would FP8 page summaries select the same pages? (issue 3: Estimate's bytes)

The Estimate streams every page's summary (mean and variance, 2 x D values in the cache's
dtype) at about the HBM's peak rate per extra byte (NOTES, session 43: T ~ 6.4 us + 0.207 us
per MB at 130k x 4), so summaries of one byte per value would take ~3.5 us per layer off
130k x 4's Estimate (the bound measured since, ``tune_kernels.py --kinds halfbytes``: 1.3 us;
NOTES, session 49). This study asks what that costs in selection, before any kernel is
built: on a trained model, each decode step of each layer selects its pages (coverage rule,
``moira.reference``) from summaries rounded to bfloat16 (what the kernels store now) and
to FP8 in several forms, on the same queries and keys, and records how the FP8 lists differ
from the bfloat16 ones and how much exact attention mass each keeps. The model decodes with
the bfloat16 lists (so every arm sees the same caches) along its dense greedy continuation.

    PYTHONPATH=. python benchmarks/summary_precision_study.py --documents 4 --new-tokens 32 \
        --out benchmarks/results/summary-precision-smollm2-135m-4k.json --plot P.png

Forms (each applied to the float32 summaries of ``reference.summarize``):
- ``bf16``: both statistics in bfloat16 (the baseline);
- ``e4m3``: both cast to float8_e4m3fn (clamped to its +-448);
- ``e4m3 scaled``: each (page, KV head, statistic) vector divided by its absolute maximum / 448
  before the cast (one float32 scale beside each: 8 bytes per page and head);
- ``var e4m3``: the mean in bfloat16, the variance scaled to e4m3 (a quarter fewer bytes).
"""

import argparse
import json
import os
import sys
import time

import torch

from moira import reference
from moira.evaluation import hf
from moira.evaluation.tasks import windows

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from calibration_study import DEFAULT_MODEL, DEFAULT_TEXT, load  # noqa: E402

E4M3_MAX = 448.0


def _e4m3(x):
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()


def _e4m3_scaled(x):
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30) / E4M3_MAX
    return _e4m3(x / scale) * scale


def _bf16(x):
    return x.to(torch.bfloat16).float()


# summaries [pages, kv_heads, 2 (mean, variance), D] -> the same, rounded
FORMS = {
    "bf16": _bf16,
    "e4m3": _e4m3,
    "e4m3 scaled": _e4m3_scaled,
    "var e4m3": lambda s: torch.stack([_bf16(s[:, :, 0]), _e4m3_scaled(s[:, :, 1])], dim=2),
}


def comparing_select(gamma, stats):
    """A ``SparseDecoding`` selector (batch 1) that returns the bf16 form's lists and adds, per
    form, each row's list length, its exact kept mass and its overlap with the bf16 list."""

    def select(layer, query, key_cache, block_table, seq_lens, scale):
        summaries = reference.summarize(key_cache, block_table, seq_lens)
        shares = reference.group_shares(reference.exact_log_masses(
            query, key_cache, block_table, seq_lens, scale))
        chosen = {}
        for name, form in FORMS.items():
            log_masses = reference.estimate(query, key_cache, form(summaries), block_table,
                                            seq_lens, scale)
            chosen[name] = reference.select(log_masses, seq_lens, gamma=gamma)
        base_lists, base_counts = chosen["bf16"]
        for name, (lists, counts) in chosen.items():
            row = stats.setdefault(name, dict(rows=0, identical=0, pages=0, base_pages=0,
                                              only_here=0, only_base=0, kept_mass=0.0,
                                              min_kept_mass=1.0))
            for head in range(counts.shape[1]):
                kept = set(lists[0, head, : counts[0, head]].tolist())
                base = set(base_lists[0, head, : base_counts[0, head]].tolist())
                mass = float(shares[0, head, sorted(kept)].sum())
                row["rows"] += 1
                row["identical"] += kept == base
                row["pages"] += len(kept)
                row["base_pages"] += len(base)
                row["only_here"] += len(kept - base)
                row["only_base"] += len(base - kept)
                row["kept_mass"] += mass
                row["min_kept_mass"] = min(row["min_kept_mass"], mass)
        return base_lists, base_counts

    return select


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--text", default=DEFAULT_TEXT)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--documents", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--gamma", type=float, default=0.98)
    parser.add_argument("--out", required=True)
    parser.add_argument("--plot", help="a PNG of the table")
    args = parser.parse_args()

    lm, _, evaluation_ids = load(args)  # the text's second half, as the calibration study's
    docs = windows(evaluation_ids, args.context, args.documents, seed=11)
    stats, start = {}, time.time()
    for index, doc in enumerate(docs):
        cache, logprobs = lm.prefill(doc)
        tokens, _ = lm.greedy(cache, logprobs, args.new_tokens)
        lm.teacher_forced(cache, tokens[:-1],
                          hf.SparseDecoding(select=comparing_select(args.gamma, stats)))
        print(f"document {index + 1}/{len(docs)} ({time.time() - start:.0f} s)", flush=True)
    table = {name: dict(rows=s["rows"], identical_lists=s["identical"] / s["rows"],
                        pages_vs_bf16=s["pages"] / s["base_pages"],
                        pages_only_here=s["only_here"] / s["base_pages"],
                        bf16_pages_missed=s["only_base"] / s["base_pages"],
                        mean_kept_mass=s["kept_mass"] / s["rows"],
                        min_kept_mass=s["min_kept_mass"])
             for name, s in stats.items()}
    with open(args.out, "w") as f:
        json.dump(dict(table=table, model=os.path.basename(args.model), context=args.context,
                       documents=args.documents, new_tokens=args.new_tokens, gamma=args.gamma,
                       command=" ".join(sys.argv), date=time.strftime("%Y-%m-%d"),
                       seconds=round(time.time() - start), torch=torch.__version__), f,
                  indent=1)
    print("| form | rows | identical lists | pages vs bf16 | pages not in bf16's | bf16's pages "
          "missed | mean exact mass kept | min |")
    print("|---|---|---|---|---|---|---|---|")
    for name, row in table.items():
        print(f"| {name} | {row['rows']} | {row['identical_lists']:.3f} | "
              f"{row['pages_vs_bf16']:.4f} | {row['pages_only_here']:.4f} | "
              f"{row['bf16_pages_missed']:.4f} | {row['mean_kept_mass']:.4f} | "
              f"{row['min_kept_mass']:.3f} |")
    if args.plot:
        plot(table, args.plot, f"{os.path.basename(args.model)}, {args.context} tokens, "
             f"gamma = {args.gamma}, {args.documents} documents x {args.new_tokens - 1} steps")


def plot(table, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(table)
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    panels = [("identical_lists", "lists identical to bf16's"),
              ("bf16_pages_missed", "bf16's pages not selected (per bf16 page)"),
              ("mean_kept_mass", "exact attention mass kept (mean)")]
    for ax, (key, label) in zip(axes, panels):
        values = [table[name][key] for name in names]
        ax.bar(names, values, color=["#999999"] + ["#1f77b4"] * (len(names) - 1))
        ax.set_title(label, fontsize=9)
        ax.tick_params(axis="x", labelsize=8)
        if key == "mean_kept_mass":
            ax.set_ylim(min(values) - 0.002, max(values) + 0.001)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
