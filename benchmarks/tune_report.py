"""A plot of a ``tune_kernels.py`` JSON: per shape, every variant of one kind (µs per layer),
each as a ratio to the shape's ``default`` variant (the mean of ``default`` and ``default
again`` where the sweep timed it twice).

    python benchmarks/tune_report.py benchmarks/results/tune-2026-12-01-s25-ahead.json \
        [--kind estimate]

Writes ``<json without .json>.png`` (``...-<kind>.png`` for a kind other than estimate, so
one sweep's kinds keep their own plots) and prints a markdown table.
"""

import argparse
import json
import statistics


def table(results, kind):
    """``{variant: {shape: µs}}`` of one kind, in the order the sweep ran them."""
    by_variant = {}
    for row in results:
        if row["kind"] == kind:
            by_variant.setdefault(row["variant"], {})[row["shape"]] = row["us"]
    return by_variant


def baseline(by_variant):
    """``{shape: µs}``: the mean of the default's runs (``default`` and ``default again``)."""
    runs = [by_variant[name] for name in ("default", "default again") if name in by_variant]
    if not runs:
        raise SystemExit("no 'default' variant to compare with")
    return {shape: statistics.mean(run[shape] for run in runs if shape in run)
            for shape in runs[0]}


def markdown(by_variant, base):
    shapes = list(base)
    lines = ["| variant | " + " | ".join(shapes) + " |", "|---" * (len(shapes) + 1) + "|"]
    for variant, by_shape in by_variant.items():
        cells = [f"{by_shape[s]:.1f} ({by_shape[s] / base[s] - 1:+.0%})" if s in by_shape
                 else "–" for s in shapes]
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("result")
    parser.add_argument("--kind", default="estimate")
    args = parser.parse_args()
    with open(args.result) as f:
        run = json.load(f)
    by_variant = table(run["results"], args.kind)
    base = baseline(by_variant)
    print(markdown(by_variant, base))

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(base)
    fig, axes = plt.subplots(1, len(shapes), figsize=(4 * len(shapes), 0.35 * len(by_variant) + 2),
                             sharey=True, squeeze=False)
    names = list(by_variant)
    for ax, shape in zip(axes[0], shapes):
        ratios = [by_variant[name].get(shape, float("nan")) / base[shape] for name in names]
        ax.barh(range(len(names)), ratios, color=["grey" if name.startswith("default") else
                                                  "tab:blue" for name in names])
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.set_title(f"{shape}: default {base[shape]:.1f} µs")
        ax.set_xlabel(f"{args.kind} time / default's")
    axes[0][0].set_yticks(range(len(names)), names, fontsize=8)
    axes[0][0].invert_yaxis()
    fig.suptitle(f"{run.get('gpu', '')}, {run.get('date', '')}: {run.get('command', '')}",
                 fontsize=8)
    fig.tight_layout()
    path = args.result[:-len(".json")] + ("" if args.kind == "estimate" else f"-{args.kind}") \
        + ".png"
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
