"""A table and a plot from ``serve_bench.py`` runs (issue 5, item 3): output throughput and
median TPOT per arm, and each arm's throughput against dense FA3's on the same (set,
concurrency, prompts, output tokens).

    python benchmarks/serve_report.py benchmarks/results/serve-2026-11-30-s8 [--readme benchmarks/RESULTS.md]
    python benchmarks/serve_report.py FOLDER FOLDER ... --plot PATH.png [--readme ...]

A folder holds ``serve-<arm>-<set>-<concurrency>[-<anything>].json`` (``serve_bench.sh``).
Slices of one set run apart (``serve_bench.py --offset K --limit N``, same arm, concurrency and
output length), in one folder or several, are pooled into one row: requests and tokens added,
throughput = all tokens / all slices' wall time, medians over all requests' records. Writes
``<folder>.png`` (with several folders, ``--plot``) and, with ``--readme``, that file's
``serve`` section (benchmarks/RESULTS.md; ``--section`` another).
"""

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from readme_section import repo_path, write_section  # noqa: E402

ARMS = {"dense": "dense FA3", "flashinfer": "dense FlashInfer", "moira": "Moira"}


def runs_in(folders):
    """Every ``serve-*.json`` run of ``folders``, in name order within each folder."""
    for folder in folders:
        for name in sorted(os.listdir(folder)):
            if name.startswith("serve-") and name.endswith(".json"):
                with open(os.path.join(folder, name)) as f:
                    yield json.load(f)


def load(folders):
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
    return ARMS.get(run["label"], run["label"]) + (f" ({setting})" if setting else "")


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
    more than 2% slower than dense (issue 5's bound at batch 1)."""
    lines = []
    for (name, concurrency), split in changes.items():
        for kind, values in split.items():
            if values:
                lines.append(f"set {name}, concurrency {concurrency}, {kind}: {len(values)} "
                             f"requests, Moira's TPOT {statistics.mean(values):+.2f}% on average "
                             f"({min(values):+.1f} to {max(values):+.1f}%), "
                             f"{sum(value > 2 for value in values)} over +2%")
    return lines


def table(runs):
    """Rows grouped by workload (set, concurrency, prompts, output tokens), dense FA3 first."""
    def workload(run):
        return (run["set"], run["concurrency"], run["requests"], run["output_tokens"],
                run.get("offset", 0))

    order = list(ARMS)
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


def plot(runs, path):
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


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("folders", nargs="+")
    parser.add_argument("--plot", help="the plot's path (default: <folder>.png, one folder)")
    parser.add_argument("--readme")
    parser.add_argument("--section", default="serve", help="the generated section to replace")
    parser.add_argument("--from-offset", type=int, default=0,
                        help="per-request lines: only the slices from this prompt on")
    args = parser.parse_args()
    if args.plot is None and len(args.folders) > 1:
        parser.error("several folders: name the plot's path with --plot")
    runs = load(args.folders)
    text = table(runs)
    print(text)
    request_lines = per_request_lines(per_request_changes(args.folders,
                                                          from_offset=args.from_offset))
    for line in request_lines:
        print(line)
    # abspath of the folder first: "." names the folder itself, not ".png"
    plot_path = (os.path.abspath(args.plot) if args.plot
                 else os.path.abspath(args.folders[0]) + ".png")
    plot(runs, plot_path)
    if args.readme:
        sources = ", ".join(f"`{repo_path(folder)}/`" for folder in args.folders)
        gpus = sorted({run.get("gpu", "GPU and versions: NOTE.md beside the JSONs") for run in runs})
        dates = days(runs)
        note = (f"Generated by `benchmarks/serve_report.py` from {sources} ({', '.join(gpus)}; "
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


if __name__ == "__main__":
    main()
