"""Tables and a plot from ``vllm_tpot.py`` runs (issue 5): TPOT of dense FA3 and of Moira at
the paper's read fractions, speedups against the paper's Tables 3 and 7.

    python benchmarks/tpot_report.py benchmarks/results/tpot-2026-11-29 [MORE_FOLDERS]
        [--readme benchmarks/RESULTS.md]

A folder holds one JSON per engine run: ``<model>-dense.json`` and ``<model>-moira-g098.json``
/ ``-g099.json``; several folders (e.g. one per model, from different sessions) make one table.
Writes ``<first folder>.png`` (or ``--plot PATH``) and, with ``--readme``, that file's
``tpot`` section (benchmarks/RESULTS.md; ``--section`` another). With ``--pairs``, each folder is one interleaved pair (``tpot_pairs.sh``):
per-pair and mean speedups (and at the short shapes, with ``--plot PATH``, their bars).
"""

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from readme_section import repo_path, write_section  # noqa: E402

SHAPES = ["8k32", "16k32", "32k16", "64k8", "130k4", "2k1", "8k1", "16k1", "32k1", "64k1",
          "2k2", "8k2", "2k4", "8k4", "16k4"]
# short requests, one to four at a time (issue 5, item 4): rows read in full up to 20,480 / B
# tokens; --pairs reports them relative to each pair's dense engine
SHORT = {"2k1", "8k1", "16k1", "32k1", "64k1", "2k2", "8k2", "2k4", "8k4", "16k4"}
# the paper's speedups of Moira over dense FA3 (Table 3: gamma 0.98, Table 7: gamma 0.99) and
# issue 5's aims at gamma 0.98
PAPER = {("llama-3.1-8b", 0.98): [1.38, 1.78, 1.89, 2.62, 2.64],
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
# Estimate's launch, Merge in Attend's) were options until session 12, removed after measuring
# slower or too little faster (benchmarks/RESULTS.md); kept here as labels so that their runs' files still load
VARIANTS = (("programmatic_launch", "pdl"), ("fused_select", "fsel"), ("fused_merge", "fmerge"),
            ("fused_cache_write", "fcw"))
JNOCAP_LABEL = "Moira, J from Eq. 4 alone (max_chunks_per_row 4096: the split before session 20)"
# the batch-shape pairs table's labels for a third engine's column (others: "Moira, <kind>")
PAIR_VARIANT_LABELS = {"fsel": "the same, Estimate + Select in one launch",
                       "fcw": "Moira, K/V written in Estimate's launch (fused_cache_write)",
                       "nofcw": "Moira, K/V written by vLLM's kernel (fused_cache_write off)",
                       "split": "Moira, Attend's split set (floor_rows, min_programs, "
                                "min_chunks_per_row: in its JSON)",
                       "Jmax=4096": JNOCAP_LABEL,
                       "HND": "Moira on vLLM's head-major cache (VLLM_KV_CACHE_LAYOUT=HND)",
                       "kern": "Moira, kernel tuning constants set (kernel_settings: in its "
                               "JSON)"}


def load(folders):
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
            # the base Moira column is the default of its time: with vLLM's cache write before
            # session 23, the write in Estimate since; keep folders of both eras apart
            defaults = run.get("plugin_defaults") or {}
            # kernel variants of the same (programmatic launch; in older files Select in
            # Estimate's launch, Merge in Attend's): a column each, "+"-joined when combined
            # (the former tpot_pairs.sh arm fboth is "fsel+fmerge")
            variant = "+".join(arm for flag, arm in VARIANTS
                               if run.get(flag) and not defaults.get(flag))
            if run.get("fused_cache_write") is False and defaults.get("fused_cache_write"):
                variant = "+".join(filter(None, [variant, "nofcw"]))  # the default turned off
            if any(run.get(key) is not None
                   for key in ("floor_rows", "min_programs", "min_chunks_per_row")):
                variant = "+".join(filter(None, [variant, "split"]))  # Attend's split changed
            if run.get("max_chunks_per_row") is not None:  # the ceiling on J (session 20)
                variant = "+".join(filter(None, [variant, f"Jmax={run['max_chunks_per_row']}"]))
            if run.get("step_programs") is not None:  # the short-row floor (0: Eq. 4 alone)
                variant = "+".join(filter(None, [variant, f"T={run['step_programs']}"]))
            if run.get("kv_cache_layout"):  # VLLM_KV_CACHE_LAYOUT (session 30's arm hnd)
                variant = "+".join(filter(None, [variant, run["kv_cache_layout"]]))
            if run.get("kernel_settings"):  # kernels' tuning constants (session 25)
                variant = "+".join(filter(None, [variant, "kern"]))
            if run.get("launched_programs"):  # Attend's grid (session 19's arm, removed)
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


def table(runs):
    lines = ["| model | shape | dense FA3 (ms) | Moira γ=0.98 (ms) | reads | speedup | paper | "
             "aim | Moira γ=0.99 (ms) | reads | speedup | paper |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    rows = []
    for model in sorted({model for model, _ in runs}):
        dense = runs.get((model, "dense"))
        if dense is None:
            continue
        dense_ms = tpot_by_shape(dense)
        for index, shape in enumerate(SHAPES):
            if shape not in dense_ms:
                continue
            cells = [model, shape, f"{dense_ms[shape]:.2f}"]
            row = dict(model=model, shape=shape, dense_ms=dense_ms[shape])
            for gamma in (0.98, 0.99):
                run = runs.get((model, gamma))
                ms = tpot_by_shape(run).get(shape) if run else None
                reads = next((r["imposed_read_fraction"] for r in run["results"]
                              if r["shape"] == shape), None) if run else None
                paper = (PAPER.get((model, gamma), []) + [None] * len(SHAPES))[index]
                aim = (AIM.get((model, gamma), []) + [None] * len(SHAPES))[index]
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
    """Interleaved pairs (issue 5: dense, Moira, dense, Moira engines one after another): one
    ``load`` result per pair; per (model, shape) each pair's speedup and their mean, the
    protocol of the paper's Table 3 (its pairs' speedups differ by at most 0.13)."""
    cells, variants, cells_099 = {}, {}, {}
    # kernel variants (a third engine per pair: tpot_pairs.sh arms such as n1024): a column
    # pair each, in the order of PAIR_VARIANT_LABELS, then any other by name
    kinds = sorted({kind for runs in pair_runs for _, kind in runs
                    if kind not in ("dense", "fallback", 0.98, 0.99)},
                   key=lambda kind: (list(PAIR_VARIANT_LABELS).index(kind)
                                     if kind in PAIR_VARIANT_LABELS else len(PAIR_VARIANT_LABELS),
                                     str(kind)))
    for runs in pair_runs:
        for row in table(runs)[1]:
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
    for model, shape in sorted(cells, key=lambda k: (k[0], SHAPES.index(k[1]))):
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
    ``attend_split``, recorded since session 14's review; the default changed in session 15),
    or nothing where a run predates the record."""
    floors = {(run.get("attend_split") or {}).get("step_programs")
              for runs in pair_runs for (_, kind), run in runs.items() if kind == arm}
    if not floors or None in floors:
        return ""
    return f" (T = {' / '.join(str(t) for t in sorted(floors))})"


def single_pairs_table(pair_runs):
    """Short-request shapes (batch 1 to 4) in interleaved pairs (``ARMS="dense moira pdl"
    tpot_pairs.sh``): per (model, shape) and arm, each pair's TPOT relative to that pair's
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


def single_pairs_plot(pair_runs, path, shapes=SHORT):
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
    if shapes is SHORT:
        ax.axhline(2.0, color="0.4", linestyle="--", linewidth=0.8)
    ax.axhline(0.0, color="0", linewidth=0.6)
    ax.set_xticks(range(len(keys)), [f"{model}\n{shape}" for model, shape in keys], fontsize=7)
    ax.set_ylabel("TPOT against the pair's dense FA3 (%)")
    ax.set_title("interleaved pairs, H200, vLLM 0.26\n(dots: pairs"
                 + ("; dashed: issue 5's 2% bar)" if shapes is SHORT else ")"), fontsize=8)
    ax.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.15))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def short_pair_keys(cells):
    return sorted({(m, s) for m, s, _ in cells}, key=lambda k: (k[0], SHAPES.index(k[1])))


def short_pair_cells(pair_runs, shapes=SHORT):
    """``(dense_cells, cells, present)``: dense TPOTs per (model, shape), one (ms, TPOT / dense
    - 1) per pair per (model, shape in ``shapes``, arm), and the arms present with their
    labels."""
    arms = [(0.98, "Moira, every row selecting"),
            ("fallback", "Moira, rows of ≤ N tokens read in full"),
            (0.99, "Moira at γ = 0.99's reads (tpot_pairs.sh arm g099)"),
            ("pdl", "the same, programmatic launch"),
            ("split", "Moira, Attend's split set (floor_rows, min_programs: in its JSON)"),
            ("Jmax=4096", JNOCAP_LABEL),
            ("T=0", "Moira, Attend's split by Eq. 4 alone (step_programs 0: before session 14)"),
            ("T=128", "Moira, the short-row floor at T = 128 programs (session 14's default)"),
            ("T=256", "Moira, the short-row floor at T = 256 programs (the default since session 15)"),
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
                    continue  # load() stands the fallback run in for the γ column
                for shape, ms in tpot_by_shape(run).items():
                    if shape in shapes and shape in dense_ms:
                        cells.setdefault((model, shape, arm), []).append(
                            (ms, ms / dense_ms[shape] - 1))
    present = [(arm, label + (floor_note(pair_runs, arm) if arm in (0.98, "fallback") else ""))
               for arm, label in arms if any(key[2] == arm for key in cells)]
    return dense_cells, cells, present


def single_table(runs):
    """Batch-1 shapes (issue 5, item 4): Moira's TPOT relative to dense, with every row
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
        for shape in SHAPES:
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


def plot(rows, path):
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


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("folders", nargs="+")
    parser.add_argument("--readme")
    parser.add_argument("--section", default="tpot", help="the generated section to replace")
    parser.add_argument("--pairs", action="store_true",
                        help="each folder is one interleaved dense/Moira pair "
                             "(benchmarks/tpot_pairs.sh): per-pair and mean speedups")
    parser.add_argument("--plot", metavar="PATH",
                        help="where the PNG goes (default <first folder>.png); with --pairs, "
                             "only if given")
    args = parser.parse_args()
    if args.pairs:
        pair_runs = [load([folder]) for folder in args.folders]
        short = all(shape in SHORT for runs in pair_runs for run in runs.values()
                    for shape in tpot_by_shape(run))
        text = (single_pairs_table if short else pairs_table)(pair_runs)
        print(text)
        if args.plot:
            single_pairs_plot(pair_runs, args.plot, SHORT if short else SHAPES)
        if args.readme:
            source = ", ".join(f"`{repo_path(folder)}/`" for folder in args.folders)
            write_section(args.readme, args.section, text + "\n\nGenerated by "
                          f"`benchmarks/tpot_report.py --pairs` from {source} (commands, GPU "
                          "and versions in each JSON): each pair's engines run one after another "
                          "on one host (their order: the JSONs' dates); TPOT: median over "
                          "requests of (last − first token time) / (tokens − 1) from vLLM's "
                          "request metrics, one timed repeat per engine (`--repeats 1`); "
                          "random weights, so Moira's read fractions are imposed (the paper's "
                          "measured reads for each context, or every page for rows read in "
                          "full).")
        return
    runs = load(args.folders)
    text, rows = table(runs)
    rows = [row for row in rows if not row["shape"].endswith("k1")]
    if not rows:  # batch-1 shapes only: their own table, no plot
        if args.plot:
            parser.error("--plot: batch-1 runs have no plot but as pairs (--pairs --plot)")
        text, png = single_table(runs), None
    else:
        png = args.plot or args.folders[0].rstrip("/") + ".png"
        plot(rows, png)
    print(text)
    if args.readme:
        any_run = next(iter(runs.values()))
        versions = any_run.get("versions") or {}
        source = ", ".join(f"`{repo_path(folder)}/`" for folder in args.folders)
        note = (f"Generated by `benchmarks/tpot_report.py` from {source} "
                f"({any_run['gpu']}, {any_run['date'][:10]}"
                + (f", vLLM {versions['vllm']}, torch {versions['torch']}" if versions else "")
                + "; commands in each JSON). TPOT: median over requests of (last − first token "
                "time) / 255 from vLLM's request metrics, median of two repeats in one engine "
                "per backend; random weights, so Moira's read fractions are imposed (the "
                "paper's measured reads, spread per (layer, KV head) with CV ≈ 0.7), not chosen "
                "by the coverage rule."
                + (f" Plot: `{repo_path(png)}`." if png else ""))
        write_section(args.readme, args.section, text + "\n\n" + note)


if __name__ == "__main__":
    main()
