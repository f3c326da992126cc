"""Tables (markdown) and plots (PNG) from `moira eval` result files.

    python benchmarks/accuracy_report.py benchmarks/results/accuracy-*.json [--readme benchmarks/RESULTS.md]
    PYTHONPATH=. python benchmarks/accuracy_report.py --merge-into merged.json part1.json ...

``--merge-into`` first joins runs of the same model and context that measured different tasks
(their rows, re-summarized) into one file, keeping each part's command and time.

Writes `<result>-kl.png` (token KL against pages read) and, where the budget analysis ran,
`<result>-budget.png` (mean oracle coverage set per layer and KV head) beside each file, prints
the markdown, and with --readme replaces the text between `<!-- accuracy:begin -->` and
`<!-- accuracy:end -->` in that file.
"""

import argparse
import gzip
import json
import os
import re

from readme_section import write_section


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


def markdown(path, result):
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


def plots(path, result):
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


def merge(paths, destination):
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
    # a part that is itself a merge brings its own parts (a file grows over sessions)
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


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("results", nargs="+")
    parser.add_argument("--readme")
    parser.add_argument("--merge-into", help="join the result files into this one first")
    args = parser.parse_args()
    if args.merge_into:
        args.results = [merge(args.results, args.merge_into)]
    sections = []
    for path in args.results:
        with _open(path) as f:
            result = json.load(f)
        plots(path, result)
        sections.append(markdown(path, result))
    text = "\n".join(sections)
    print(text)
    if args.readme:
        write_section(args.readme, "accuracy", text)

if __name__ == "__main__":
    main()
