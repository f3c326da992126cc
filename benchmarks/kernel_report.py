"""Turn ``bench_kernels.py``'s JSON into a Figure-4-style PNG (time per layer vs. CV of the
row lengths, one panel per shape) and markdown tables; ``--readme`` writes the tables into that
file (benchmarks/RESULTS.md) between ``<!-- kernels:begin -->`` and ``<!-- kernels:end -->``.

    python benchmarks/kernel_report.py benchmarks/results/kernels-<date>.json [--readme benchmarks/RESULTS.md]
"""

import argparse
import json
import os
import re
import statistics
from collections import defaultdict

from bench_kernels import CHECK_TOLERANCE, config_fields
from readme_section import write_section

ARMS = [("moira", "Moira"), ("fa3_varlen", "FA3 varlen"), ("pad", "pad"), ("pow2", "pow2"),
        ("flashinfer", "FlashInfer"), ("flex", "FlexAttention")]


def shape_label(name):
    """bench_kernels' shape name as the tables print it: "8k32" -> "8k x32" (tune_kernels'
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
    """One line on the run's output checks (``bench_kernels.check_outputs``): how many arm
    outputs matched Moira's, and any that did not or could not be run."""
    checks = report.get("checks", [])
    if not checks:
        return "Output checks: none in this run."
    # files before session 24 record the difference only: judged by the same tolerance
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


def tables(report):
    table = collect(report)
    lines = [
        f"One decode layer, Llama-3.1-8B geometry (8 KV heads, G = 4, head_dim 128, bf16, "
        f"64-token pages), {report['gpu']}, {report['date'][:10]}; "
        + ", ".join(f"{k} {v}" for k, v in report["versions"].items())
        + f". µs per layer, median of CUDA-graph replays, {report['mean_fraction']:.0%} of each "
        "row's pages on average at random positions (`real`: 8 layers of 9–68%, CV 0.7, "
        "averaged). `rel. BW` = Moira's bytes/time over dense FA3's in the same run.",
        "",
        "| shape | spread | pages read | " + " | ".join(label for _, label in ARMS)
        + " | FlashInfer plan (host) | dense FA3 | Moira rel. BW |",
        "|---|---|---|" + "---|" * len(ARMS) + "---|---|---|",
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
                + " | ".join(fmt(arms.get(arm)) for arm, _ in ARMS)
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


def plot(report, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = collect(report)
    shapes = list(table)
    fig, axes = plt.subplots(1, len(shapes), figsize=(4.2 * len(shapes), 3.6), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        spreads = table[shape]
        cvs = sorted(float(s[2:]) for s in spreads if s and s.startswith("cv"))
        for arm, label in ARMS:
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


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("result")
    parser.add_argument("--readme")
    parser.add_argument("--section", default="kernels", help="the generated section to replace")
    args = parser.parse_args()
    with open(args.result) as f:
        report = json.load(f)
    markdown = tables(report) + "\n\n" + output_checks(report)
    png = os.path.splitext(args.result)[0] + ".png"
    plot(report, png)
    print(markdown)
    variants = variant_table(report)  # printed for a tuning run, not part of the README's table
    if variants:
        print("\nMoira's kernels under other configurations (Attend + Merge):\n\n" + variants)
    print(f"wrote {png}")
    if args.readme:
        image = os.path.relpath(png, os.path.dirname(os.path.abspath(args.readme)))
        write_section(args.readme, args.section, f"{markdown}\n\n![kernel times]({image})")

if __name__ == "__main__":
    main()
