"""A plot of a ``tune_kernels.py`` JSON: per shape, every variant of one kind (µs per layer),
each as a ratio to the shape's ``default`` variant (the mean of ``default`` and ``default
again`` where the sweep timed it twice). Where a kind's variants are named by mode first
(Select's ``coverage ...``, ``top22% ...``), each mode has its own ``<mode> default``.

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


def markdown(by_variant, bases):
    shapes = shapes_of(bases)
    lines = ["| variant | " + " | ".join(shapes) + " |", "|---" * (len(shapes) + 1) + "|"]
    for variant, by_shape in by_variant.items():
        base = base_of(variant, bases) or {}
        cells = [(f"{by_shape[s]:.1f} ({by_shape[s] / base[s] - 1:+.0%})" if s in base
                  else f"{by_shape[s]:.1f}") if s in by_shape else "–" for s in shapes]
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("result")
    parser.add_argument("--kind", default="estimate")
    parser.add_argument("--baseline", action="append", default=None,
                        help="a variant name's ending that marks its mode's baseline "
                             "(repeatable; default: 'default')")
    args = parser.parse_args()
    with open(args.result) as f:
        run = json.load(f)
    by_variant = table(run["results"], args.kind)
    words = args.baseline or ["default"]
    bases = baselines(by_variant, words)
    print(markdown(by_variant, bases))

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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


if __name__ == "__main__":
    main()
