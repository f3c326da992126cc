"""Summarize ``vllm_checks.py`` results: greedy-token agreement and log-probability differences
between runs, Moira's dense-check counters, and pages read.

    python benchmarks/vllm_compare.py benchmarks/results/vllm-checks-2026-11-29 [MORE_FOLDERS]

Several folders are read as one (run names must differ), so runs of different sessions can be
compared.
"""

import gzip
import json
import os
import sys


def agreement(a, b):
    """(prompts with identical tokens, first differing step or None per prompt, max |dlogprob|
    over the common prefix, bit-identical log-probs)."""
    same, first_diff, worst, bitwise = 0, [], 0.0, True
    for x, y in zip(a, b):
        same += x["tokens"] == y["tokens"]
        diff = next((i for i, (s, t) in enumerate(zip(x["tokens"], y["tokens"])) if s != t),
                    None)
        first_diff.append(diff)
        prefix = len(x["tokens"]) if diff is None else diff
        deltas = [abs(p - q) for p, q in zip(x["logprobs"][:prefix], y["logprobs"][:prefix])]
        worst = max([worst] + deltas)
        bitwise &= x["logprobs"] == y["logprobs"]
    return same, first_diff, worst, bitwise


def gaps_at_first_difference(a, b):
    """The top-2 log-prob gap (logit gap) of run ``a`` at each prompt's first differing step,
    for prompts that differ; None where ``a`` has no gaps recorded (runs before session 9)."""
    gaps = []
    for x, diff in zip(a, agreement(a, b)[1]):
        if diff is not None:
            if x.get("top2_gap") is None:
                return None
            gaps.append(x["top2_gap"][diff])
    return gaps


# the runs compared with dense FA3 at the same batch, each a perturbation of attention alone:
# Moira at gamma 1, FA3 capped at one split, and FlashInfer's decode kernel (another exact
# dense kernel: how early a kernel that is not FA3 parts from it without any selection)
YARDSTICKS = {"moira_graph": "dense vs Moira gamma=1",
              "dense_splits1": "dense vs dense with FA3 at one split",
              "dense_flashinfer": "dense FA3 vs dense FlashInfer"}


def first_difference_gap(runs):
    """Issue 4's yardstick on greedy tokens: the first differing step per prompt (a sequence
    that never differs counts as its length) of dense FA3 against Moira at gamma 1, and of
    dense against itself at another batch size; the mean of each and the 95% paired bootstrap
    interval of (Moira pair - dense pair). Where a ``dense_splits1`` run (dense FA3 capped at
    one split, same batch: attention's rounding alone changed) or a ``dense_flashinfer`` run
    (FlashInfer's kernel in FA3's place) is present, the same for it, and Moira's pair against
    it (``moira_minus_<run>``). None without the runs."""
    from moira.evaluation.experiments import paired_bootstrap

    if not ("dense" in runs and "halves" in runs["dense"]
            and any(name in runs for name in YARDSTICKS)):
        return None

    def steps(a, b):
        return [len(x["tokens"]) if d is None else d for x, d in zip(a, agreement(a, b)[1])]

    dense_pair = steps(runs["dense"]["full"], runs["dense"]["halves"])
    result = dict(prompts=len(dense_pair), dense=sum(dense_pair) / len(dense_pair))
    pairs = {name: steps(runs["dense"]["full"], runs[name]["full"])
             for name in YARDSTICKS if name in runs}
    for name, pair in pairs.items():
        key = "moira" if name == "moira_graph" else name
        result[key] = sum(pair) / len(pair)
        result[f"{key}_minus_dense"] = paired_bootstrap(dense_pair, pair)
    for name, pair in pairs.items():
        if name != "moira_graph" and "moira_graph" in pairs:
            result[f"moira_minus_{name}"] = paired_bootstrap(pair, pairs["moira_graph"])
    return result


def load_runs(folder):
    """``vllm_checks.py`` results by run name: ``NAME.json`` as written on the GPU host, or
    ``NAME.json.gz`` as committed (token ids and log-probs compress about fivefold)."""
    runs = {}
    for name in sorted(os.listdir(folder)):
        for suffix, opener in ((".json", open), (".json.gz", gzip.open)):
            if name.endswith(suffix):
                with opener(os.path.join(folder, name), "rt") as f:
                    runs[name[:-len(suffix)]] = json.load(f)
    return runs


def main():
    runs = {}
    for folder in sys.argv[1:]:
        for name, run in load_runs(folder).items():
            if name in runs:
                sys.exit(f"run {name!r} is in two of the folders: compare them apart")
            runs[name] = run
    prompts = len(runs["dense"]["full"]) if "dense" in runs else 0
    # runs before session 11 did not record it (their args say what was asked for; at compile
    # mode 0 vLLM ran FULL_AND_PIECEWISE as NONE)
    moira_graphs = runs.get("moira_graph", {}).get("cudagraph_mode", "graph mode not recorded")
    pairs = [("dense", "full", "dense", "halves",
              f"dense batch {prompts} vs two batches of {prompts // 2}"),
             ("dense", "full", "moira_graph", "full",
              f"dense FA3 vs Moira gamma=1 ({moira_graphs})"),
             ("dense", "full", "dense_splits1", "full",
              "dense FA3 vs dense FA3 at one split (same batch: attention's rounding alone)"),
             ("dense", "full", "dense_flashinfer", "full",
              "dense FA3 vs dense FlashInfer (same batch: another exact kernel)"),
             ("dense_flashinfer", "full", "dense_flashinfer", "halves",
              f"dense FlashInfer batch {prompts} vs two batches of {prompts // 2}"),
             ("dense", "full", "dense_eager", "full",
              "dense FULL graphs vs dense eager (graph mode NONE): the control"),
             ("moira_graph", "full", "moira_eager", "full",
              "Moira FULL graphs vs Moira eager (graph mode NONE)"),
             ("moira_graph", "full", "moira_check", "full",
              "Moira FULL graphs vs Moira eager attention (+dense check)"),
             ("dense", "full", "preempt_dense", "full", "dense vs dense with preemption"),
             ("moira_graph", "full", "preempt_moira", "full", "Moira vs Moira with preemption"),
             # session 4's names: Moira at gamma 0.9 (summaries matter), checks apart
             ("dense", "full", "preempt-dense", "full", "dense vs dense with preemption"),
             ("moira-g09", "full", "preempt-moira", "full",
              "Moira gamma=0.9 vs the same with preemption"),
             # session 23: MOIRA_FUSED_CACHE_WRITE=0 / 1 (vLLM's write kernel / Estimate's)
             ("fcw0", "full", "fcw1", "full",
              "Moira with vLLM's cache write vs the write in Estimate's launch"),
             # session 24: the default engine (the write in Estimate) on another host and
             # commit, and with vLLM's jit_monitor_verbose (--jit-verbose) on two hosts
             ("fcw1", "full", "plain", "full",
              "session 23's fcw1 vs the same command a session later (another host)"),
             ("plain", "full", "verbose_host2", "full",
              "without vs with --jit-verbose, one host"),
             ("verbose_host1", "full", "verbose_host2", "full",
              "--jit-verbose on two hosts")]
    # prefix mode: prefix-cache hits against the same prompts recomputed, in one engine
    pairs += [(name, "full", name, "recomputed", f"{name}: prefix-cache hits vs recomputed")
              for name, run in runs.items() if "recomputed" in run]
    # the first token's log-probability comes from the prefill step (FA3 on both sides): where
    # it differs, the two engines parted before any decode step
    print("| comparison | prompts with identical tokens | first differing step per prompt | "
          "max abs logprob diff before it | bit-identical logprobs | first token's logprob "
          "bit-identical | top-2 logit gap at the first difference |\n"
          "|---|---|---|---|---|---|---|")
    for a, ka, b, kb, label in pairs:
        if a in runs and b in runs and ka in runs[a] and kb in runs[b]:
            same, first_diff, worst, bitwise = agreement(runs[a][ka], runs[b][kb])
            steps = " ".join("-" if d is None else str(d) for d in first_diff)
            first_same = sum(x["logprobs"][:1] == y["logprobs"][:1]
                             for x, y in zip(runs[a][ka], runs[b][kb]))
            gaps = [gap for gap in gaps_at_first_difference(runs[a][ka], runs[b][kb]) or []
                    if gap is not None]  # None: a step with one candidate token
            # and how common such near-ties are at all in the reference run: with random
            # weights the logits are flat, so a share of every run's steps are near-ties
            every_gap = [g for x in runs[a][ka] for g in x.get("top2_gap") or [] if g is not None]
            near_ties = ("–" if not gaps else
                         f"max {max(gaps):.3g}, {sum(g <= 0.25 for g in gaps)}/{len(gaps)} "
                         f"≤ 0.25 (of all steps: "
                         f"{sum(g <= 0.25 for g in every_gap) / len(every_gap):.1%})")
            print(f"| {label} | {same}/{len(runs[a][ka])} | {steps} | {worst:.3g} | "
                  f"{bitwise} | {first_same}/{len(runs[a][ka])} | {near_ties} |")
    gap = first_difference_gap(runs)
    if gap:
        print(f"\nfirst differing step, mean over {gap['prompts']} prompts: dense vs dense at "
              f"another batch size {gap['dense']:.1f}")

        def interval(diff):
            return f"{diff['mean']:+.1f} [{diff['low']:+.1f}, {diff['high']:+.1f}]"

        for name, label in YARDSTICKS.items():
            key = "moira" if name == "moira_graph" else name
            if key in gap:
                print(f"{label}: {gap[key]:.1f}; minus the dense pair "
                      f"{interval(gap[key + '_minus_dense'])} (95% paired bootstrap)")
        for name in YARDSTICKS:
            if f"moira_minus_{name}" in gap:
                print(f"Moira pair minus the {YARDSTICKS[name]} pair "
                      f"{interval(gap[f'moira_minus_{name}'])}")
    modes = {name: run.get("cudagraph_mode", "not recorded") for name, run in runs.items()}
    print("\nCUDA graph mode each engine ran: "
          + ", ".join(f"{name} {mode}" for name, mode in modes.items()))
    for name, run in runs.items():
        check = run.get("dense_check")
        if check:
            layers = list(check.values())
            if isinstance(layers[0], dict):
                total = {k: sum(layer[k] for layer in layers) for k in layers[0]}
                worst = {k: max(layer[k] for layer in layers) for k in layers[0]}
                n = max(total["decode_elements"], 1)
                print(f"\n{name}: decode rows, Moira vs FA3: max {worst['moira_max_ulps']:g} "
                      f"bf16 ulps, {total['moira_over_1_ulp'] / n:.2e} of elements > 1 ulp, "
                      f"{total['moira_over_4_ulps'] / n:.2e} > 4 ulps; FA3 one split vs FA3: "
                      f"max {worst['fa3_split_max_ulps']:g}, "
                      f"{total['fa3_split_over_1_ulp'] / n:.2e} > 1 ulp, "
                      f"{total['fa3_split_over_4_ulps'] / n:.2e} > 4 ulps; other rows: "
                      f"{int(total['other_rows_differing'])} of "
                      f"{int(total['other_elements'])} elements not bit-identical")
                if "other_rows_differing_one_split" in total:  # since session 11
                    print(f"{name}: other rows in one split, the engine's FA3 call (the batch "
                          f"without its decode rows) vs FA3 over the whole batch: "
                          f"{int(total['other_rows_differing_one_split'])} elements differ")
                if "other_rows_split_in_whole_batch" in total and total["other_elements"]:
                    print(f"{name}: other rows, FA3 over the whole batch vs itself in one "
                          f"split: {int(total['other_rows_split_in_whole_batch'])} elements "
                          f"differ")
                if "moira_max_abs" in total:  # since session 8: the paper's measure too
                    print(f"{name}: at the scale of each head's output (the paper's 1-ulp "
                          f"bound): Moira vs FA3 max |diff| {worst['moira_max_abs']:.3g}, "
                          f"{total['moira_over_1_head_ulp'] / n:.2e} of elements > 1 ulp; FA3 "
                          f"one split vs FA3 max |diff| {worst['fa3_split_max_abs']:.3g}, "
                          f"{total['fa3_split_over_1_head_ulp'] / n:.2e} > 1 ulp")
                if total.get("moira_exact_abs_sum"):  # since session 10: against float32
                    print(f"{name}: against exact float32 attention over every page, mean "
                          f"|error| Moira {total['moira_exact_abs_sum'] / n:.3e}, FA3 "
                          f"{total['fa3_exact_abs_sum'] / n:.3e}, FA3 one split "
                          f"{total['fa3_split_exact_abs_sum'] / n:.3e}; largest "
                          f"{worst['moira_exact_max_abs']:.3g} / {worst['fa3_exact_max_abs']:.3g}"
                          f" / {worst['fa3_split_exact_max_abs']:.3g}")
                if "moira_exact_outward_sum" in total:  # since session 11: a lean, if any
                    print(f"{name}: mean error along the exact value's sign (> 0: away from "
                          f"zero) Moira {total['moira_exact_outward_sum'] / n:+.3e}, FA3 "
                          f"{total['fa3_exact_outward_sum'] / n:+.3e}, FA3 one split "
                          f"{total['fa3_split_exact_outward_sum'] / n:+.3e}")
            else:  # the first format: (max ulps, > 1 ulp, compared, other differing, compared)
                totals = [sum(v[i] for v in layers) for i in range(5)]
                worst = max(v[0] for v in layers)
                print(f"\n{name}: decode rows vs dense FA3: max {worst:g} bf16 ulps, "
                      f"{int(totals[1])} of {int(totals[2])} elements beyond 1 ulp "
                      f"({totals[1] / max(totals[2], 1):.2e}); other rows: {int(totals[3])} of "
                      f"{int(totals[4])} elements not bit-identical")
        if run.get("pages") and run["pages"]["fraction"] is not None:
            print(f"{name}: pages read {run['pages']['fraction']:.3f} of present, "
                  f"all finished: {run['all_finished']}, prompts {len(run['lengths'])} x "
                  f"{run['lengths'][0]}.., startup {run['startup_s']} s, generate "
                  f"{run['full_s']:.1f} s"
                  + (f", preemptions {run['preemptions']:g}" if "preemptions" in run else ""))


if __name__ == "__main__":
    main()
