"""A table from ``vllm_step_profile.py`` runs (issue 5, item 2): one decode step by kernel class,
dense FA3 and Moira side by side, with the paper's Table 4.

    python benchmarks/step_report.py benchmarks/results/step-profile-2026-11-30-s7 [MORE] \
        [--readme benchmarks/RESULTS.md] [--plot PATH.png]

A folder holds ``step-dense.json`` and/or ``step-moira.json``; with several folders (e.g. a
later session that re-profiled Moira only) each row names its folder's session (``-sN``). ms per step: GPU time of each
kernel class summed over the traced run and divided by its steps; "idle" is the time the GPU
waited between kernels in the traced span (for the host), "wall" the traced run's wall time per
step (the profiler's overhead included).
"""

import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from readme_section import repo_path, write_section  # noqa: E402

CLASSES = ["Attend", "Estimate", "Select", "Merge", "FA3", "GEMM", "other"]
MOIRA = ("Estimate", "Select", "Attend", "Merge")
# paper Table 4 (Nsight Systems, Llama-3.1-8B): dense step, FA3; Moira step, att, est, sel, mrg,
# GEMM
PAPER = {"8k32": dict(dense=12.72, FA3=8.16, moira=9.38, Attend=4.02, Estimate=0.38,
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
    if not gaps or not any(name in gaps for name in MOIRA):
        return "–"
    return f"{sum(gaps.get(name, 0.0) for name in MOIRA):.3f}"


def table(runs):
    """``runs``: ``[(label, backend, run)]`` in folder order; one row per run under each shape,
    then the paper's rows."""
    lines = ["| shape | backend | " + " | ".join(CLASSES)
             + " | kernels | waits before Moira's kernels | GPU idle | wall |",
             "|---|---|" + "---|" * (len(CLASSES) + 4)]
    steps = list(profiled_steps(runs))
    for shape in dict.fromkeys(shape for shape, _, _ in steps):
        for _, backend, row in (step for step in steps if step[0] == shape):
            cells = [f"{row['per_step_ms'][name]:.2f}" if name in row["per_step_ms"]
                     else "–" for name in CLASSES]
            lines.append(f"| {shape} | {backend} | "
                         + " | ".join(cells) + f" | **{row['total_ms']:.2f}** | "
                         f"{moira_waits(row)} | "
                         f"{row.get('gpu_idle_ms_per_step', float('nan')):.2f} | "
                         f"{row.get('wall_ms_per_step', float('nan')):.2f} |")
        paper = PAPER.get(shape)
        if paper:
            for label, names, step in (("paper, dense", {"FA3"}, paper["dense"]),
                                       ("paper, Moira", set(CLASSES) - {"FA3"}, paper["moira"])):
                cells = [f"{paper[name]:.2f}" if name in names and name in paper else "–"
                         for name in CLASSES]
                lines.append(f"| {shape} | {label} | " + " | ".join(cells)
                             + f" | {step:.2f} (step) | – | – | – |")
    return "\n".join(lines)


def plot(runs, path):
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
    for name in CLASSES:
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
    ax.legend(fontsize=7, ncol=len(CLASSES), loc="lower center", bbox_to_anchor=(0.5, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def load(folders):
    """``[(label, backend, run)]``: label is the folder's session tag (its name's ``-sN``
    suffix, or the name) when there are several folders, else empty."""
    runs = []
    for folder in folders:
        name = os.path.basename(os.path.normpath(folder))
        tag = re.search(r"-(s\d+)$", name)
        label = (tag.group(1) if tag else name) if len(folders) > 1 else ""
        for backend in ("dense", "moira"):
            path = os.path.join(folder, f"step-{backend}.json")
            if os.path.exists(path):
                with open(path) as f:
                    runs.append((label, backend, json.load(f)))
    return runs


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("folders", nargs="+")
    parser.add_argument("--readme")
    parser.add_argument("--section", default="step-profile",
                        help="the --readme file's section to write")
    parser.add_argument("--plot", metavar="PATH", help="also draw the steps as stacked bars")
    args = parser.parse_args()
    runs = load(args.folders)
    text = table(runs)
    print(text)
    if args.plot:
        plot(runs, args.plot)
    if args.readme:
        sources = ", ".join(f"`{repo_path(folder)}/`" for folder in args.folders)
        dates = ", ".join(sorted({run["date"][:10] for _, _, run in runs}))
        torch_versions = ", ".join(sorted({run["versions"]["torch"] for _, _, run in runs}))
        note = (f"Generated by `benchmarks/step_report.py` from {sources} ({runs[0][2]['gpu']}, "
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


if __name__ == "__main__":
    main()
