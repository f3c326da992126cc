"""How many bisection passes Select needs with its early exit (a float64 model of the kernel's
loop in ``moira/kernels/select.py``), on ``moira.synthetic`` rows (Llama-3.1-8B geometry: 8 KV
heads, G = 4, head_dim 128; mvar estimates from the float32 reference), coverage rule at
gamma 0.98 and fixed count at 22% of the row. Runs on a CPU in a minute.

    PYTHONPATH=. python benchmarks/select_passes.py [--out benchmarks/results/select-passes.json]
"""

import argparse
import json
import math
import sys
import time

import torch

from moira import reference as ref
from moira.config import BISECTION_BITS, MoiraConfig
from moira.synthetic import synthetic_context


def passes(candidate, ways, max_passes, enough):
    """Passes until at most one share lies strictly inside (lo, hi); ``enough(tau)`` is the
    mode's test of a threshold."""
    lo, hi = 0.0, float(candidate.max()) * (1 + 1e-6) + 1e-30  # strictly above every share
    count = 0
    while count < max_passes and int(((candidate > lo) & (candidate < hi)).sum()) > 1:
        taus = [lo + (hi - lo) * k / ways for k in range(ways)]
        good = [tau for tau in taus if enough(tau)]
        bad = [tau for tau in taus if not enough(tau)]
        lo, hi = max(good, default=lo), min(bad, default=hi)
        count += 1
    return count


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--contexts", default="2048,8192,32768,131072")
    parser.add_argument("--width", type=int, default=1030,
                        help="block-table pages of the engine (sets K_B), at least the row's")
    parser.add_argument("--seeds", default="1,2")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    for seed in map(int, args.seeds.split(",")):
        for context in map(int, args.contexts.split(",")):
            ctx = synthetic_context(context, batch=1, num_kv_heads=8, group=4, head_dim=128,
                                    device="cpu", seed=seed)
            summaries = ref.summarize(ctx.key_cache, ctx.block_table, ctx.seq_lens)
            shares = ref.group_shares(ref.estimate(ctx.query, ctx.key_cache, summaries,
                                                   ctx.block_table, ctx.seq_lens)).double()
            pages = ref.num_pages(ctx.seq_lens[0], shares.shape[-1])
            ways = MoiraConfig().bisection_ways_for(max(args.width, pages))
            max_passes = BISECTION_BITS // int(math.log2(ways))
            needed = max(2, round(0.22 * pages)) - 2
            coverage, fixed = [], []
            for head in range(8):
                row = shares[0, head, :pages]
                middle = row[1:-1]
                target = 0.98 - float(row[0]) - float(row[-1]) + 2e-6
                coverage.append(passes(middle, ways, max_passes,
                                       lambda tau: float(middle[middle >= tau].sum()) >= target))
                fixed.append(passes(middle, ways, max_passes,
                                    lambda tau: int((middle >= tau).sum()) >= needed))
            rows.append(dict(seed=seed, context=context, pages=pages, k_b=ways,
                             max_passes=max_passes, coverage_passes=coverage,
                             fixed_22pct_passes=fixed))
            print(f"seed {seed} {context:>7} tokens ({pages} pages, K_B {ways}, at most "
                  f"{max_passes}): coverage {sum(coverage) / 8:.2f}, fixed 22% "
                  f"{sum(fixed) / 8:.2f} passes", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(command="python " + " ".join(sys.argv), date=time.strftime("%Y-%m-%d"),
                           torch=torch.__version__, width=args.width, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
