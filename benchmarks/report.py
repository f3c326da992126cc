"""Tables, plots and markdown sections from the benchmarks' result files (no GPU needed).

    python3 benchmarks/report.py tpot FOLDER... [--pairs] [--plot PNG] [--readme MD --section S]
    python3 benchmarks/report.py serve FOLDER... [--plot PNG] [--readme MD --section S]
    python3 benchmarks/report.py step FOLDER... [--plot PNG] [--readme MD --section S]
    python3 benchmarks/report.py kernels kernels.json [--readme MD --section S]
    python3 benchmarks/report.py estimators STUDY.json[.gz] [--readme MD --section S]
    python3 benchmarks/report.py single single.json... --split|--programs
    python3 benchmarks/report.py tune tune.json [--kind estimate] [--baseline default]
    python3 benchmarks/report.py accuracy-vllm DIR|summary.json [--readme MD]
    python3 benchmarks/report.py accuracy RESULT.json... [--merge-into F] [--readme MD]
    python3 benchmarks/report.py calibration PART.json... --out F [--plot PNG] [--readme MD]
    python3 benchmarks/report.py headline --tpot PAIR... --tpot-099 PAIR... \
        --serve-a FOLDER... --serve-b FOLDER... --accuracy summary.json [--readme README.md]

- ``tpot``: ``vllm_tpot.py`` runs (one JSON per engine: ``<model>-dense.json``,
  ``<model>-moira-g098.json`` / ``-g099.json``, variants ``-<arm>.json``); TPOT of dense FA3
  and Moira, speedups against the paper's Tables 3 and 7; with ``--pairs`` each folder is one
  interleaved pair (``vllm_tpot.py --pairs``): per-pair and mean speedups, and at the
  batch-1 shapes TPOT relative to each pair's dense engine.
- ``serve``: ``vllm_serve.py`` runs (``serve-<arm>-<set>-<concurrency>[-*].json``): output
  throughput and median TPOT per arm against dense FA3 on the same workload; slices of one set
  (``--offset``/``--limit``) pooled into one row.
- ``step``: ``vllm_step_profile.py`` runs (``step-dense.json``, ``step-moira.json`` per
  folder): one decode step by kernel class beside the paper's Table 4.
- ``kernels``: ``kernel_bench.py suite``'s JSON: a Figure-4-style PNG (time per layer against the
  CV of the row lengths) and tables; Moira's configured arms against ``moira``.
- ``single``: ``kernel_bench.py single``'s ``--split-sweep`` / ``--programs-sweep`` arms over runs.
- ``tune``: ``tune.py``'s JSON: every variant of one kind per shape against the shape's
  default (the mean of ``default`` and ``default again``); a PNG and a table.
- ``accuracy-vllm``: ``accuracy.py vllm``'s arms (a folder with their ``.npz``), or a summary
  written before: pass-key accuracy, token KL (a lower bound), repeated-passage perplexity.
- ``accuracy``: ``moira eval`` result files (``accuracy.py eval``): tables and plots;
  ``--merge-into`` joins runs of one model and context that measured different tasks.
- ``calibration``: ``accuracy.py calibrated-kl``'s parts: KL and pages read per arm.
- ``headline``: the README's headline table from the committed results.

``--readme FILE`` replaces the text between ``<!-- SECTION:begin -->`` and
``<!-- SECTION:end -->`` in FILE (``.ci/readme-tables`` regenerates every table this way).
"""

import argparse
import gzip
import json
import os
import re
import statistics
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import repo_path, run_info, write_section  # noqa: E402
from kernel_bench import CHECK_TOLERANCE, config_fields  # noqa: E402



# ============================================================================================
# tpot: time per output token in vLLM
# ============================================================================================

TPOT_SHAPES = ["8k32", "16k32", "32k16", "64k8", "130k4", "2k1", "8k1", "16k1", "32k1",
               "64k1", "2k2", "8k2", "2k4", "8k4", "16k4"]
# short requests, one to four at a time: rows read in full up to 20,480 / B
# tokens; --pairs reports them relative to each pair's dense engine
SHORT_SHAPES = {"2k1", "8k1", "16k1", "32k1", "64k1", "2k2", "8k2", "2k4", "8k4", "16k4"}
# the paper's speedups of Moira over dense FA3 (Table 3: gamma 0.98, Table 7: gamma 0.99) and
# the aims set at gamma 0.98
TPOT_PAPER = {("llama-3.1-8b", 0.98): [1.38, 1.78, 1.89, 2.62, 2.64],
         ("llama-3.1-8b", 0.99): [1.25, 1.49, 1.68, 2.16, 2.27],
         ("qwen3-4b", 0.98): [1.38, 1.76, 1.91, 2.44, 2.69],
         ("qwen3-4b", 0.99): [1.23, 1.48, 1.60, 2.02, 2.27]}
AIM = {("llama-3.1-8b", 0.98): [1.5, 2.0, 2.1, 2.9, 3.0]}


def tpot_by_shape(run):
    """Median over repeats of each repeat's median-over-requests TPOT (ms), per shape."""
    by_shape = {}
    for row in run["results"]:
        by_shape.setdefault(row["shape"], []).append(row["tpot_ms"])
    return {shape: statistics.median(values) for shape, values in by_shape.items()}


# kernel variants: a run's flag and its column's label. fused_select and fused_merge (Select in
# Estimate's launch, Merge in Attend's) were options, removed after measuring slower or too
# little faster; kept here as labels so that their runs' files still load
VARIANTS = (("programmatic_launch", "pdl"), ("fused_select", "fsel"), ("fused_merge", "fmerge"),
            ("fused_cache_write", "fcw"))
JNOCAP_LABEL = "Moira, J from Eq. 4 alone (max_chunks_per_row 4096: no ceiling on J)"
# the batch-shape pairs table's labels for a third engine's column (others: "Moira, <kind>")
PAIR_VARIANT_LABELS = {"fsel": "the same, Estimate + Select in one launch",
                       "fcw": "Moira, K/V written in Estimate's launch (fused_cache_write)",
                       "nofcw": "Moira, K/V written by vLLM's kernel (fused_cache_write off)",
                       "split": "Moira, Attend's split set (floor_rows, min_programs, "
                                "min_chunks_per_row: in its JSON)",
                       "Jmax=4096": JNOCAP_LABEL,
                       "HND": "Moira on vLLM's head-major cache (VLLM_KV_CACHE_LAYOUT=HND)",
                       "kern": "Moira, kernel options set (kernels: in its JSON)"}


def tpot_load(folders):
    runs = {}
    for folder, name in sorted((folder, name) for folder in folders
                               for name in os.listdir(folder)):
        if name.endswith(".json"):
            with open(os.path.join(folder, name)) as f:
                run = json.load(f)
            if run["backend"] == "moira" and run.get("schedule", "rows") != "rows":
                continue  # the table compares the default kernels; variants: their own folder
            key = (run["model"], "dense" if run["backend"] == "dense" else run["gamma"])
            if run.get("dense_below_tokens") and run["gamma"] == 0.98:
                # short requests read in full: its own column (γ = 0.99 runs: their γ column)
                key = (run["model"], "fallback")
            # the plugin's defaults when the run was made (older files: every flag off). So
            # the base Moira column is the default of its time (vLLM's cache write, or the write
            # in Estimate's launch): keep folders of both eras apart
            defaults = run.get("plugin_defaults") or {}
            # kernel variants of the same (programmatic launch; in older files Select in
            # Estimate's launch, Merge in Attend's): a column each, "+"-joined when combined
            # (a former arm fboth is "fsel+fmerge")
            variant = "+".join(arm for flag, arm in VARIANTS
                               if run.get(flag) and not defaults.get(flag))
            if run.get("fused_cache_write") is False and defaults.get("fused_cache_write"):
                variant = "+".join(filter(None, [variant, "nofcw"]))  # the default turned off
            if any(run.get(key) is not None
                   for key in ("floor_rows", "min_programs", "min_chunks_per_row")):
                variant = "+".join(filter(None, [variant, "split"]))  # Attend's split changed
            if run.get("max_chunks_per_row") is not None:  # the ceiling on J
                variant = "+".join(filter(None, [variant, f"Jmax={run['max_chunks_per_row']}"]))
            if run.get("step_programs") is not None:  # the short-row floor (0: Eq. 4 alone)
                variant = "+".join(filter(None, [variant, f"T={run['step_programs']}"]))
            if run.get("kv_cache_layout"):  # VLLM_KV_CACHE_LAYOUT (arm hnd)
                variant = "+".join(filter(None, [variant, run["kv_cache_layout"]]))
            # kernel options (KernelOptions; older files: kernel_settings, module constants)
            if run.get("kernels") or run.get("kernel_settings"):
                variant = "+".join(filter(None, [variant, "kern"]))
            if run.get("launched_programs"):  # Attend's grid (an arm since removed)
                variant = "+".join(filter(None, [variant, f"P={run['launched_programs']}"]))
            if variant:
                key = (run["model"], variant)
            if key in runs:
                raise SystemExit(f"{folder}: two runs for {key} ({name})")
            runs[key] = run
    for (model, kind), run in list(runs.items()):
        # the plugin's default reads rows of <= N/B tokens in full, which changes nothing at
        # the batch shapes: without a run that turns it off, it is the γ column's run
        if kind == "fallback":
            runs.setdefault((model, run["gamma"]), run)
    return runs


def tpot_table(runs):
    lines = ["| model | shape | dense FA3 (ms) | Moira γ=0.98 (ms) | reads | speedup | paper | "
             "aim | Moira γ=0.99 (ms) | reads | speedup | paper |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    rows = []
    for model in sorted({model for model, _ in runs}):
        dense = runs.get((model, "dense"))
        if dense is None:
            continue
        dense_ms = tpot_by_shape(dense)
        for index, shape in enumerate(TPOT_SHAPES):
            if shape not in dense_ms:
                continue
            cells = [model, shape, f"{dense_ms[shape]:.2f}"]
            row = dict(model=model, shape=shape, dense_ms=dense_ms[shape])
            for gamma in (0.98, 0.99):
                run = runs.get((model, gamma))
                ms = tpot_by_shape(run).get(shape) if run else None
                reads = next((r["imposed_read_fraction"] for r in run["results"]
                              if r["shape"] == shape), None) if run else None
                paper = (TPOT_PAPER.get((model, gamma), []) + [None] * len(TPOT_SHAPES))[index]
                aim = (AIM.get((model, gamma), []) + [None] * len(TPOT_SHAPES))[index]
                speedup = dense_ms[shape] / ms if ms else None
                row[f"g{gamma}"] = dict(ms=ms, reads=reads, speedup=speedup, paper=paper)
                cells += [f"{ms:.2f}" if ms else "–", f"{reads:.2f}" if reads else "–",
                          f"**{speedup:.2f}×**" if speedup else "–",
                          f"{paper:.2f}×" if paper else "–"]
                if gamma == 0.98:
                    cells.append(f"{aim:.1f}×" if aim else "–")
            lines.append("| " + " | ".join(cells) + " |")
            rows.append(row)
    return "\n".join(lines), rows


def pairs_table(pair_runs):
    """Interleaved pairs (dense, Moira, dense, Moira engines one after another): one
    ``load`` result per pair; per (model, shape) each pair's speedup and their mean, the
    protocol of the paper's Table 3 (its pairs' speedups differ by at most 0.13)."""
    cells, variants, cells_099 = {}, {}, {}
    # kernel variants (a third engine per pair: vllm_tpot.py --pairs arms such as n1024): a
    # column pair each, in the order of PAIR_VARIANT_LABELS, then any other by name
    kinds = sorted({kind for runs in pair_runs for _, kind in runs
                    if kind not in ("dense", "fallback", 0.98, 0.99)},
                   key=lambda kind: (list(PAIR_VARIANT_LABELS).index(kind)
                                     if kind in PAIR_VARIANT_LABELS else len(PAIR_VARIANT_LABELS),
                                     str(kind)))
    for runs in pair_runs:
        for row in tpot_table(runs)[1]:
            # each pair's dense engine, and Moira at γ = 0.98's reads where the pair ran it (a
            # pair of dense and γ = 0.99 alone keeps its place: "–")
            at_098 = row["g0.98"]
            cells.setdefault((row["model"], row["shape"]), []).append(
                (row["dense_ms"], at_098["ms"], at_098["speedup"], at_098["paper"]))
            # Moira at Table 7's reads (γ = 0.99) where the pair ran it; a pair without the
            # run keeps its place ("–")
            at_099 = row["g0.99"]
            cells_099.setdefault((row["model"], row["shape"]), []).append(
                (at_099["ms"], at_099["speedup"], at_099["paper"]) if at_099["speedup"] else None)
            for kind in kinds:
                variant = runs.get((row["model"], kind))
                ms = tpot_by_shape(variant).get(row["shape"]) if variant else None
                # a pair without the run keeps its place ("–"), so each value names its pair
                variants.setdefault(kind, {}).setdefault((row["model"], row["shape"]), []).append(
                    row["dense_ms"] / ms if ms else None)
    # pairs of dense and γ = 0.99 alone (Table 7's runs) leave out γ = 0.98's empty columns
    has_098 = any(speedup for pairs in cells.values() for _, _, speedup, _ in pairs)
    lines = ["| model | shape | dense FA3 (ms) |", "|---|---|---|"]
    if has_098:
        lines[0] += " Moira γ=0.98 (ms) | speedup per pair | mean speedup | paper |"
        lines[1] += "---|---|---|---|"
    variants = {kind: {key: pairs for key, pairs in by_shape.items() if any(pairs)}
                for kind, by_shape in variants.items()}
    variants = {kind: by_shape for kind, by_shape in variants.items() if by_shape}
    cells_099 = {key: pairs for key, pairs in cells_099.items() if any(pairs)}
    if cells_099:
        lines[0] += " Moira γ=0.99 (ms) | speedup per pair | mean | paper (Table 7) |"
        lines[1] += "---|---|---|---|"
    for kind in variants:
        label = PAIR_VARIANT_LABELS.get(kind, f"Moira, {kind}")
        lines[0] += f" {label}: speedup per pair | mean |"
        lines[1] += "---|---|"
    for model, shape in sorted(cells, key=lambda k: (k[0], TPOT_SHAPES.index(k[1]))):
        pairs = cells[(model, shape)]
        if not any(speedup for _, _, speedup, _ in pairs) and (model, shape) not in cells_099:
            continue  # dense alone
        paper = pairs[0][3]
        speedups = [speedup for _, _, speedup, _ in pairs if speedup]
        line = (f"| {model} | {shape} | "
                + " / ".join(f"{dense:.2f}" for dense, _, _, _ in pairs) + " |")
        if has_098:
            line += (" " + " / ".join(f"{ms:.2f}" if ms else "–" for _, ms, _, _ in pairs)
                     + " | " + " / ".join(f"{speedup:.2f}×" if speedup else "–"
                                          for _, _, speedup, _ in pairs)
                     + " | " + (f"**{statistics.mean(speedups):.2f}×**" if speedups else "–")
                     + " | " + (f"{paper:.2f}×" if paper else "–") + " |")
        if cells_099:
            mine = cells_099.get((model, shape), [])
            present = [x for x in mine if x is not None]
            paper = next((x[2] for x in present if x[2]), None)
            line += " " + (" / ".join("–" if x is None else f"{x[0]:.2f}" for x in mine)
                           or "–") + " | " \
                + (" / ".join("–" if x is None else f"{x[1]:.2f}×" for x in mine) or "–") \
                + " | " + (f"**{statistics.mean(x[1] for x in present):.2f}×** | "
                           if present else "– | ") \
                + (f"{paper:.2f}× |" if paper else "– |")
        for by_shape in variants.values():
            mine = by_shape.get((model, shape), [])
            present = [x for x in mine if x is not None]
            line += " " + (" / ".join("–" if x is None else f"{x:.2f}×" for x in mine) or "–") \
                + " | " + (f"**{statistics.mean(present):.2f}×** |" if present else "– |")
        lines.append(line)
    return "\n".join(lines)


def floor_note(pair_runs, arm):
    """" (T = 128)": the short-row floor every run of a default column ran with (its JSON's
    ``attend_split``), or nothing where a run predates the record."""
    floors = {(run.get("attend_split") or {}).get("step_programs")
              for runs in pair_runs for (_, kind), run in runs.items() if kind == arm}
    if not floors or None in floors:
        return ""
    return f" (T = {' / '.join(str(t) for t in sorted(floors))})"


def single_pairs_table(pair_runs):
    """Short-request shapes (batch 1 to 4) in interleaved pairs (``vllm_tpot.py --pairs N
    --arms dense,moira,pdl``): per (model, shape) and arm, each pair's TPOT relative to that pair's
    dense engine and their mean, since one engine per arm has differed from the next by ~3% at
    batch 1."""
    dense_cells, cells, present = short_pair_cells(pair_runs)
    lines = ["| model | shape | dense FA3 (ms) | " + " | ".join(
        f"{label} (ms) | vs dense per pair | mean" for _, label in present) + " |",
        "|---|---|---|" + "---|---|---|" * len(present)]
    for model, shape in short_pair_keys(cells):
        row = [model, shape, " / ".join(f"{ms:.2f}" for ms in dense_cells[(model, shape)])]
        for arm, _ in present:
            pairs = cells.get((model, shape, arm), [])
            row += [" / ".join(f"{ms:.2f}" for ms, _ in pairs) or "–",
                    " / ".join(f"{rel:+.1%}" for _, rel in pairs) or "–",
                    f"**{statistics.mean(rel for _, rel in pairs):+.1%}**" if pairs else "–"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def single_pairs_plot(pair_runs, path, shapes=SHORT_SHAPES):
    """The pairs as bars: per (model, shape) and arm, the mean TPOT against the pair's dense
    engine (each pair a dot); at the short shapes with the issue's 2% bar for batch 1."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    _, cells, present = short_pair_cells(pair_runs, shapes)
    keys = short_pair_keys(cells)
    fig, ax = plt.subplots(figsize=(1.6 + 1.3 * len(keys), 4))
    width = 0.8 / len(present)
    labelled = set()  # one legend entry per arm
    for i, (arm, label) in enumerate(present):
        for j, key in enumerate(keys):
            rels = [100 * rel for _, rel in cells.get((*key, arm), [])]
            if not rels:
                continue
            x = j - 0.4 + width * (i + 0.5)
            ax.bar(x, statistics.mean(rels), width, color=f"C{i}",
                   label=None if arm in labelled else label)
            labelled.add(arm)
            ax.plot([x] * len(rels), rels, "k.", markersize=4)
    if shapes is SHORT_SHAPES:
        ax.axhline(2.0, color="0.4", linestyle="--", linewidth=0.8)
    ax.axhline(0.0, color="0", linewidth=0.6)
    ax.set_xticks(range(len(keys)), [f"{model}\n{shape}" for model, shape in keys], fontsize=7)
    ax.set_ylabel("TPOT against the pair's dense FA3 (%)")
    ax.set_title("interleaved pairs, H200, vLLM 0.26\n(dots: pairs"
                 + ("; dashed: the 2% bar)" if shapes is SHORT_SHAPES else ")"), fontsize=8)
    ax.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.15))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def short_pair_keys(cells):
    return sorted({(m, s) for m, s, _ in cells}, key=lambda k: (k[0], TPOT_SHAPES.index(k[1])))


def short_pair_cells(pair_runs, shapes=SHORT_SHAPES):
    """``(dense_cells, cells, present)``: dense TPOTs per (model, shape), one (ms, TPOT / dense
    - 1) per pair per (model, shape in ``shapes``, arm), and the arms present with their
    labels."""
    arms = [(0.98, "Moira, every row selecting"),
            ("fallback", "Moira, rows of ≤ N tokens read in full"),
            (0.99, "Moira at γ = 0.99's reads (arm g099)"),
            ("pdl", "the same, programmatic launch"),
            ("split", "Moira, Attend's split set (floor_rows, min_programs: in its JSON)"),
            ("Jmax=4096", JNOCAP_LABEL),
            ("T=0", "Moira, Attend's split by Eq. 4 alone (step_programs 0)"),
            ("T=128", "Moira, the short-row floor at T = 128 programs"),
            ("T=256", "Moira, the short-row floor at T = 256 programs (the default)"),
            ("HND", PAIR_VARIANT_LABELS["HND"]),
            ("fsel", "rows of ≤ N tokens read in full, Estimate + Select in one launch"),
            ("fmerge", "rows of ≤ N tokens read in full, Merge in Attend's launch"),
            ("fsel+fmerge", "rows of ≤ N tokens read in full, both in one launch"),
            ("fcw", "rows of ≤ N tokens read in full, K/V written in Estimate's launch"),
            ("nofcw", "rows of ≤ N tokens read in full, K/V written by vLLM's kernel")]
    # variants combined (e.g. "pdl+split"): a column each, named by their arms
    known = {arm for arm, _ in arms} | {"dense"}
    arms += [(kind, PAIR_VARIANT_LABELS.get(kind, f"Moira, {kind}")) for kind in sorted(
        {kind for runs in pair_runs for _, kind in runs if kind not in known}, key=str)]
    dense_cells, cells = {}, {}
    for runs in pair_runs:
        for (model, kind), dense in runs.items():
            if kind != "dense":
                continue
            dense_ms = tpot_by_shape(dense)
            for shape, ms in dense_ms.items():
                dense_cells.setdefault((model, shape), []).append(ms)
            for arm, _ in arms:
                run = runs.get((model, arm))
                if run is None or (arm == 0.98 and run is runs.get((model, "fallback"))):
                    continue  # tpot_load() stands the fallback run in for the γ column
                for shape, ms in tpot_by_shape(run).items():
                    if shape in shapes and shape in dense_ms:
                        cells.setdefault((model, shape, arm), []).append(
                            (ms, ms / dense_ms[shape] - 1))
    present = [(arm, label + (floor_note(pair_runs, arm) if arm in (0.98, "fallback") else ""))
               for arm, label in arms if any(key[2] == arm for key in cells)]
    return dense_cells, cells, present


def single_table(runs):
    """Batch-1 shapes: Moira's TPOT relative to dense, with every row
    selecting (``dense_below_tokens`` 0) and with short rows read in full (N > 0)."""
    lines = ["| model | shape | dense FA3 (ms) | Moira γ=0.98 reads (ms) | reads | vs dense | "
             "Moira, rows of ≤ N tokens read in full (ms) | vs dense |",
             "|---|---|---|---|---|---|---|---|"]
    with_pdl = any(kind == "pdl" for _, kind in runs)
    if with_pdl:
        lines[0] += " the same, programmatic launch (ms) | vs dense |"
        lines[1] += "---|---|"
    for model in sorted({model for model, _ in runs}):
        dense = runs.get((model, "dense"))
        if dense is None:
            continue
        dense_ms = tpot_by_shape(dense)
        moira, fallback = runs.get((model, 0.98)), runs.get((model, "fallback"))
        if moira is fallback:  # no run with every row selecting
            moira = None
        arms = [(moira, True), (fallback, False)]
        if with_pdl:
            arms.append((runs.get((model, "pdl")), False))
        for shape in TPOT_SHAPES:
            if shape not in dense_ms or not shape.endswith("k1"):
                continue
            cells = [model, shape, f"{dense_ms[shape]:.2f}"]
            for run, with_reads in arms:
                ms = tpot_by_shape(run).get(shape) if run else None
                cells.append(f"{ms:.2f}" if ms else "–")
                if with_reads:
                    reads = next((r["imposed_read_fraction"] for r in run["results"]
                                  if r["shape"] == shape), None) if run else None
                    cells.append(f"{reads:.2f}" if reads else "–")
                elif run:
                    cells[-1] += f" (N = {run['dense_below_tokens']})"
                cells.append(f"{ms / dense_ms[shape] - 1:+.1%}" if ms else "–")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def tpot_plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(7 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        mine = [r for r in rows if r["model"] == model]
        x = range(len(mine))
        width = 0.27
        ax.bar([i - width for i in x], [r["dense_ms"] for r in mine], width, label="dense FA3",
               color="0.6")
        for offset, gamma, color in ((0, 0.98, "tab:blue"), (width, 0.99, "tab:cyan")):
            values = [r[f"g{gamma}"]["ms"] or 0 for r in mine]
            bars = ax.bar([i + offset for i in x], values, width, color=color,
                          label=f"Moira, γ={gamma} reads (imposed)")
            for bar, r in zip(bars, mine):
                cell = r[f"g{gamma}"]
                if cell["speedup"]:
                    paper = f"\n({cell['paper']:.2f})" if cell["paper"] else ""
                    ax.annotate(f"{cell['speedup']:.2f}×{paper}",
                                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                                ha="center", va="bottom", fontsize=7)
        ax.set_xticks(list(x), [r["shape"] for r in mine])
        ax.set_ylabel("TPOT (ms)")
        ax.set_title(f"{model}, H200, vLLM 0.26: speedup over dense (paper's in brackets)",
                     fontsize=9)
        ax.legend(fontsize=8, loc="upper left")
        ax.set_ylim(0, max(r["dense_ms"] for r in mine) * 1.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def tpot(parser, args):
    if args.pairs:
        pair_runs = [tpot_load([folder]) for folder in args.folders]
        short = all(shape in SHORT_SHAPES for runs in pair_runs for run in runs.values()
                    for shape in tpot_by_shape(run))
        text = (single_pairs_table if short else pairs_table)(pair_runs)
        print(text)
        if args.plot:
            single_pairs_plot(pair_runs, args.plot, SHORT_SHAPES if short else TPOT_SHAPES)
        if args.readme:
            source = ", ".join(f"`{repo_path(folder)}/`" for folder in args.folders)
            write_section(args.readme, args.section, text + "\n\nGenerated by "
                          f"`benchmarks/report.py tpot --pairs` from {source} (commands, GPU "
                          "and versions in each JSON): each pair's engines run one after another "
                          "on one host (their order: the JSONs' dates); TPOT: median over "
                          "requests of (last − first token time) / (tokens − 1) from vLLM's "
                          "request metrics, one timed repeat per engine (`--repeats 1`); "
                          "random weights, so Moira's read fractions are imposed (the paper's "
                          "measured reads for each context, or every page for rows read in "
                          "full).")
        return
    runs = tpot_load(args.folders)
    text, rows = tpot_table(runs)
    rows = [row for row in rows if not row["shape"].endswith("k1")]
    if not rows:  # batch-1 shapes only: their own table, no plot
        if args.plot:
            parser.error("--plot: batch-1 runs have no plot but as pairs (--pairs --plot)")
        text, png = single_table(runs), None
    else:
        png = args.plot or args.folders[0].rstrip("/") + ".png"
        tpot_plot(rows, png)
    print(text)
    if args.readme:
        any_run = next(iter(runs.values()))
        versions = any_run.get("versions") or {}
        source = ", ".join(f"`{repo_path(folder)}/`" for folder in args.folders)
        note = (f"Generated by `benchmarks/report.py tpot` from {source} "
                f"({any_run['gpu']}, {any_run['date'][:10]}"
                + (f", vLLM {versions['vllm']}, torch {versions['torch']}" if versions else "")
                + "; commands in each JSON). TPOT: median over requests of (last − first token "
                "time) / 255 from vLLM's request metrics, median of two repeats in one engine "
                "per backend; random weights, so Moira's read fractions are imposed (the "
                "paper's measured reads, spread per (layer, KV head) with CV ≈ 0.7), not chosen "
                "by the coverage rule."
                + (f" Plot: `{repo_path(png)}`." if png else ""))
        write_section(args.readme, args.section, text + "\n\n" + note)


# ============================================================================================
# serve: serving throughput
# ============================================================================================

SERVE_ARMS = {"dense": "dense FA3", "flashinfer": "dense FlashInfer", "moira": "Moira"}


def runs_in(folders):
    """Every ``serve-*.json`` run of ``folders``, in name order within each folder."""
    for folder in folders:
        for name in sorted(os.listdir(folder)):
            if name.startswith("serve-") and name.endswith(".json"):
                with open(os.path.join(folder, name)) as f:
                    yield json.load(f)


def serve_load(folders):
    """The runs of ``folders``; the slices of one workload pooled into one run."""
    groups = {}
    for run in runs_in(folders):
        # runs with other MOIRA_* settings are another arm, never pooled with the default
        setting = tuple(sorted(run.get("moira_environment", {}).items()))
        key = (run["label"], run["set"], run["concurrency"], run["output_tokens"], setting)
        groups.setdefault(key, []).append(run)
    return [run for parts in groups.values() for run in pooled(parts)]


def pooled(parts):
    """Runs of one (arm, set, concurrency, output tokens) as one run when they are slices of a
    set (disjoint prompt ranges, each with per-request records); otherwise unchanged (e.g. a
    short run and a long one from the set's start are two workloads)."""
    parts = sorted(parts, key=lambda run: run.get("offset", 0))
    disjoint = all(before.get("offset", 0) + before["requests"] <= after.get("offset", 0)
                   for before, after in zip(parts, parts[1:]))
    if len(parts) == 1 or not disjoint or any("per_request" not in run for run in parts):
        return parts
    records = [r for run in parts for r in run["per_request"]]
    wall = sum(run["wall_s"] for run in parts)
    done = [r for r in records if r["ok"]]
    tpots = [r["tpot_ms"] for r in done if r["tpot_ms"] is not None]
    return [dict(parts[0], requests=len(records), completed=len(done), wall_s=round(wall, 1),
                 output_tokens_per_s=sum(r["tokens"] for r in done) / wall,
                 median_tpot_ms=statistics.median(tpots) if tpots else None,
                 median_ttft_s=statistics.median(r["ttft_s"] for r in done) if done else None,
                 slices=len(parts), per_request=records,
                 date=" / ".join(sorted({run["date"][:10] for run in parts})),
                 command=" ; ".join(run["command"] for run in parts))]


def days(runs):
    """The days the runs ran on (a pooled run's date lists its slices' days)."""
    return sorted({date[:10] for run in runs for date in run["date"].split(" / ")})


def prompts_cell(run):
    """How many prompts, which ones when not the set's first, and in how many slices."""
    cell = str(run["requests"])
    if run.get("offset"):
        cell += f" (prompts {run['offset']}–{run['offset'] + run['requests'] - 1})"
    if run.get("slices"):
        cell += f" in {run['slices']} slices"
    return cell


def arm_name(run):
    """The arm's name, with the ``MOIRA_*`` settings its server ran with, if any."""
    setting = " ".join(f"{k}={v}" for k, v in sorted(run.get("moira_environment", {}).items()))
    return SERVE_ARMS.get(run["label"], run["label"]) + (f" ({setting})" if setting else "")


def per_request_changes(folders, below_tokens=20480, from_offset=0):
    """Moira's TPOT against dense FA3's, request by request (the same prompts in the same
    order in each slice), from the slices in ``folders`` whose offset is at least
    ``from_offset``: ``{(set, concurrency): {"read in full": [%...], "selected": [%...],
    "all": [%...]}}``: at concurrency 1 a prompt is read in full when it and its output fit
    ``below_tokens`` (the plugin's default ``dense_below_tokens`` at batch 1), else selected
    in; at higher concurrency every request is under "all". Arms with other MOIRA_* settings
    are left out."""
    slices = {}
    for run in runs_in(folders):
        if "per_request" in run and not run.get("moira_environment") \
                and run.get("offset", 0) >= from_offset:
            key = (run["set"], run["concurrency"], run.get("offset", 0))
            # with several folders one slice could come twice; never let one replace the other
            assert run["label"] not in slices.get(key, {}), f"slice {key} of {run['label']} twice"
            slices.setdefault(key, {})[run["label"]] = run
    changes = {}
    for (name, concurrency, _), arms in sorted(slices.items()):
        if "dense" not in arms or "moira" not in arms:
            continue
        split = changes.setdefault((name, concurrency),
                                   {"read in full": [], "selected": [], "all": []})
        for dense, moira in zip(arms["dense"]["per_request"], arms["moira"]["per_request"]):
            assert dense["prompt_tokens"] == moira["prompt_tokens"], "slices of other prompts"
            if dense["tpot_ms"] and moira["tpot_ms"]:
                if concurrency != 1:  # the plugin reads rows in full at batch 1 only
                    kind = "all"
                elif dense["prompt_tokens"] + arms["dense"]["output_tokens"] <= below_tokens:
                    kind = "read in full"
                else:
                    kind = "selected"
                split[kind].append(100 * (moira["tpot_ms"] / dense["tpot_ms"] - 1))
    return changes


def per_request_lines(changes):
    """One line per workload and kind: requests, mean TPOT change, range, and how many are
    more than 2% slower than dense (the bound set at batch 1)."""
    lines = []
    for (name, concurrency), split in changes.items():
        for kind, values in split.items():
            if values:
                lines.append(f"set {name}, concurrency {concurrency}, {kind}: {len(values)} "
                             f"requests, Moira's TPOT {statistics.mean(values):+.2f}% on average "
                             f"({min(values):+.1f} to {max(values):+.1f}%), "
                             f"{sum(value > 2 for value in values)} over +2%")
    return lines


def serve_table(runs):
    """Rows grouped by workload (set, concurrency, prompts, output tokens), dense FA3 first."""
    def workload(run):
        return (run["set"], run["concurrency"], run["requests"], run["output_tokens"],
                run.get("offset", 0))

    order = list(SERVE_ARMS)
    lines = ["| set | concurrency | prompts × output tokens | arm | completed | output tokens/s | "
             "vs dense FA3 | median TPOT (ms) | median TTFT (s) | wall (s) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    # a workload is its prompts too: the first 32 of set A and all 256 are different rows
    for key in sorted({workload(run) for run in runs}):
        group = sorted((run for run in runs if workload(run) == key),
                       key=lambda run: order.index(run["label"]) if run["label"] in order
                       else len(order))
        dense = next((run for run in group if run["label"] == "dense"
                      and not run.get("moira_environment")), None)
        for run in group:
            ratio = ("–" if dense is None or run is dense else
                     f"**{run['output_tokens_per_s'] / dense['output_tokens_per_s'] - 1:+.1%}**")
            lines.append(
                f"| {key[0]} | {key[1]} | {prompts_cell(run)} × {key[3]} | "
                f"{arm_name(run)} | {run['completed']}/{run['requests']} | "
                f"{run['output_tokens_per_s']:.1f} | {ratio} | {run['median_tpot_ms']:.2f} | "
                f"{run['median_ttft_s']:.2f} | {run['wall_s']:.1f} |")
    return "\n".join(lines)


def serve_plot(runs, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    labels = [f"{arm_name(r)}\n{r['set']}:{r['concurrency']}" for r in runs]
    colors = ["tab:blue" if r["label"] == "moira" else "0.6" for r in runs]
    for ax, key, title in ((axes[0], "output_tokens_per_s", "output tokens/s"),
                           (axes[1], "median_tpot_ms", "median TPOT (ms)")):
        ax.bar(range(len(runs)), [r[key] for r in runs], color=colors)
        ax.set_xticks(range(len(runs)), labels, fontsize=7)
        ax.set_title(title, fontsize=9)
    fig.suptitle("vLLM OpenAI server, H200, Llama-3.1-8B geometry (dummy weights); Moira at "
                 "the paper's γ = 0.98 reads, imposed", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def serve(parser, args):
    if args.plot is None and len(args.folders) > 1:
        parser.error("several folders: name the plot's path with --plot")
    runs = serve_load(args.folders)
    text = serve_table(runs)
    print(text)
    request_lines = per_request_lines(per_request_changes(args.folders,
                                                          from_offset=args.from_offset))
    for line in request_lines:
        print(line)
    # abspath of the folder first: "." names the folder itself, not ".png"
    plot_path = (os.path.abspath(args.plot) if args.plot
                 else os.path.abspath(args.folders[0]) + ".png")
    serve_plot(runs, plot_path)
    if args.readme:
        sources = ", ".join(f"`{repo_path(folder)}/`" for folder in args.folders)
        gpus = sorted({run.get("gpu", "GPU and versions: NOTE.md beside the JSONs")
                       for run in runs})
        dates = days(runs)
        note = (f"Generated by `benchmarks/report.py serve` from {sources} ({', '.join(gpus)}; "
                f"{', '.join(dates)}; commands in each JSON). Closed-loop client, prefix caching "
                "off, every prompt's output forced to the stated length; TPOT per request from "
                "the streamed tokens' times. Random (dummy) weights: Moira reads the paper's "
                "γ = 0.98 fractions per context, imposed, not chosen by the rule. Plot: "
                f"`{repo_path(plot_path)}`.")
        if request_lines:
            text += ("\n\nPer request against dense FA3 on the same prompts (at concurrency 1, "
                     "read in full: prompt and output within the plugin's dense_below_tokens):\n"
                     + "\n".join(f"- {line}" for line in request_lines))
        write_section(args.readme, args.section, text + "\n\n" + note)


# ============================================================================================
# step: one decode step by kernel class
# ============================================================================================

STEP_CLASSES = ["Attend", "Estimate", "Select", "Merge", "FA3", "GEMM", "other"]
MOIRA_KERNELS = ("Estimate", "Select", "Attend", "Merge")
# paper Table 4 (Nsight Systems, Llama-3.1-8B): dense step, FA3; Moira step, att, est, sel, mrg,
# GEMM
STEP_PAPER = {"8k32": dict(dense=12.72, FA3=8.16, moira=9.38, Attend=4.02, Estimate=0.38,
                      Select=0.23, Merge=0.18, GEMM=3.96),
         "32k16": dict(dense=17.00, FA3=12.48, moira=9.45, Attend=4.20, Estimate=0.40,
                       Select=0.25, Merge=0.13, GEMM=3.86),
         "64k8": dict(dense=20.34, FA3=15.89, moira=8.44, Attend=3.04, Estimate=0.44,
                      Select=0.41, Merge=0.12, GEMM=3.83),
         "130k4": dict(dense=20.16, FA3=15.76, moira=8.18, Attend=2.78, Estimate=0.43,
                       Select=0.42, Merge=0.13, GEMM=3.83)}


def profiled_steps(runs):
    """``(shape, name, row)`` in report order: shapes by context where the rows give it (a run
    of one backend may hold fewer shapes), else as the runs first give them; under each,
    dense runs then Moira runs, each in folder order, named by backend and folder label."""
    rows = [r for _, _, run in runs for r in run["results"]]
    contexts = {}
    for r in rows:
        contexts.setdefault(r["shape"], r.get("context", 0))
    shapes = sorted(dict.fromkeys(r["shape"] for r in rows), key=lambda shape: contexts[shape])
    for shape in shapes:
        for backend in ("dense", "moira"):
            for label, _, run in (x for x in runs if x[1] == backend):
                row = next((r for r in run["results"] if r["shape"] == shape), None)
                if row is not None:
                    name = "dense FA3" if backend == "dense" else "Moira"
                    yield shape, name + (f" ({label})" if label else ""), row


def moira_waits(row):
    """ms per step the GPU waited before Moira's four kernels (each one's start after the end
    of the kernel before it: the launch edges a fused or programmatic launch could hide); "–"
    for dense rows and runs older than the measure."""
    gaps = row.get("gap_before_ms_per_step")
    if not gaps or not any(name in gaps for name in MOIRA_KERNELS):
        return "–"
    return f"{sum(gaps.get(name, 0.0) for name in MOIRA_KERNELS):.3f}"


def step_table(runs):
    """``runs``: ``[(label, backend, run)]`` in folder order; one row per run under each shape,
    then the paper's rows."""
    lines = ["| shape | backend | " + " | ".join(STEP_CLASSES)
             + " | kernels | waits before Moira's kernels | GPU idle | wall |",
             "|---|---|" + "---|" * (len(STEP_CLASSES) + 4)]
    steps = list(profiled_steps(runs))
    for shape in dict.fromkeys(shape for shape, _, _ in steps):
        for _, backend, row in (step for step in steps if step[0] == shape):
            cells = [f"{row['per_step_ms'][name]:.2f}" if name in row["per_step_ms"]
                     else "–" for name in STEP_CLASSES]
            lines.append(f"| {shape} | {backend} | "
                         + " | ".join(cells) + f" | **{row['total_ms']:.2f}** | "
                         f"{moira_waits(row)} | "
                         f"{row.get('gpu_idle_ms_per_step', float('nan')):.2f} | "
                         f"{row.get('wall_ms_per_step', float('nan')):.2f} |")
        paper = STEP_PAPER.get(shape)
        if paper:
            for label, names, step in (("paper, dense", {"FA3"}, paper["dense"]),
                                       ("paper, Moira", set(STEP_CLASSES) - {"FA3"},
                                        paper["moira"])):
                cells = [f"{paper[name]:.2f}" if name in names and name in paper else "–"
                         for name in STEP_CLASSES]
                lines.append(f"| {shape} | {label} | " + " | ".join(cells)
                             + f" | {step:.2f} (step) | – | – | – |")
    return "\n".join(lines)


def step_plot(runs, path):
    """One stacked bar per (shape, run): its GPU ms per step by kernel class, the classes in the
    table's order, so where two runs' steps differ shows as a longer segment."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = [(f"{shape} {name}", row["per_step_ms"]) for shape, name, row in profiled_steps(runs)]
    colors = dict(Attend="tab:blue", Estimate="tab:orange", Select="tab:green",
                  Merge="tab:red", FA3="0.45", GEMM="0.75", other="0.9")
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(bars) + 1.4))
    y = range(len(bars))[::-1]  # the table's first row on top
    left = [0.0] * len(bars)
    for name in STEP_CLASSES:
        widths = [classes.get(name, 0.0) for _, classes in bars]
        if any(widths):
            ax.barh(list(y), widths, left=left, color=colors[name], label=name, height=0.7)
            left = [a + b for a, b in zip(left, widths)]
    for i, total in zip(y, left):
        ax.annotate(f"{total:.2f}", (total, i), xytext=(3, 0), textcoords="offset points",
                    va="center", fontsize=7)
    ax.set_yticks(list(y), [label for label, _ in bars], fontsize=7)
    ax.set_xlabel("GPU ms per decode step (kernels, profiler)")
    ax.set_xlim(0, max(left) * 1.1)
    ax.legend(fontsize=7, ncol=len(STEP_CLASSES), loc="lower center", bbox_to_anchor=(0.5, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def step_load(folders):
    """``[(label, backend, run)]``: label is the folder's name when there are several
    folders, else empty."""
    runs = []
    for folder in folders:
        label = os.path.basename(os.path.normpath(folder)) if len(folders) > 1 else ""
        for backend in ("dense", "moira"):
            path = os.path.join(folder, f"step-{backend}.json")
            if os.path.exists(path):
                with open(path) as f:
                    runs.append((label, backend, json.load(f)))
    return runs


def step(parser, args):
    runs = step_load(args.folders)
    text = step_table(runs)
    print(text)
    if args.plot:
        step_plot(runs, args.plot)
    if args.readme:
        sources = ", ".join(f"`{repo_path(folder)}/`" for folder in args.folders)
        dates = ", ".join(sorted({run["date"][:10] for _, _, run in runs}))
        torch_versions = ", ".join(sorted({run["versions"]["torch"] for _, _, run in runs}))
        note = (f"Generated by `benchmarks/report.py step` from {sources} ({runs[0][2]['gpu']}, "
                f"{dates}, torch {torch_versions}; commands in "
                "each JSON). ms per decode step, GPU time by kernel class from the PyTorch "
                "profiler over a traced run of 32 steps inside vLLM's FULL CUDA graphs "
                "(Llama-3.1-8B geometry, random weights, Moira at the paper's γ = 0.98 reads, "
                "imposed); waits before Moira's kernels: the time between each of Estimate, "
                "Select, Attend and Merge and the end of the kernel before it; GPU idle: all "
                "gaps between kernels in the traced span; wall: the traced "
                "run's wall time per step, profiler overhead included. Paper rows: its Table 4 "
                "(Nsight Systems).")
        write_section(args.readme, args.section, text + "\n\n" + note)



# ============================================================================================
# kernels: the kernel suite
# ============================================================================================

KERNEL_ARMS = [("moira", "Moira"), ("fa3_varlen", "FA3 varlen"), ("pad", "pad"), ("pow2", "pow2"),
        ("flashinfer", "FlashInfer"), ("flex", "FlexAttention")]


def shape_label(name):
    """The suite's shape name as the tables print it: "8k32" -> "8k x32" (tune.py's
    form); any other name as it is."""
    return re.sub(r"^(\d+k)(\d+)$", r"\1 x\2", name)


def collect(report):
    """{shape: {spread: {arm: row}}} with the real-like layers averaged into spread "real"."""
    table = defaultdict(lambda: defaultdict(dict))
    layers = defaultdict(list)
    for row in report["results"]:
        spread = row.get("spread")
        if spread and "/" in spread:
            layers[(row["shape"], spread.split("/")[0], row["arm"])].append(row)
        else:
            table[row["shape"]][spread][row["arm"]] = row
    for (shape, spread, arm), rows in layers.items():
        ok = [r for r in rows if r.get("us") is not None]
        if len(ok) != len(rows):
            table[shape][spread][arm] = dict(us=None, error=rows[0].get("error"))
            continue
        table[shape][spread][arm] = dict(
            us=statistics.mean(r["us"] for r in ok),
            rel_bw=statistics.mean(r["rel_bw"] for r in ok) if all("rel_bw" in r for r in ok)
            else None,
            fraction=statistics.mean(r["fraction"] for r in ok))
    return table


def fmt(row, key="us", digits=1):
    if not row or row.get(key) is None:
        return "—" if not row or not row.get("error") else "fails"
    return f"{row[key]:.{digits}f}"


def output_checks(report):
    """One line on the run's output checks (``kernels.check_outputs``): how many arm
    outputs matched Moira's, and any that did not or could not be run."""
    checks = report.get("checks", [])
    if not checks:
        return "Output checks: none in this run."
    # older files record the difference only: judged by the same tolerance
    agreed = [c for c in checks if c.get("max_abs_diff_to_moira") is not None
              and c.get("agrees", c["max_abs_diff_to_moira"] <= CHECK_TOLERANCE)]
    bad = [c for c in checks if c not in agreed]
    worst = max((c["max_abs_diff_to_moira"] for c in agreed), default=0.0)
    line = (f"Output checks: {len(agreed)} of {len(checks)} arm outputs match Moira's "
            f"(largest |difference| {worst:.2g})")
    if bad:
        line += "; **not matching or failed**: " + ", ".join(
            f"{c.get('arm', '?')} {c['shape']} {c.get('spread')}"
            + (f" ({c['max_abs_diff_to_moira']:.2g})" if c.get("max_abs_diff_to_moira")
               is not None else f" ({c.get('error', 'error')[:60]})") for c in bad)
    return line + "."


def kernel_tables(report):
    table = collect(report)
    lines = [
        f"One decode layer, Llama-3.1-8B geometry (8 KV heads, G = 4, head_dim 128, bf16, "
        f"64-token pages), {report['gpu']}, {report['date'][:10]}; "
        + ", ".join(f"{k} {v}" for k, v in report["versions"].items())
        + f". µs per layer, median of CUDA-graph replays, {report['mean_fraction']:.0%} of each "
        "row's pages on average at random positions (`real`: 8 layers of 9–68%, CV 0.7, "
        "averaged). `rel. BW` = Moira's bytes/time over dense FA3's in the same run.",
        "",
        "| shape | spread | pages read | " + " | ".join(label for _, label in KERNEL_ARMS)
        + " | FlashInfer plan (host) | dense FA3 | Moira rel. BW |",
        "|---|---|---|" + "---|" * len(KERNEL_ARMS) + "---|---|---|",
    ]
    for shape, spreads in table.items():
        dense = [r["us"] for arm, r in spreads[None].items()
                 if arm.startswith("dense_fa3") and r.get("us")]
        for spread, arms in spreads.items():
            if spread is None:
                continue
            fraction = arms.get("moira", {}).get("fraction")
            lines.append(
                f"| {shape_label(shape)} | {spread} | "
                + (f"{fraction:.0%}" if fraction else "—") + " | "
                + " | ".join(fmt(arms.get(arm)) for arm, _ in KERNEL_ARMS)
                + f" | {fmt(arms.get('flashinfer_plan'))} | "
                + (f"{min(dense):.1f}" if dense else "—")
                + f" | {fmt(arms.get('moira'), 'rel_bw', 2)} |")
    lines += ["", "| shape | Estimate | Select (coverage 0.98) | Select (fixed 22%) | "
              "whole step, fixed 22% | Moira on all pages | dense FA3 |",
              "|---|---|---|---|---|---|---|"]
    for shape, spreads in table.items():
        refs = spreads[None]
        dense = [r["us"] for arm, r in refs.items()
                 if arm.startswith("dense_fa3") and r.get("us")]
        lines.append(
            f"| {shape_label(shape)} | {fmt(refs.get('estimate'))} | "
            f"{fmt(refs.get('select_coverage'))} | {fmt(refs.get('select_top22'))} | "
            f"{fmt(refs.get('step_top22'))} | {fmt(refs.get('moira_all_pages'))} | "
            + (f"{min(dense):.1f}" if dense else "—") + " |")
    return "\n".join(lines)


def variant_table(report):
    """Moira's configured arms (``moira_eq4``, ``moira_c12``, ...: Attend + Merge under another
    ``MoiraConfig`` or Attend's options) against ``moira`` on the same lists: µs and ratio per
    shape and spread, and on all pages where timed; "" when the run has none."""
    table = collect(report)
    variants = sorted({arm for spreads in table.values() for arms in spreads.values()
                       for arm in arms if config_fields(arm) is not None})
    if not variants:
        return ""
    lines = ["| shape | spread | Moira | " + " | ".join(variants) + " |",
             "|---|---|---|" + "---|" * len(variants)]
    for shape, spreads in table.items():
        for spread, arms in spreads.items():
            # the row without a spread: every page of every row (``<arm>_all_pages``)
            suffix = "_all_pages" if spread is None else ""
            base = arms.get("moira" + suffix, {}).get("us")
            if base is None:
                continue
            cells = []
            for arm in variants:
                us = arms.get(arm + suffix, {}).get("us")
                cells.append("—" if us is None else f"{us:.1f} ({us / base - 1:+.1%})")
            if set(cells) == {"—"}:  # e.g. all pages, timed only for Attend's options
                continue
            lines.append(f"| {shape_label(shape)} | {spread or 'all pages'} | {base:.1f} | "
                         + " | ".join(cells) + " |")
    return "\n".join(lines)


def kernel_plot(report, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = collect(report)
    shapes = list(table)
    fig, axes = plt.subplots(1, len(shapes), figsize=(4.2 * len(shapes), 3.6), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        spreads = table[shape]
        cvs = sorted(float(s[2:]) for s in spreads if s and s.startswith("cv"))
        for arm, label in KERNEL_ARMS:
            points = [(cv, spreads[f"cv{cv}"].get(arm, {}).get("us")) for cv in cvs]
            points = [(x, y) for x, y in points if y is not None]
            if points:
                line, = ax.plot(*zip(*points), marker="o", label=label)
                real = spreads.get("real", {}).get(arm, {}).get("us")
                if real is not None:
                    ax.scatter([max(cvs) + 0.3], [real], marker="*", s=90, color=line.get_color())
        dense = [r["us"] for a, r in spreads[None].items()
                 if a.startswith("dense_fa3") and r.get("us")]
        ax.set_title(shape_label(shape))
        ax.set_xlabel("CV of row lengths (★ = real-like)")
        if dense:
            ax.axhline(min(dense), color="gray", linestyle="--", label="dense FA3 (all pages)")
            ax.set_ylim(0, 1.3 * min(dense))  # arms above dense FA3 are clipped
        else:
            ax.set_ylim(bottom=0)
    axes[0][0].set_ylabel("µs per layer")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def kernels(parser, args):
    with open(args.result) as f:
        report = json.load(f)
    markdown = kernel_tables(report) + "\n\n" + output_checks(report)
    png = os.path.splitext(args.result)[0] + ".png"
    kernel_plot(report, png)
    print(markdown)
    variants = variant_table(report)  # printed for a tuning run, not part of the README's table
    if variants:
        print("\nMoira's kernels under other configurations (Attend + Merge):\n\n" + variants)
    print(f"wrote {png}")
    if args.readme:
        image = os.path.relpath(png, os.path.dirname(os.path.abspath(args.readme)))
        write_section(args.readme, args.section, f"{markdown}\n\n![kernel times]({image})")


# ============================================================================================
# single: one request's step, Attend's split sweeps
# ============================================================================================

def short_key(key):
    """A sweep key as the report gives it: (floor_rows, J), with T when it is not 0."""
    return key if key[2] else key[:2]


def split_report(paths, margin=0.3, gain=0.5):
    """The ``--split-sweep`` arms of one or more runs: a markdown table (µs per layer, mean of
    the runs, each run's in brackets, the best per shape in bold; shapes are contexts at batch
    1, ``<context>×<batch>`` above) and the verdict of the rule set before the sweep: a
    (floor_rows, J) within ``margin`` µs of the best at every shape and at least ``gain`` µs
    faster than the default at 2k or 8k (batch 1) becomes the default."""
    times = {}  # (floor_rows, chunks, step_programs) -> (batch, context) -> [µs per run]
    names = {}
    for path in paths:
        with open(path) as f:
            for row in json.load(f)["results"]:
                shape = (row.get("batch", 1), row["context"])
                for name, key in row.get("split_sweep", {}).items():
                    if name in row["us_per_layer"]:
                        key = (tuple(key) + (0,))[:3]  # older files: no T, i.e. 0
                        times.setdefault(key, {}).setdefault(shape, []).append(
                            row["us_per_layer"][name])
                        names.setdefault(key, {})[shape] = name
    contexts = sorted({c for per in times.values() for c in per})
    mean = {key: {c: sum(v) / len(v) for c, v in per.items()} for key, per in times.items()}
    best = {c: min(m[c] for m in mean.values() if c in m) for c in contexts}
    lines = ["| floor_rows, J[, T] | " + " | ".join(
        f"{c // 1024}k" + (f"×{b}" if b > 1 else "") for b, c in contexts) + " |",
             "|---" * (len(contexts) + 1) + "|"]
    for key in sorted(times, key=lambda k: (k[2], k[0], -(k[1] or 10**9))):
        cells = []
        for c in contexts:
            if c not in mean[key]:
                cells.append("–")
                continue
            text = (f"{mean[key][c]:.2f} ({' / '.join(f'{v:.2f}' for v in times[key][c])}) "
                    f"`{names[key][c]}`")
            cells.append(f"**{text}**" if mean[key][c] == best[c] else text)
        label = (f"{key[0]}, {'default' if key[1] is None else key[1]}"
                 + (f", T = {key[2]}" if key[2] else ""))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    from moira.config import MoiraConfig

    default_key = (MoiraConfig().floor_rows, None, 0)  # Eq. 4 alone: the old default split
    default = mean.get(default_key, {})

    def gains(m):
        return any(c in default and default[c] - m[c] >= gain for c in ((1, 2048), (1, 8192)))

    chosen = [key for key, m in mean.items()
              if all(c in m and m[c] <= best[c] + margin for c in contexts) and gains(m)]
    chosen.sort(key=lambda key: sum(mean[key].values()))
    verdict = (f"rule met by floor_rows, J = {short_key(chosen[0])}" if chosen else
               "rule not met: keep Eq. 4's default split")
    # the rule for changing the default (the first is stricter: near the best everywhere):
    # never more than `margin` slower than the default, `gain` faster at batch 1
    safe = sorted((key for key, m in mean.items() if key != default_key
                   and all(c in m and c in default and m[c] <= default[c] + margin
                           for c in contexts) and gains(m)),
                  key=lambda key: sum(mean[key].values()))
    verdict += ("; no slower than Eq. 4's default anywhere and faster at batch 1: "
                + (", ".join(map(str, map(short_key, safe))) if safe else "none"))
    return "\n".join(lines), (short_key(chosen[0]) if chosen else None), verdict


def programs_report(paths):
    """The ``--programs-sweep`` arms of one or more runs as a markdown table: µs per layer per
    shape (``<context>×<batch>``, with the run's J in brackets), the mean of the runs, the
    fastest per shape in bold, and each arm's difference from N_T = 4096 (J programs per row,
    no ceiling); ``launch N`` columns (older files): that J with Attend launching about N
    programs, each taking every P-th chunk (an option since removed)."""
    from moira.config import MoiraConfig

    default = (MoiraConfig().min_programs, 0)
    times, chunks = {}, {}  # (batch, context) -> (N_T, launched) -> [µs per run]; J
    for path in paths:
        with open(path) as f:
            for row in json.load(f)["results"]:
                shape = (row["batch"], row["context"])
                for name, arm in row.get("programs_sweep", {}).items():
                    if name in row["us_per_layer"]:
                        key = (arm["min_programs"], arm.get("launched", 0))
                        times.setdefault(shape, {}).setdefault(key, []).append(
                            row["us_per_layer"][name])
                        chunks[shape, key] = arm["chunks_per_row"], arm.get("programs_per_row")
    keys = sorted({k for per in times.values() for k in per}, key=lambda k: (k[1], -k[0]))
    lines = ["| shape | " + " | ".join(f"launch {k[1]}" if k[1] else f"N_T = {k[0]}"
                                       for k in keys) + " |",
             "|---" * (len(keys) + 1) + "|"]
    for shape in sorted(times):
        mean = {k: sum(v) / len(v) for k, v in times[shape].items()}
        base = mean.get(default)
        cells = []
        for p in keys:
            if p not in mean:
                cells.append("–")
                continue
            j, launched = chunks[shape, p]
            text = f"{mean[p]:.2f} (J {j}" + (f", P {launched})" if launched else ")")
            if base is not None and p != default:
                text += f" {mean[p] - base:+.2f}"
            cells.append(f"**{text}**" if mean[p] == min(mean.values()) else text)
        lines.append(f"| {shape[1] // 1024}k×{shape[0]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def single(parser, args):
    if args.programs:
        print(programs_report(args.results))
    else:
        table, _, verdict = split_report(args.results)
        print(f"{table}\n\n{verdict}")


# ============================================================================================
# tune: the tuning sweeps
# ============================================================================================

def tune_table(results, kind):
    """``{variant: {shape: µs}}`` of one kind, in the order the sweep ran them."""
    by_variant = {}
    for row in results:
        if row["kind"] == kind:
            by_variant.setdefault(row["variant"], {})[row["shape"]] = row["us"]
    return by_variant


def baselines(by_variant, words=("default",)):
    """``{mode: {shape: µs}}``: per mode (the words before ``default``; "" for a plain
    ``default``), the mean of its default's runs (``default`` and ``default again``).
    ``words``: the names that mark a baseline, ``default`` unless a sweep names its own
    (e.g. ``triton`` where Triton's kernel is the one compared against). A baseline word
    followed by a case (``cuda base, table 2048 pages``) is that case's baseline: its mode is
    ``cuda …, table 2048 pages``, the baseline of the variants ending in the same case."""
    runs = {}
    for name, by_shape in by_variant.items():
        for suffix in [form for word in words for form in (word, word + " again")]:
            head, case = name, ""
            if f" {suffix}, " in f" {name}":
                start = f" {name}".index(f" {suffix}, ")
                head, case = name[:start + len(suffix)], name[start + len(suffix):]
            if head == suffix or head.endswith(" " + suffix):
                mode = head[:-len(suffix)].strip()
                runs.setdefault(f"{mode} …{case}" if case else mode, []).append(by_shape)
    if not runs:
        raise SystemExit(f"no {' or '.join(map(repr, words))} variant to compare with")
    return {mode: {shape: statistics.mean(run[shape] for run in mode_runs if shape in run)
                   for shape in mode_runs[0]} for mode, mode_runs in runs.items()}


def base_of(variant, bases):
    """The baseline of ``variant``: its mode's (the longest mode it starts with, of those
    whose case, if any, it ends with)."""
    def matches(mode):
        prefix, _, case = mode.partition(" …")
        if not variant.endswith(case):
            return False
        return variant == prefix or variant.startswith(prefix + " ") or not prefix
    modes = [mode for mode in bases if matches(mode)]
    return bases[max(modes, key=len)] if modes else None


def shapes_of(bases):
    """Every shape some mode's baseline has, in the order they first appear."""
    return list(dict.fromkeys(shape for base in bases.values() for shape in base))


def tune_markdown(by_variant, bases):
    shapes = shapes_of(bases)
    lines = ["| variant | " + " | ".join(shapes) + " |", "|---" * (len(shapes) + 1) + "|"]
    for variant, by_shape in by_variant.items():
        base = base_of(variant, bases) or {}
        cells = [(f"{by_shape[s]:.1f} ({by_shape[s] / base[s] - 1:+.0%})" if s in base
                  else f"{by_shape[s]:.1f}") if s in by_shape else "–" for s in shapes]
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def tune(parser, args):
    with open(args.result) as f:
        run = json.load(f)
    by_variant = tune_table(run["results"], args.kind)
    words = args.baseline or ["default"]
    bases = baselines(by_variant, words)
    print(tune_markdown(by_variant, bases))

    plt = common_pyplot()

    shapes = shapes_of(bases)
    fig, axes = plt.subplots(1, len(shapes), figsize=(4 * len(shapes), 0.35 * len(by_variant) + 2),
                             sharey=True, squeeze=False)
    names = list(by_variant)
    for ax, shape in zip(axes[0], shapes):
        ratios = [by_variant[name].get(shape, float("nan"))
                  / (base_of(name, bases) or {}).get(shape, float("nan")) for name in names]
        ax.barh(range(len(names)), ratios, color=[
            "grey" if any(name.endswith(word) for word in words) else "tab:blue"
            for name in names])
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.set_title(f"{shape}: {' / '.join(words)} " + " / ".join(
            f"{base[shape]:.1f}" for base in bases.values() if shape in base) + " µs")
        ax.set_xlabel(f"{args.kind} time / {' or '.join(words)}'s")
    axes[0][0].set_yticks(range(len(names)), names, fontsize=8)
    axes[0][0].invert_yaxis()
    fig.suptitle(f"{run.get('gpu', '')}, {run.get('date', '')}: {run.get('command', '')}",
                 fontsize=8)
    fig.tight_layout()
    path = args.result[:-len(".json")] + ("" if args.kind == "estimate" else f"-{args.kind}") \
        + ".png"
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


# ============================================================================================
# accuracy-vllm: accuracy through the vLLM plugin
# ============================================================================================

def _perplexity(rows):
    """exp of the token-weighted mean NLL over documents."""
    import math

    tokens = sum(r["tokens"] for r in rows)
    return math.exp(sum(r["nll"] * r["tokens"] for r in rows) / tokens) if tokens else None


def coarse_kl(p_ids, p_logprobs, q_ids, q_logprobs):
    """KL(p || q) over the tokens in both top lists, the rest of the vocabulary lumped into one
    outcome; and p's lumped mass. Inputs: one step's top token ids and log-probabilities."""
    import math

    q = dict(zip(q_ids.tolist(), q_logprobs.tolist()))
    kl, p_in, q_in = 0.0, 0.0, 0.0
    for token, lp in zip(p_ids.tolist(), p_logprobs.tolist()):
        if token in q:
            kl += math.exp(lp) * (lp - q[token])
            p_in += math.exp(lp)
            q_in += math.exp(q[token])
    p_rest, q_rest = max(1.0 - p_in, 0.0), max(1.0 - q_in, 1e-12)
    if p_rest > 0:
        kl += p_rest * math.log(p_rest / q_rest)
    return kl, p_rest


def vllm_accuracy(parser, args):
    if args.folder.endswith(".json"):  # a summary written before: tables and plot again
        with open(args.folder) as f:
            return vllm_accuracy_render(json.load(f), args.folder, args.readme)
    import numpy as np

    from accuracy import arm_order
    from moira.evaluation.experiments import paired_bootstrap

    arms = {}
    for name in sorted(os.listdir(args.folder)):
        if name.endswith(".json") and not name.startswith("summary"):
            with open(os.path.join(args.folder, name)) as f:
                result = json.load(f)
            if "arm" in result:
                npz = os.path.join(args.folder, name[:-5] + ".npz")
                if not os.path.exists(npz):
                    raise SystemExit(f"{npz} is missing: KL needs every arm's top lists (to "
                                     f"redraw from a summary, pass its .json)")
                result["arrays"] = dict(np.load(npz))
                arms[result["arm"]] = result
    if "dense" not in arms:
        raise SystemExit(f"{args.folder}: no dense arm")
    dense = arms.pop("dense")
    summary = dict(model=dense["model"], gpu=dense["gpu"], vllm=dense["vllm"],
                   torch=dense["torch"], date=dense["date"], documents=dense["documents"],
                   positions=dense["positions"], logprobs=dense["logprobs"],
                   commands={arm: r["command"] for arm, r in [("dense", dense), *arms.items()]},
                   contexts={})
    for result in (dense, *arms.values()):  # a failed phase (its error is in the arm's file)
        result["phases"] = {name: phase for name, phase in result["phases"].items()
                            if "rows" in phase}
    for context in dense["contexts"]:
        table = {}
        retrieval = dense["phases"].get(f"retrieval_{context}")
        kl_rows = dense["phases"].get(f"kl_{context}")
        if retrieval:
            table["dense"] = dict(retrieval=np.mean([r["correct"] for r in retrieval["rows"]]),
                                  samples=len(retrieval["rows"]))
        repeat = dense["phases"].get(f"repeat_{context}")
        if repeat:
            table.setdefault("dense", {})["repeat_ppl"] = _perplexity(repeat["rows"])
        for arm in sorted(arms, key=arm_order):
            phases, entry = arms[arm]["phases"], {}
            sparse = phases.get(f"retrieval_{context}")
            if retrieval and sparse:
                d = [float(r["correct"]) for r in retrieval["rows"]]
                s = [float(r["correct"]) for r in sparse["rows"]]
                entry.update(retrieval=float(np.mean(s)), retrieval_read=sparse["read_fraction"],
                             retrieval_minus_dense=paired_bootstrap(d, s))
            sparse = phases.get(f"kl_{context}")
            ids = arms[arm]["arrays"].get(f"ids_{context}")
            if kl_rows and sparse and ids is not None and f"ids_{context}" in dense["arrays"]:
                p_ids = dense["arrays"][f"ids_{context}"]
                p_lp = dense["arrays"][f"logprobs_{context}"]
                q_lp = arms[arm]["arrays"][f"logprobs_{context}"]
                per_doc, lumped, mismatched = {}, [], 0
                for row, (a, b) in enumerate(zip(kl_rows["rows"], sparse["rows"])):
                    if a["tokens"][0] != b["tokens"][0]:  # different histories: not comparable
                        mismatched += 1
                        continue
                    value, rest = coarse_kl(p_ids[row], p_lp[row], ids[row], q_lp[row])
                    per_doc.setdefault(a["doc"], []).append(value)
                    lumped.append(rest)
                doc_means = [sum(v) / len(v) for v in per_doc.values()]
                entry.update(kl=float(np.mean(doc_means)), kl_docs=len(doc_means),
                             kl_steps=len(lumped), kl_read=sparse["read_fraction"],
                             kl_lumped_mass=float(np.mean(lumped)),
                             kl_first_token_mismatches=mismatched,
                             kl_doc_means=[round(v, 6) for v in doc_means])
            sparse = phases.get(f"repeat_{context}")
            if sparse:
                entry.update(repeat_ppl=_perplexity(sparse["rows"]),
                             repeat_read=sparse["read_fraction"],
                             repeat_missing=sum(r["missing"] for r in sparse["rows"]))
            if entry:  # an arm run at other contexts only (a top_k budget is per context)
                table[arm] = entry
        summary["contexts"][str(context)] = table
    out = args.out or os.path.join(args.folder, "summary.json")
    with open(out, "w") as f:
        json.dump(summary, f, indent=1, default=float)
    vllm_accuracy_render(summary, out, args.readme)


def vllm_accuracy_render(summary, path, readme=None):
    """Print the markdown table, draw ``<summary>.png``, and optionally fill the
    ``accuracy-vllm`` section of ``readme``."""
    text = vllm_accuracy_markdown(summary)
    print(text)
    vllm_accuracy_plot(summary, os.path.splitext(path)[0] + ".png")
    if readme:
        write_section(readme, "accuracy-vllm", text)


def _model_name(summary):
    return summary.get("model_name") or os.path.basename(summary["model"].rstrip("/"))


def vllm_accuracy_plot(summary, path):
    """Token KL and pass-key accuracy against the fraction of pages read, one line per
    context; dense accuracy as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (kl_axis, acc_axis) = plt.subplots(1, 2, figsize=(10, 3.8))
    colors = ("tab:blue", "tab:orange", "tab:green", "tab:red")
    for (context, table), color in zip(summary["contexts"].items(), colors):
        arms = [(arm, row) for arm, row in table.items() if arm != "dense"]
        kl = [(row["kl_read"], row["kl"], arm) for arm, row in arms if "kl" in row]
        acc = [(row["retrieval_read"], row["retrieval"], arm) for arm, row in arms
               if "retrieval" in row]
        for axis, points in ((kl_axis, kl), (acc_axis, acc)):
            rule = [(x, y) for x, y, arm in points if not arm.startswith("top_k")]
            fixed = [(x, y) for x, y, arm in points if arm.startswith("top_k")]
            axis.plot([x for x, _ in rule], [y for _, y in rule], "o-", color=color,
                      label=f"{context} tokens, coverage rule")
            if fixed:
                axis.plot([x for x, _ in fixed], [y for _, y in fixed], "s", color=color,
                          mfc="none", label=f"{context} tokens, fixed K")
            for x, y, arm in points:
                axis.annotate(arm if arm.startswith("top_k") else f"γ={arm}", (x, y), fontsize=7,
                              textcoords="offset points",
                              xytext=(3, 3))
        if "dense" in table:
            acc_axis.axhline(table["dense"]["retrieval"], color=color, ls="--", lw=1,
                             label=f"dense, {context}")
    kl_axis.set(xlabel="fraction of KV pages read", ylabel="token KL to dense (lower bound)",
                yscale="log", title="KL of the decode step's next-token distribution")
    samples = {row["dense"].get("samples") for row in summary["contexts"].values()
               if "dense" in row}
    acc_axis.set(xlabel="fraction of KV pages read", ylabel="pass-key exact match",
                 title=f"pass-key retrieval ({'/'.join(map(str, sorted(samples - {None})))} "
                       f"samples per context)")
    for axis in (kl_axis, acc_axis):
        axis.legend(fontsize=7)
    fig.suptitle(f"{_model_name(summary)}: Moira in vLLM "
                 f"{summary['vllm']} vs dense FA3, {summary['gpu']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def vllm_accuracy_markdown(summary):
    lines = [f"**{_model_name(summary)}** through vLLM {summary['vllm']} "
             f"on one {summary['gpu']}, {summary['date']}: dense FA3 against the Moira plugin "
             f"(prefill by FA3, decode steps by Moira's kernels in full CUDA graphs); "
             f"{summary['documents']} documents per context, pass-key samples single and 4-key "
             f"(2 per document), KL over {summary['positions']} decode steps per document "
             f"(top-{summary['logprobs']} lists, the rest lumped: a lower bound).", "",
             "| context | arm | pass-key acc. (dense) | Δ vs dense [95% CI] | pages read | "
             "token KL | pages read | lumped mass |", "|---|---|---|---|---|---|---|---|"]
    with_repeat = any("repeat_ppl" in row for table in summary["contexts"].values()
                      for row in table.values())
    if with_repeat:
        lines[-2] += " repeated-passage ppl (dense) | pages read |"
        lines[-1] += "---|---|"
    for context, table in summary["contexts"].items():
        dense = table.get("dense", {})
        for arm, row in table.items():
            if arm == "dense":
                continue
            delta = row.get("retrieval_minus_dense")
            lines.append(
                f"| {context} | {'γ = ' + arm if arm[0].isdigit() else arm} | "
                + (f"{row['retrieval']:.3f} ({dense['retrieval']:.3f})" if "retrieval" in row
                   else "—")
                + (f" | {delta['mean']:+.3f} [{delta['low']:+.3f}, {delta['high']:+.3f}] | "
                   f"{row['retrieval_read']:.1%}" if delta else " | — | —")
                + (f" | {row['kl']:.4f} | {row['kl_read']:.1%} | {row['kl_lumped_mass']:.4f} |"
                   if "kl" in row else " | — | — | — |")
                + ((f" {row['repeat_ppl']:.3f} ({dense.get('repeat_ppl', float('nan')):.3f}) | "
                    f"{row['repeat_read']:.1%} |" if "repeat_ppl" in row else " — | — |")
                   if with_repeat else ""))
    return "\n".join(lines)


# ============================================================================================
# accuracy: moira eval result files
# ============================================================================================

def _open(path, mode="rt"):
    """Result files may be gzipped (``.json.gz``: the per-step rows run to megabytes)."""
    return gzip.open(path, mode) if path.endswith(".gz") else open(path, mode)


def _stem(path):
    return re.sub(r"\.json(\.gz)?$", "", path)


def _gammas(table):
    """The arms' keys: "0.98", and "0.98 calibrated" (per-head targets) after its gamma."""
    arms = [key for key in table if re.fullmatch(r"[\d.]+( calibrated)?", key)]
    return sorted(arms, key=lambda key: (float(key.split()[0]), key))


def _fmt(value, spec):
    return "—" if value is None else format(value, spec)


def accuracy_markdown(path, result):
    table = result["table"]
    lines = [f"**{os.path.basename(result['model'].rstrip('/'))}**, {result['context']}-token "
             f"contexts, {result['documents']} samples per task, {result['device']}, "
             f"{result['date']} (`{os.path.basename(path)}`; {result['seconds'] / 60:.0f} min; "
             f"command: `{result['command']}`)."
             + (" The text was too short for disjoint samples: the windows overlap, so the "
                "samples are not independent and the intervals are too narrow."
                if result.get("overlapping_windows") else ""), ""]
    gammas = _gammas(table)
    if any(key in table[g] for g in gammas for key in ("kl", "retrieval", "repeat_ppl")):
        lines += ["| γ | token KL | pages read | pass-key acc. (dense) | Δ vs dense [95% CI] "
                  "| pages read | repeated-passage ppl (dense) | pages read |",
                  "|---|---|---|---|---|---|---|---|"]
        dense = table.get("dense", {})
        for g in gammas:
            row = table[g]
            delta = row.get("retrieval_minus_dense")
            interval = (f"{delta['mean']:+.3f} [{delta['low']:+.3f}, {delta['high']:+.3f}]"
                        if delta else "—")
            lines.append(
                f"| {g} | {_fmt(row.get('kl'), '.3g')} | "
                f"{_fmt(row.get('kl_read_fraction'), '.1%')} | "
                f"{_fmt(row.get('retrieval'), '.2f')} ({_fmt(dense.get('retrieval'), '.2f')}) | "
                f"{interval} | {_fmt(row.get('retrieval_read_fraction'), '.1%')} | "
                f"{_fmt(row.get('repeat_ppl'), '.3f')} ({_fmt(dense.get('repeat_ppl'), '.3f')}) "
                f"| {_fmt(row.get('repeat_read_fraction'), '.1%')} |")
        lines.append("")
    if "budget" in table:
        b = table["budget"]
        lines += [
            f"Oracle coverage sets C*(0.95) over {b['rows']} (layer, KV head, step) rows: mean "
            f"{b['mean_coverage_fraction']:.1%} of the context; CV of the set size "
            f"{b['cv_across_layers']:.2f} across layers, {b['cv_across_heads_of_a_layer']:.2f} "
            f"across the KV heads of a layer (same step), {b['cv_across_steps']:.2f} across the "
            f"steps of a (layer, KV head). Budgets that give 90% of the rows >= 0.95 of the mass "
            f"read {b['fixed_budget_reads_vs_coverage']:.2f}x the coverage sets (one fixed "
            f"budget, {b['fixed_budget_pages']:.0f} pages) and "
            f"{b['profiled_budget_reads_vs_coverage']:.2f}x (one budget per layer and KV head).",
            ""]
    if "ablation" in table:
        lines += ["| selector (equal reads) | token KL | pages read | documents where the coverage "
                  "rule's KL is lower |", "|---|---|---|---|"]
        for name, arm in table["ablation"].items():
            lines.append(f"| {name} | {arm['kl']:.3g} | {arm['read_fraction']:.1%} | "
                         f"{arm['docs_where_coverage_kl_is_lower']} / {result['documents']} |")
        lines.append("")
    if "estimator_error" in table:
        e = table["estimator_error"]
        worst = ", ".join(f"layer {w['layer']} head {w['head']}: {w['mean_exact_mass']:.3f}"
                          for w in e["worst_layer_heads"])
        lines += [f"Exact attention mass inside the coverage rule's lists at γ={e['gamma']}: "
                  f"mean {e['mean_exact_mass']:.3f}; {e['rows_below_gamma_minus_002']:.1%} of "
                  f"the rows fall below γ - 0.02; lowest (layer, KV head) means: {worst}.", ""]
    return "\n".join(lines)


def accuracy_plots(path, result):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table, stem = result["table"], _stem(path)
    gammas = [g for g in _gammas(table) if "kl" in table[g]]
    if gammas:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        for style, series in (("o-", [g for g in gammas if "calibrated" not in g]),
                              ("s--", [g for g in gammas if "calibrated" in g])):
            reads = [table[g]["kl_read_fraction"] for g in series]
            kls = [max(table[g]["kl"], 1e-9) for g in series]
            if series:
                ax.plot(reads, kls, style, label="per-head targets" if "s" in style else "γ")
            for g, x, y in zip(series, reads, kls):
                ax.annotate(f"γ={g}", (x, y), textcoords="offset points", xytext=(4, 4),
                            fontsize=8)
        if "ablation" in table:
            for name, arm in table["ablation"].items():
                ax.plot(arm["read_fraction"], max(arm["kl"], 1e-9), "x")
                ax.annotate(name, (arm["read_fraction"], arm["kl"]), fontsize=6,
                            textcoords="offset points", xytext=(4, -8))
        ax.set(xlabel="fraction of KV pages read", ylabel="mean token KL to dense",
               yscale="log", title=os.path.basename(stem))
        fig.tight_layout()
        fig.savefig(stem + "-kl.png", dpi=120)
        plt.close(fig)
    if "budget" in table:
        grid = table["budget"]["coverage_fraction_per_layer_head"]
        fig, ax = plt.subplots(figsize=(3 + 0.4 * len(grid[0]), 0.18 * len(grid) + 1.5))
        image = ax.imshow(grid, aspect="auto", cmap="viridis", vmin=0)
        fig.colorbar(image, label="mean |C*(0.95)| / pages")
        ax.set(xlabel="KV head", ylabel="layer", title="oracle coverage set size")
        fig.tight_layout()
        fig.savefig(stem + "-budget.png", dpi=120)
        plt.close(fig)


def accuracy_merge(paths, destination):
    from moira.evaluation.experiments import summarize_rows

    parts = []
    for path in paths:
        with _open(path) as f:
            parts.append(json.load(f))
    keys = {(p["model"], p["context"], p["documents"]) for p in parts}
    if len(keys) != 1:
        raise SystemExit(f"--merge-into joins runs of one model, context and sample count; "
                         f"got {sorted(keys)}")
    rows = {}
    for part in parts:
        overlap = set(rows) & set(part["rows"])
        if overlap:
            raise SystemExit(f"tasks {sorted(overlap)} appear in more than one part")
        rows.update(part["rows"])
    # a part that is itself a merge brings its own parts (a file grows over runs)
    merged = dict(parts[0], rows=rows, table=summarize_rows(rows),
                  seconds=sum(p["seconds"] for p in parts),
                  command=" ; ".join(p["command"] for p in parts),
                  parts=[entry for path, p in zip(paths, parts)
                         for entry in p.get("parts") or [dict(
                             file=os.path.basename(path), command=p["command"],
                             seconds=p["seconds"], date=p["date"])]])
    with _open(destination, "wt") as f:
        json.dump(merged, f, indent=None if destination.endswith(".gz") else 1)
    return destination


def accuracy(parser, args):
    if args.merge_into:
        args.results = [accuracy_merge(args.results, args.merge_into)]
    sections = []
    for path in args.results:
        with _open(path) as f:
            result = json.load(f)
        accuracy_plots(path, result)
        sections.append(accuracy_markdown(path, result))
    text = "\n".join(sections)
    print(text)
    if args.readme:
        write_section(args.readme, "accuracy", text)


# ============================================================================================
# calibration: per-head coverage targets
# ============================================================================================

def estimators(parser, args):
    """``accuracy.py estimators``' study: every arm's accuracy, token KL and pages read over
    all its samples, and its accuracy per task (samples dense answers count)."""
    opener = gzip.open if args.result.endswith(".gz") else open
    with opener(args.result, "rt") as f:
        study = json.load(f)
    table = study["table"]
    tasks = [task for task in table if task != "all" and table[task]["dense_accuracy"] > 0]
    lines = ["| arm | accuracy | token KL | pages read | "
             + " | ".join(f"{task} ({table[task]['dense_accuracy']:.2f})" for task in tasks)
             + " |", "|---|---|---|---|" + "---|" * len(tasks)]
    for label, arm in table["all"]["arms"].items():
        per_task = " | ".join(f"{table[task]['arms'][label]['accuracy']:.2f}" for task in tasks)
        lines.append(f"| {label} | {arm['accuracy']:.2f} | {arm['kl']:.4f} | "
                     f"{arm['read_fraction']:.1%} | {per_task} |")
    commands = "; ".join(dict.fromkeys(part["command"] for part in study.get("parts", [study])))
    text = "\n".join(lines) + (
        f"\n\n{study['model']}, {study['context']} tokens, {table['all']['samples']} samples "
        f"(dense accuracy {table['all']['dense_accuracy']:.2f}; per task in the header), float32 "
        f"on the CPU. Generated by `benchmarks/report.py estimators` from "
        f"[`{repo_path(args.result)}`](../{repo_path(args.result)}); made by `{commands}`.")
    print(text)
    if args.readme:
        write_section(args.readme, args.section, text)


def calibration(parser, args):
    rows, parts = [], []
    for path in args.parts:
        with open(path) as f:
            part = json.load(f)
        rows += part["rows"]
        parts.append(dict(file=os.path.basename(path), command=part["command"],
                          seconds=part["seconds"]))
    with open(json.load(open(args.parts[0]))["calibration"]) as f:
        measured = json.load(f)
    table = {}
    for name in dict.fromkeys(r["arm"] for r in rows):
        mine = [r for r in rows if r["arm"] == name]
        table[name] = dict(kl=sum(r["kl"] for r in mine) / len(mine),
                           read_fraction=sum(r["read_fraction"] for r in mine) / len(mine),
                           documents=len(mine))
    info = run_info()
    result = dict(table=table, rows=rows, parts=parts, calibration=measured,
                  date=info["date"][:10], torch=info["versions"]["torch"])
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    lines = ["| arm | token KL (mean) | token KL (median) | pages read | documents |",
             "|---|---|---|---|---|"]
    for name, row in table.items():
        median = statistics.median(r["kl"] for r in rows if r["arm"] == name)
        lines.append(f"| {name} | {row['kl']:.4f} | {median:.4f} | {row['read_fraction']:.1%} "
                     f"| {row['documents']} |")
    text = "\n".join(lines)
    print(text)
    if args.readme:
        commands = "; ".join(p["command"] for p in parts)
        write_section(args.readme, "calibration", text + (
            f"\n\nGenerated by `benchmarks/report.py calibration` from "
            f"`{os.path.relpath(args.out)}` ({result['date']}, CPU, float32 reference; "
            f"calibration: {measured['documents']} documents of {measured['context']} tokens "
            f"from the text's first half, `{measured['command']}`; evaluation: "
            f"{len({r['doc'] for r in rows})} documents from its second half, `{commands}`)."))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3.5))
        for marker, prefix in (("o-", "global"), ("s", "calibrated")):
            points = sorted((row["read_fraction"], row["kl"], name)
                            for name, row in table.items() if name.startswith(prefix))
            ax.plot([p[0] for p in points], [p[1] for p in points], marker, label=prefix)
            for x, y, name in points:
                ax.annotate(name.split("=")[1], (x, y), fontsize=7)
        ax.set_xlabel("pages read")
        ax.set_ylabel("token KL to dense")
        ax.set_yscale("log")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)


# ============================================================================================
# headline: the README's headline table
# ============================================================================================

# the paper's serving gain on set B at concurrency 8 (set A at 16: none given)
PAPER_SERVE = {"B": "+42%"}
# vllm_serve.py's prompt sets: their prompts' lengths
SET_TOKENS = {"A": "4k–64k", "B": "66k–126k"}


def mean_speedups(folders, gamma):
    """Per shape (in ``TPOT_SHAPES``' order), the mean over interleaved pairs of dense FA3's TPOT
    over Moira's at ``gamma``'s reads, and the paper's speedup: what ``report.py tpot --pairs``
    prints in its ``mean`` and ``paper`` columns."""
    speedups, paper, hosts = {}, {}, set()
    for folder in folders:
        runs = tpot_load([folder])
        hosts |= {(run["gpu"], run["versions"]["vllm"]) for run in runs.values()}
        for row in tpot_table(runs)[1]:
            cell = row[f"g{gamma}"]
            if cell["speedup"]:
                speedups.setdefault(row["shape"], []).append(cell["speedup"])
                paper[row["shape"]] = cell["paper"]
    shapes = sorted(speedups, key=TPOT_SHAPES.index)
    return (shapes, [statistics.mean(speedups[s]) for s in shapes], [paper[s] for s in shapes],
            hosts)


def serving_gain(folders):
    """Moira's output tokens/s over dense FA3's, the slices of ``folders`` pooled, and the
    workload's set and concurrency."""
    runs = [run for run in serve_load(folders) if not run.get("moira_environment")]
    by_arm = {run["label"]: run for run in runs}
    moira, dense = by_arm["moira"], by_arm["dense"]
    return moira["output_tokens_per_s"] / dense["output_tokens_per_s"] - 1, moira


def headline(parser, args):
    def ratios(values):
        return " / ".join(f"{v:.2f}" for v in values) + "×"

    shapes, ours, paper, hosts = mean_speedups(args.tpot, 0.98)
    shapes_099, ours_099, paper_099, hosts_099 = mean_speedups(args.tpot_099, 0.99)
    assert shapes == shapes_099, (shapes, shapes_099)
    host = "; ".join(f"one {gpu}, vLLM {vllm}" for gpu, vllm in sorted(hosts | hosts_099))
    names = " / ".join(s.replace("k", "k×") for s in shapes)
    lines = ["| measure | Moira | paper |", "|---|---|---|",
             f"| TPOT speedup, γ = 0.98's reads | **{ratios(ours)}** | {ratios(paper)} |",
             f"| TPOT speedup, γ = 0.99's reads | **{ratios(ours_099)}** | "
             f"{ratios(paper_099)} |"]
    for folders in (args.serve_a, args.serve_b):
        gain, run = serving_gain(folders)
        lines.append(f"| serving, set {run['set']} ({SET_TOKENS.get(run['set'], '?')}-token "
                     f"prompts), {run['concurrency']} concurrent: output tokens/s | "
                     f"**{gain:+.1%}** | "
                     f"{PAPER_SERVE.get(run['set'], '–')} |")
    with open(args.accuracy) as f:
        summary = json.load(f)
    context = max(summary["contexts"], key=int)
    table = summary["contexts"][context]
    for gamma in ("0.98", "0.99"):
        arm = table[gamma]
        lines.append(f"| {summary.get('model_name', 'trained model').split(' (')[0]}, "
                     f"{int(context) // 1000}k, γ = {gamma}: KL, pages read, pass-key (dense) | "
                     f"{arm['kl']:.4f}, {arm['kl_read']:.1%}, {arm['retrieval']:.3f} "
                     f"({table['dense']['retrieval']:.3f}) | – |")
    text = "\n".join(lines) + (
        f"\n\nMeasured on {host}. TPOT speedup: dense FA3's time per output token over Moira's,\n"
        f"Llama-3.1-8B geometry with random weights and the paper's measured read fractions "
        f"imposed,\ncontext × batch {names}, mean of interleaved pairs; serving: output "
        f"tokens/s over\ndense FA3's; accuracy through the vLLM plugin (token KL "
        f"against dense, a lower bound; pass-key accuracy).")
    print(text)
    if args.readme:
        write_section(args.readme, args.section, text)


def common_pyplot():
    from common import pyplot

    return pyplot()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    reports = parser.add_subparsers(dest="report", required=True)

    def readme_options(one, section):
        one.add_argument("--readme", help="a markdown file whose section to replace")
        one.add_argument("--section", default=section, help="the section to replace")

    one = reports.add_parser("tpot", help="vllm_tpot.py runs")
    one.add_argument("folders", nargs="+")
    one.add_argument("--pairs", action="store_true",
                     help="each folder is one interleaved dense/Moira pair (vllm_tpot.py "
                          "--pairs): per-pair and mean speedups")
    one.add_argument("--plot", metavar="PATH",
                     help="where the PNG goes (default <first folder>.png); with --pairs, "
                          "only if given")
    readme_options(one, "tpot")
    one = reports.add_parser("serve", help="vllm_serve.py runs")
    one.add_argument("folders", nargs="+")
    one.add_argument("--plot", help="the plot's path (default: <folder>.png, one folder)")
    one.add_argument("--from-offset", type=int, default=0,
                     help="per-request lines: only the slices from this prompt on")
    readme_options(one, "serve")
    one = reports.add_parser("step", help="vllm_step_profile.py runs")
    one.add_argument("folders", nargs="+")
    one.add_argument("--plot", metavar="PATH", help="also draw the steps as stacked bars")
    readme_options(one, "step-profile")
    one = reports.add_parser("kernels", help="kernel_bench.py suite's JSON")
    one.add_argument("result")
    readme_options(one, "kernels")
    one = reports.add_parser("single", help="kernel_bench.py single's sweeps")
    one.add_argument("results", nargs="+", metavar="JSON")
    which = one.add_mutually_exclusive_group(required=True)
    which.add_argument("--split", action="store_true",
                       help="the --split-sweep table of these runs and the rule's verdict")
    which.add_argument("--programs", action="store_true",
                       help="the --programs-sweep table of these runs")
    one = reports.add_parser("tune", help="tune.py's JSON")
    one.add_argument("result")
    one.add_argument("--kind", default="estimate")
    one.add_argument("--baseline", action="append", default=None,
                     help="a variant name's ending that marks its mode's baseline "
                          "(repeatable; default: 'default')")
    one = reports.add_parser("accuracy-vllm", help="accuracy.py vllm's arms")
    one.add_argument("folder", help="the arms' folder (with their .npz), or a summary .json")
    one.add_argument("--out", default=None)
    one.add_argument("--readme", default=None)
    one = reports.add_parser("accuracy", help="moira eval result files")
    one.add_argument("results", nargs="+")
    one.add_argument("--readme")
    one.add_argument("--merge-into", help="join the result files into this one first")
    one = reports.add_parser("estimators", help="accuracy.py estimators' study")
    one.add_argument("result")
    readme_options(one, "estimators")
    one = reports.add_parser("calibration", help="accuracy.py calibrated-kl's parts")
    one.add_argument("parts", nargs="+")
    one.add_argument("--out", required=True)
    one.add_argument("--plot")
    one.add_argument("--readme")
    one = reports.add_parser("headline", help="the README's headline table")
    one.add_argument("--tpot", nargs="+", required=True,
                     help="interleaved pair folders, Moira at γ = 0.98's reads")
    one.add_argument("--tpot-099", nargs="+", required=True,
                     help="interleaved pair folders, Moira at γ = 0.99's reads")
    one.add_argument("--serve-a", nargs="+", required=True, help="serving folders, set A")
    one.add_argument("--serve-b", nargs="+", required=True, help="serving folders, set B")
    one.add_argument("--accuracy", required=True,
                     help="accuracy.py vllm's summary.json (its longest context is shown)")
    readme_options(one, "headline")
    args = parser.parse_args(argv)
    handlers = {"tpot": tpot, "serve": serve, "step": step, "kernels": kernels,
                "single": single, "tune": tune, "accuracy-vllm": vllm_accuracy,
                "accuracy": accuracy, "calibration": calibration, "headline": headline,
                "estimators": estimators}
    handlers[args.report](reports.choices[args.report], args)


if __name__ == "__main__":
    main()
