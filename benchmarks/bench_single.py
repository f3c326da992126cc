"""Where a single request's decode step goes (issue 5, item 4): Moira's kernels one by one
against dense FA3, batch 1, Llama-3.1-8B geometry (8 KV heads, G = 4, head_dim 128, bf16).

A decode step of one request runs 32 layers back to back, each on its own KV cache, so a
layer's K/V come from HBM, not from L2 (a 2k-token layer is 8 MB; 32 of them are 256 MB). Every
arm is therefore timed over 32 layers captured in one CUDA graph
(``triton.testing.do_bench_cudagraph``, median) and reported per layer. Estimate's own input
is smaller: the 32 layers' summaries are 4.5 MB at 2k and 17 MB at 8k, plus 8 MB of the exact
pages' keys, so up to 8k the ``estimate`` arm reads mostly from the L2; the ``+gemm`` arms
(``--gemm``) evict it between layers, as an engine's GEMMs do. Times only, no bytes: the
kernel suite (``bench_kernels.py``) states bandwidths.

- ``fa3_dense``: vLLM's FA3 call in its CUDA graphs (``num_splits`` 32, scheduler metadata
  built beforehand), every page.
- The request holds ``context - 1`` tokens, so its current page is partial: the common step.
  (Files before commit 880c8a2 also timed ``summarize``, the launch that then followed each
  step's K/V write; Estimate now summarizes a page the step fills, once in 64 steps.)
- ``estimate``, ``select`` (fraction mode at the paper's read fraction for the context),
  ``attend_merge`` (those lists), ``step`` (the four, ``sparse_decode``).
- ``step_full_rows``: ``sparse_decode`` with ``dense_below_pages`` covering the row (what the
  plugin's ``dense_below_tokens`` does to a short request: every page read, Estimate and
  Select skip their work).
- ``*_c2``: the same with the chunk floor at 2 pages for one request (``floor_rows=96``)
  instead of 6 (the default ``floor_rows=32``); ``step_floor_off``: C = 24 (session 4).
- ``*_pdl``: the same with programmatic dependent launch (``MoiraConfig.programmatic_launch``);
  here every kernel of the graph is chained, across layers too, which vLLM's plainly launched
  GEMMs between layers would not allow: an upper bound on what it saves there.
  ``*_pdl_no_attend`` chains Estimate, Select and Merge only (Attend launched plainly),
  ``*_pdl_est_sel`` Estimate and Select only (``moira.kernels.launch.CHAINED``).
- (Files of session 12 also time ``*_fsel``, Select run in Estimate's launch, ``*_fmerge``,
  Merge folded into Attend, and ``*_fboth``, both: options removed since, after measuring
  slower or too little faster; benchmarks/RESULTS.md.)
- Every arm runs ``MoiraConfig``'s defaults but the fields it names; from commit d7033db
  that includes the short-row floor (``step_programs`` 128; 256 from session 15), so the
  ``step*`` arms of later files are not those of earlier ones at batches 1-4 (the
  ``--split-sweep`` arms set it).

- ``--width PAGES[,PAGES...]``: the block table's pages per row (default 1030, a 66k-token
  engine; a vLLM engine admitting 131,072 tokens, as ``serve_bench.sh``'s, has 2,048;
  ``vllm_tpot.py``'s 2k1,8k1,16k1 engine, 16,704 tokens, 261). Attend's J and Estimate's grid follow the width, so
  programs that exit at once grow with it. Several widths time each shape at each in turn,
  in one run (each result row gives its ``width``).
- ``--spread``: per-(layer, KV head) read fractions as the plugin imposes them
  (``moira.synthetic.layer_head_fractions``: layer means 9-68%, CV 0.7 across heads) instead of
  one fraction for every head, so some rows list far more pages than the mean (the
  ``attend_merge`` arm reuses the last layer's lists in every layer; the step arms select
  their own).
- ``--programs-sweep``: the step as the plugin runs it (rows of at most ``dense_below_tokens``
  / B tokens read in full) at each ``PROGRAMS_SWEEP`` N_T (``MoiraConfig.min_programs``, which
  sets J = max(N_J, ceil(N_T / rows)) below the width's cap; ``max_chunks_per_row`` lifted):
  ``step_p<N_T>``;
  ``--programs-report`` tables them. (Files of session 19 also time ``step_launch<N>``:
  Attend launching ceil(N / rows) programs per row, each taking every P-th chunk, an option
  timed slower there and removed.)
- ``--batches 1,2,4``: the same for B requests of that context each (own pages, one graph
  of 32 layers per step; combinations over ~80 GB of caches are skipped), to see where a split
  chosen at batch 1 stands at small batches.
- ``--gemm``: every arm is timed twice, as above and as ``<arm>+gemm`` with the MLP's gate/up
  projection after each layer (``[B, 4096] @ [4096, 28672]`` bf16, own weights per layer, as
  in vLLM's decode step two kernels after attention), plus ``gemm_only``. In vLLM that GEMM
  takes ~4% longer per step after Moira's step than after FA3's at batch 1-2, its slowest
  tenth of calls up to 9% (sessions 20-21), which kernels timed back to back cannot show;
  ``gemm_cost`` (``<arm>+gemm`` minus ``<arm>``) against ``gemm_only`` shows whether this
  bench reproduces it. It also charges the GEMM with what the arm loses when the GEMM evicts
  the arm's inputs from L2 between layers (session 22: Select alone +5.3 µs at batch 2).
- ``--gemm-profile`` (with ``--gemm``) also traces each ``<arm>+gemm`` graph with the PyTorch
  profiler and records the GEMM kernels' own per-call durations (``gemm_calls``: p10 /
  median / p90, µs), as ``vllm_step_profile.py`` does in the engine.
- ``--gemm-probes`` (with ``--gemm``): arms that are no attention at all, to find what slows
  the GEMM after Moira's kernels (session 23: after Attend + Merge, and at batch 2 after
  Estimate, 1-5 µs per call; never after Select; 0.5 after FA3): ``probe_write_<N>m`` writes
  N MiB (dirty L2 lines for the GEMM to write back), ``probe_read_<N>m`` reads N MiB,
  ``probe_gather`` reads the layer's K/V pages in the table's random order (page-scattered
  reads, as Attend's) and writes them out, 2 x 16 MiB per request at 8k, so it measures those
  writes too (session 24: as slow as ``probe_write_32m``; results/single-2026-12-01-s24-probes).

    PYTHONPATH=/tmp/site:. python3 benchmarks/bench_single.py [--contexts 2048,8192,32768]
    python3 benchmarks/bench_single.py --plot benchmarks/results/single-<date>.json  # PNG
"""

import argparse
import json
import math
import os
import sys
import time

import torch
import triton

import moira
from moira.integrations.vllm.settings import MoiraSettings, full_read_pages
from moira.kernels import launch
from moira.synthetic import layer_head_fractions
from bench_kernels import patched

KV_HEADS, GROUP, HEAD_DIM, PAGE, LAYERS = 8, 4, 128, 64, 32
HIDDEN, GATE_UP = 4096, 2 * 14336  # Llama-3.1-8B's MLP input and gate/up widths (--gemm)
WIDTH = 1030  # block-table pages of a 66k-token engine (vllm_tpot.py's single-request shapes)
# --split-sweep: Attend's split at batch 1 (8 rows), (floor_rows, J): chunk floors of 6, 4, 3
# and 2 pages; J the default (before session 20 min_programs / rows capped at ceil(width /
# floor): 172, 258, 344, 512 at width 1030; since, at most max_chunks_per_row, 128), 32 or
# 16. J binds only where ceil(pages / J) exceeds the floor (not at 2k, where an arm's J
# variants repeat it: a noise estimate; at 8k the J-16 arms all run 16 chunks of 8 pages);
# all with step_programs 0 (Eq. 4 alone, the split before session 14); then the short-row
# floor (MoiraConfig.step_programs T, session 14) at the default floor_rows, with J the
# default or 32 (min_programs 1: no programs launched only to exit, which J's default costs
# a short row; never slower than the default J in session 14's sweep without T):
# (floor_rows, J, T)
SPLIT_SWEEP = [(floor_rows, chunks, 0) for floor_rows in (32, 48, 64, 96)
               for chunks in (None, 32, 16)] + [(32, chunks, programs) for chunks in (None, 32)
                                                for programs in (128, 256)]
# --programs-sweep: N_T (MoiraConfig.min_programs; 4096 the default) without the ceiling on J
# (programs_config); at 8 rows (batch 1) and a 2,048-page table J = 342 / 256 / 128 / 64 / 32,
# at 32 rows (131k x 4) 86 / 64 / 32 / 32 / 32. The default since session 20 (J at most
# max_chunks_per_row, 128) is N_T = 1024's J at 8 rows and N_T = 4096's from 32 rows up
PROGRAMS_SWEEP = (4096, 2048, 1024, 512, 256)


def programs_config(min_programs):
    """The ``--programs-sweep`` arm of N_T ``min_programs``: J from N_T alone (its ceiling,
    ``max_chunks_per_row``, lifted to N_T, where it never binds)."""
    return moira.MoiraConfig(min_programs=min_programs, max_chunks_per_row=min_programs)


# the paper's mean read fraction at gamma 0.98 (Llama-3.1-8B, Table 3), clamped below 8k
READS = {2048: 0.42, 8192: 0.42, 16384: 0.37, 32768: 0.31, 65536: 0.16, 131072: 0.15}


def gemm_calls(fn, replays=10):
    """Per-call statistics of the GEMM kernels when ``fn`` runs as one CUDA graph (CUPTI
    reports each kernel of a replayed graph): the GEMM's own time after an arm."""
    from torch.profiler import ProfilerActivity, profile
    from vllm_step_profile import call_stats, kernel_class

    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as trace:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    return call_stats([event.device_time_total for event in trace.events()
                       if event.device_type.name == "CUDA"
                       and kernel_class(event.name) == "GEMM"])


def bench(fn):
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3


def cache_bytes(context, batch):
    """K and V of ``LAYERS`` layers of ``batch`` requests of ``context`` tokens."""
    return 2 * LAYERS * batch * context * KV_HEADS * HEAD_DIM * 2


class Layers:
    """``LAYERS`` layers of ``batch`` requests: own caches, summaries, queries; a shared
    workspace. Each request's pages sit at random places in its layer's cache."""

    def __init__(self, context, batch=1, width=WIDTH, spread=False, gemm=False):
        pages = context // PAGE
        self.width = max(width, pages + 2)
        self.context, self.batch = context, batch
        dt = torch.bfloat16
        self.caches = []
        for _ in range(LAYERS):
            keys = torch.randn(batch * pages + 2, PAGE, KV_HEADS, HEAD_DIM, device="cuda",
                               dtype=dt)
            values = torch.randn_like(keys)
            self.caches.append((keys, values))
        table = torch.zeros(batch, self.width, dtype=torch.int32, device="cuda")
        table[:, :pages] = torch.randperm(batch * pages, device="cuda").int().view(batch, pages)
        self.table = table
        self.seq_lens = torch.full((batch,), context - 1, dtype=torch.int32, device="cuda")
        self.queries = [torch.randn(batch, KV_HEADS * GROUP, HEAD_DIM, device="cuda", dtype=dt)
                        for _ in range(LAYERS)]
        self.summaries = [moira.summarize(k, table, self.seq_lens) for k, _ in self.caches]
        self.out = torch.empty_like(self.queries[0])
        fraction = READS[min(READS, key=lambda c: abs(math.log(c / context)))]
        # per layer: [KV_HEADS] fractions (one value, or the plugin's spread)
        if spread:
            self.fractions = list(layer_head_fractions(fraction, LAYERS, KV_HEADS).cuda())
        else:
            self.fractions = [torch.full((KV_HEADS,), fraction, device="cuda")] * LAYERS
        self.fraction = fraction
        self.scale = 1 / math.sqrt(HEAD_DIM)
        # --gemm: each layer's gate/up weights (235 MB, from HBM as in the engine), stored
        # [out, in] as vLLM's linear layers hold them
        self.weights = [torch.randn(GATE_UP, HIDDEN, device="cuda", dtype=dt) * 0.02
                        for _ in range(LAYERS)] if gemm else None
        self.hidden = torch.randn(batch, HIDDEN, device="cuda", dtype=dt)
        self.gate_up = torch.empty(batch, GATE_UP, device="cuda", dtype=dt)

    def workspace(self, config=None):
        return moira.DecodeWorkspace(self.batch, self.width, KV_HEADS * GROUP, KV_HEADS,
                                     HEAD_DIM, device="cuda", config=config)

    def each(self, layer_fn, gemm=False):
        def run():
            for layer in range(LAYERS):
                layer_fn(layer)
                if gemm:
                    torch.matmul(self.hidden, self.weights[layer].t(), out=self.gate_up)
        return run


def plot(path):
    """Per-layer time against context: FA3 (runs with vLLM), Moira's step (its kernels stacked,
    with the summarize launch of files that timed one) and the step with the row read in full;
    ``<path>.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(path) as f:
        report = json.load(f)
    rows = [r for r in report["results"] if "attend_merge" in r["us_per_layer"]]
    x = range(len(rows))
    profiled = [r for r in rows if r.get("gemm_calls")]  # --gemm-profile: a second panel
    fig, axes = plt.subplots(1, 2 if profiled else 1, figsize=(16 if profiled else 8, 4),
                             squeeze=False)
    ax = axes[0][0]
    if any("fa3_dense" in r["us_per_layer"] for r in rows):  # runs without vLLM have no FA3
        ax.bar([i - 0.27 for i in x], [r["us_per_layer"].get("fa3_dense", 0.0) for r in rows],
               0.27, color="0.6", label="dense FA3")
    bottom = [0.0] * len(rows)
    for part, color in (("summarize", "tab:gray"), ("estimate", "tab:green"),
                        ("select", "tab:orange"), ("attend_merge", "tab:blue")):
        values = [r["us_per_layer"].get(part, 0.0) for r in rows]
        ax.bar(x, values, 0.27, bottom=bottom, color=color, label=f"Moira: {part}")
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.bar([i + 0.27 for i in x], [r["us_per_layer"].get("summarize", 0.0)
                                   + r["us_per_layer"].get("step_full_rows", 0.0) for r in rows],
           0.27, color="tab:purple", label="Moira, row read in full")
    # name each bar's table width when a shape was timed at several
    widths = len({(r["context"], r["batch"]) for r in rows}) < len(rows)
    batches = len({r.get("batch", 1) for r in rows}) > 1
    ax.set_xticks(list(x), [f"{r['context'] // 1024}k"
                            + (f" × {r.get('batch', 1)}" if batches else "")
                            + (f", {r['width']} pages" if widths else "")
                            + f"\n(reads {r['read_fraction']:.2f})" for r in rows])
    ax.set_ylabel("µs per layer (32 layers per graph)")
    ax.set_title(f"one request, Llama-3.1-8B geometry, {report['gpu']}, {report['date']}",
                 fontsize=9)
    ax.legend(fontsize=7)
    if profiled:
        gemm_panel(axes[0][1], profiled)
    fig.tight_layout()
    fig.savefig(os.path.splitext(path)[0] + ".png", dpi=110)
    plt.close(fig)


def gemm_panel(ax, rows):
    """The gate/up GEMM's own time per call after each arm (median, p10-p90 whiskers)."""
    import matplotlib

    arms = [arm for arm in rows[0]["gemm_calls"] if all(arm in r["gemm_calls"] for r in rows)]
    width = 0.8 / len(arms)
    colors = matplotlib.colormaps["tab20"].colors
    for index, arm in enumerate(arms):
        calls = [r["gemm_calls"][arm] for r in rows]
        ax.bar([i + (index - (len(arms) - 1) / 2) * width for i in range(len(rows))],
               [c["median_us"] for c in calls], width, label=arm.removesuffix("+gemm"),
               color=colors[index % len(colors)],
               yerr=[[c["median_us"] - c["p10_us"] for c in calls],
                     [c["p90_us"] - c["median_us"] for c in calls]], capsize=1)
    low = min(r["gemm_calls"][arm]["p10_us"] for r in rows for arm in arms)
    ax.set_ylim(low * 0.95, None)  # a 5% difference must show
    ax.set_xticks(range(len(rows)), [f"{r['context'] // 1024}k × {r.get('batch', 1)}"
                                     for r in rows])
    ax.set_ylabel("GEMM µs per call (median; p10-p90)")
    ax.set_title("the gate/up GEMM after each arm (profiler, the replayed graph)", fontsize=9)
    ax.legend(fontsize=6, ncol=2)


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
                        key = (tuple(key) + (0,))[:3]  # before session 14: no T, i.e. 0
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
    default_key = (moira.MoiraConfig().floor_rows, None, 0)  # Eq. 4 as before session 14
    default = mean.get(default_key, {})

    def gains(m):
        return any(c in default and default[c] - m[c] >= gain for c in ((1, 2048), (1, 8192)))

    chosen = [key for key, m in mean.items()
              if all(c in m and m[c] <= best[c] + margin for c in contexts) and gains(m)]
    chosen.sort(key=lambda key: sum(mean[key].values()))
    verdict = (f"rule met by floor_rows, J = {short_key(chosen[0])}" if chosen else
               "rule not met: keep Eq. 4's default split")
    # session 13's rule for changing the default (the first is stricter: near the best
    # everywhere): never more than `margin` slower than the default, `gain` faster at batch 1
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
    no ceiling: the default before session 20); ``launch N`` columns (session 19's files):
    that J with Attend launching about N programs, each taking every P-th chunk (an option
    since removed)."""
    default = (moira.MoiraConfig().min_programs, 0)
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


def gemm_costs(times):
    """``--gemm``: per arm, what the GEMM after each layer adds (``<arm>+gemm`` minus
    ``<arm>``, µs per layer), beside ``gemm_only`` (the GEMM after nothing); an arm after
    which the GEMM runs slower than alone shows a larger cost."""
    costs = {name: round(times[name + "+gemm"] - times[name], 2) for name in times
             if name + "+gemm" in times}
    if "gemm_only" in times:
        costs["gemm_only"] = times["gemm_only"]
    return costs


def page_widths(text):
    """``--width``: comma-separated positive page counts."""
    try:
        widths = [int(width) for width in text.split(",")]
    except ValueError:
        widths = []
    if not widths or min(widths) < 1:
        raise argparse.ArgumentTypeError(f"expected pages per row, e.g. 2048 or 261,2048; got "
                                          f"{text!r}")
    return widths


def timed_shapes(contexts, batches, widths):
    """(context, batch, table width) in timing order, each width at least the row's pages and
    two more (as ``Layers`` builds the table), so a shape whose rows outgrow several of the
    requested widths is timed once at the width it gets."""
    batches, widths = list(batches), list(widths)
    return list(dict.fromkeys((context, batch, max(width, context // PAGE + 2))
                              for context in contexts for batch in batches for width in widths))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--contexts", default="2048,8192,32768,65536,131072")
    parser.add_argument("--batches", default="1",
                        help="requests per step, e.g. 1,2,4 (each context at each batch)")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."),
                                                      "single.json"))
    parser.add_argument("--plot", metavar="JSON", help="only draw the PNG of a result file")
    parser.add_argument("--split-sweep", action="store_true",
                        help="also time the step (rows as the plugin runs them) at each "
                             "SPLIT_SWEEP chunk floor and J: split_c<floor>_j<J>")
    parser.add_argument("--width", default=[WIDTH], type=page_widths,
                        help="block-table pages per row (2048: a 131,072-token vLLM engine); "
                             "several, e.g. 261,2048, time each shape at each width in turn")
    parser.add_argument("--spread", action="store_true",
                        help="per-(layer, KV head) fractions as the plugin imposes them")
    parser.add_argument("--programs-sweep", action="store_true",
                        help="also time the step at each PROGRAMS_SWEEP min_programs")
    parser.add_argument("--gemm", action="store_true",
                        help="also time each arm with the gate/up GEMM after every layer "
                             "(<arm>+gemm), and the GEMM alone (gemm_only)")
    parser.add_argument("--gemm-probes", action="store_true",
                        help="with --gemm: also time arms that only write / read N MiB or "
                             "gather the K/V pages before the GEMM")
    parser.add_argument("--gemm-profile", action="store_true",
                        help="with --gemm: also record the GEMM kernels' own per-call times "
                             "after each arm (profiler over the replayed graph)")
    parser.add_argument("--programs-report", nargs="+", metavar="JSON",
                        help="only print the --programs-sweep table of these runs")
    parser.add_argument("--split-report", nargs="+", metavar="JSON",
                        help="only print the --split-sweep table of these runs and the rule")
    args = parser.parse_args()
    if args.plot:
        return plot(args.plot)
    if args.programs_report:
        return print(programs_report(args.programs_report))
    if args.split_report:
        table, _, verdict = split_report(args.split_report)
        return print(f"{table}\n\n{verdict}")
    if args.gemm_profile and not args.gemm:
        parser.error("--gemm-profile profiles the <arm>+gemm graphs: add --gemm")
    if args.gemm_probes and not args.gemm:
        parser.error("--gemm-probes are arms before the GEMM: add --gemm")
    if len(args.width) > 1 and (args.programs_sweep or args.split_sweep):
        parser.error("--programs-sweep and --split-sweep take one --width (their reports key "
                     "rows by shape)")
    try:
        import vllm
        from vllm.vllm_flash_attn import flash_attn_interface as fa
        vllm_version = vllm.__version__
    except Exception as error:  # noqa: BLE001 -- FA3 arms are skipped, the rest still run
        fa, vllm_version = None, f"unavailable: {error}"
    from moira.decode import _launch_estimate, _launch_select

    results = []
    shapes = timed_shapes(map(int, args.contexts.split(",")), map(int, args.batches.split(",")),
                          args.width)
    for context, batch, width in shapes:
        if cache_bytes(context, batch) > 80e9:
            print(f"{context:>7} x{batch} w{width}: skipped (caches over 80 GB)", flush=True)
            continue
        s = None  # the previous shape's caches go before this one's are made
        torch.cuda.empty_cache()
        s = Layers(context, batch, width, args.spread, args.gemm)
        rows = batch * KV_HEADS
        row = dict(context=context, batch=batch, read_fraction=s.fraction, width=s.width,
                   spread=args.spread, us_per_layer={})
        times = row["us_per_layer"]

        def timed(name, layer_fn, gemm=False):
            if args.gemm and not gemm:  # the arm with the GEMM right after, beside it
                timed(name + "+gemm", layer_fn, gemm=True)
            try:
                times[name] = round(bench(s.each(layer_fn, gemm)) / LAYERS, 2)
            except Exception as error:  # noqa: BLE001 -- one failed arm must not lose the rest
                row.setdefault("errors", {})[name] = f"{type(error).__name__}: {error}"[:300]
                print(f"{context:>7} x{batch} w{s.width} {name:<24} failed: "
                      f"{row['errors'][name]}",
                      flush=True)
                return
            print(f"{context:>7} x{batch} w{s.width} {name:<24} {times[name]:8.2f} us/layer",
                  flush=True)
            if gemm and args.gemm_profile:
                calls = row.setdefault("gemm_calls", {})[name] = gemm_calls(s.each(layer_fn,
                                                                                   gemm))
                print(f"{'':>17} {name:<24} GEMM per call p10 / median / p90 {calls['p10_us']}"
                      f" / {calls['median_us']} / {calls['p90_us']} us", flush=True)

        if args.gemm:
            timed("gemm_only", lambda layer: None, gemm=True)
        if args.gemm_probes:
            for mib in (2, 32):
                scratch = torch.empty(mib << 18, device="cuda")  # float32: N MiB
                column_max = torch.empty(1024, device="cuda")
                timed(f"probe_write_{mib}m", lambda layer, x=scratch: x.fill_(layer))
                timed(f"probe_read_{mib}m", lambda layer, x=scratch, m=column_max: torch.amax(
                    x.view(-1, 1024), dim=0, out=m))
            pages = s.table[:, :context // PAGE].flatten()
            gathered = torch.empty((len(pages), *s.caches[0][0].shape[1:]), device="cuda",
                                   dtype=torch.bfloat16)
            timed("probe_gather", lambda layer: [torch.index_select(
                cache, 0, pages, out=gathered) for cache in s.caches[layer]])

        if fa is not None:
            cu_q = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
            metadata = fa.get_scheduler_metadata(
                batch, 1, context, KV_HEADS * GROUP, KV_HEADS, HEAD_DIM, s.seq_lens,
                qkv_dtype=torch.bfloat16, cu_seqlens_q=cu_q, page_size=PAGE, causal=True,
                num_splits=32)
            timed("fa3_dense", lambda layer: fa.flash_attn_varlen_func(
                s.queries[layer], *s.caches[layer], 1, cu_q, context, seqused_k=s.seq_lens,
                softmax_scale=s.scale, causal=True, block_table=s.table,
                scheduler_metadata=metadata, num_splits=32, fa_version=3, out=s.out))

        workspace = s.workspace()
        log_masses, lists, counts = workspace.selection_buffers(batch, s.width)
        timed("estimate", lambda layer: _launch_estimate(
            s.queries[layer], s.caches[layer][0], s.summaries[layer], s.table, s.seq_lens,
            s.scale, log_masses))
        ways = workspace.config.bisection_ways_for(s.width)
        timed("select", lambda layer: _launch_select(
            log_masses, s.seq_lens, lists, counts, num_kv_heads=KV_HEADS, max_pages=s.width,
            gamma=0.98, top_k=None, ways=ways, keep_fractions=s.fractions[layer]))
        row["pages_listed_per_row"] = float(counts.float().mean())
        timed("attend_merge", lambda layer: moira.attend(
            s.queries[layer], *s.caches[layer], s.table, s.seq_lens, lists, counts,
            workspace=workspace, out=s.out))
        c2 = s.workspace(moira.MoiraConfig(floor_rows=96))
        # programmatic launch chains every kernel of the graph here, across layers too; in vLLM
        # the GEMMs between layers are launched plainly, so this is an upper bound on its gain
        chained = s.workspace(moira.MoiraConfig(programmatic_launch=True))
        arms = {"step": (workspace, 0), "step_c2": (c2, 0),
                "step_floor_off": (s.workspace(moira.MoiraConfig(floor_rows=1)), 0),
                "step_full_rows": (workspace, s.width), "step_full_rows_c2": (c2, s.width),
                "step_pdl": (chained, 0), "step_full_rows_pdl": (chained, s.width)}
        chains = {"": launch.CHAINED, "_no_attend": {"estimate", "select", "merge"},
                  "_est_sel": {"estimate", "select"}}
        for suffix, chain in chains.items():
            if suffix:
                arms.update({f"step_pdl{suffix}": (chained, 0),
                             f"step_full_rows_pdl{suffix}": (chained, s.width)})
        if args.split_sweep:  # the row as the plugin runs it (in full up to 20480 tokens)
            full = full_read_pages(MoiraSettings().dense_below_tokens, batch)
            for floor_rows, chunks, step_programs in SPLIT_SWEEP:
                config = moira.MoiraConfig(floor_rows=floor_rows, step_programs=step_programs,
                                           **({} if chunks is None else dict(
                                               min_chunks_per_row=chunks, min_programs=1)))
                name = (f"split_c{config.chunk_floor(rows)}_j"
                        f"{config.chunks_per_row(rows, s.width)}"
                        + (f"_t{step_programs}" if step_programs else ""))
                if name in arms:  # another floor_rows gives this step the same split
                    name += f"_f{floor_rows}"
                arms[name] = (s.workspace(config), full)
                row.setdefault("split_sweep", {})[name] = [floor_rows, chunks, step_programs]
        if args.programs_sweep:  # the row as the plugin runs it, J from N_T
            full = full_read_pages(MoiraSettings().dense_below_tokens, batch)
            for programs in PROGRAMS_SWEEP:
                config = programs_config(programs)
                arms[f"step_p{programs}"] = (s.workspace(config), full)
                row.setdefault("programs_sweep", {})[f"step_p{programs}"] = dict(
                    min_programs=programs, chunks_per_row=config.chunks_per_row(rows, s.width))
        for name, (ws, full) in arms.items():
            chain = next((c for suffix, c in chains.items() if suffix and name.endswith(suffix)),
                         launch.CHAINED)
            with patched(launch, CHAINED=frozenset(chain)):  # graphs are captured inside
                timed(name, lambda layer, ws=ws, full=full: moira.sparse_decode(
                    s.queries[layer], *s.caches[layer], s.summaries[layer], s.table,
                    s.seq_lens, keep_fractions=s.fractions[layer], dense_below_pages=full,
                    workspace=ws, out=s.out))
        if "fa3_dense" in times:
            row["minus_dense"] = {name: round(times[name] - times["fa3_dense"], 2)
                                  for name in arms if name in times}
        if args.gemm:
            row["gemm_cost"] = gemm_costs(times)
        results.append(row)
        with open(args.out, "w") as f:
            json.dump(dict(command="python3 " + " ".join(sys.argv),
                           gpu=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d %H:%M"),
                           versions=dict(torch=torch.__version__, triton=triton.__version__,
                                         vllm=vllm_version),
                           note="per-layer µs, 32 layers (own caches) per CUDA graph replay; "
                                "read fractions imposed (fraction mode), not chosen by the rule",
                           results=results), f, indent=1)


if __name__ == "__main__":
    main()
