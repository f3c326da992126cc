"""Replace the generated part of a markdown file (docs/results.md, the README): the text
between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->`` (shared by the report scripts).

Run as a script it writes the README's headline table from the committed results
(``.ci/readme-tables`` gives the folders)::

    python3 benchmarks/readme_section.py headline --tpot PAIR... --tpot-099 PAIR... \\
        --serve-a FOLDER... --serve-b FOLDER... --accuracy SUMMARY.json \\
        --readme README.md --section headline
"""

import argparse
import json
import os
import re
import statistics
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# the paper's serving gain on set B at concurrency 8 (set A at 16: none given)
PAPER_SERVE = {"B": "+42%"}
# serve_bench.py's prompt sets: their prompts' lengths
SET_TOKENS = {"A": "4k–64k", "B": "66k–126k"}


def repo_path(path):
    """``path`` as the generated notes cite it: from the repository root, wherever the file
    they are written into lives."""
    return os.path.relpath(os.path.abspath(path), REPO)


def write_section(readme_path, name, text):
    with open(readme_path) as f:
        readme = f.read()
    pattern = rf"(<!-- {name}:begin -->\n).*?(<!-- {name}:end -->)"
    # a function, not a replacement string: the tables may hold backslashes
    readme, found = re.subn(pattern, lambda m: m.group(1) + text + "\n" + m.group(2), readme,
                            flags=re.S)
    if not found:
        raise SystemExit(f"{readme_path} has no <!-- {name}:begin/end --> markers")
    with open(readme_path, "w") as f:
        f.write(readme)


def mean_speedups(folders, gamma):
    """Per shape (in tpot_report's order), the mean over interleaved pairs of dense FA3's TPOT
    over Moira's at ``gamma``'s reads, and the paper's speedup: what ``tpot_report.py --pairs``
    prints in its ``mean`` and ``paper`` columns."""
    import tpot_report

    speedups, paper, hosts = {}, {}, set()
    for folder in folders:
        runs = tpot_report.load([folder])
        hosts |= {(run["gpu"], run["versions"]["vllm"]) for run in runs.values()}
        for row in tpot_report.table(runs)[1]:
            cell = row[f"g{gamma}"]
            if cell["speedup"]:
                speedups.setdefault(row["shape"], []).append(cell["speedup"])
                paper[row["shape"]] = cell["paper"]
    shapes = sorted(speedups, key=tpot_report.SHAPES.index)
    return (shapes, [statistics.mean(speedups[s]) for s in shapes], [paper[s] for s in shapes],
            hosts)


def serving_gain(folders):
    """Moira's output tokens/s over dense FA3's, the slices of ``folders`` pooled, and the
    workload's set and concurrency."""
    import serve_report

    runs = [run for run in serve_report.load(folders) if not run.get("moira_environment")]
    by_arm = {run["label"]: run for run in runs}
    moira, dense = by_arm["moira"], by_arm["dense"]
    return moira["output_tokens_per_s"] / dense["output_tokens_per_s"] - 1, moira


def headline(args):
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


def main():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    head = sub.add_parser("headline", help="the README's headline table")
    head.add_argument("--tpot", nargs="+", required=True,
                      help="interleaved pair folders, Moira at γ = 0.98's reads")
    head.add_argument("--tpot-099", nargs="+", required=True,
                      help="interleaved pair folders, Moira at γ = 0.99's reads")
    head.add_argument("--serve-a", nargs="+", required=True, help="serving folders, set A")
    head.add_argument("--serve-b", nargs="+", required=True, help="serving folders, set B")
    head.add_argument("--accuracy", required=True,
                      help="accuracy_vllm.py's summary.json (its longest context is shown)")
    head.add_argument("--readme")
    head.add_argument("--section", default="headline")
    args = parser.parse_args()
    headline(args)


if __name__ == "__main__":
    main()
