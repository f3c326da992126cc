"""Where Attend's time goes inside one launch (issue 3): a timeline of its programs.

The CUDA Attend's probe build (``attend_cuda.TIMELINE``) writes, per program, when it started,
when its first page landed and when it ended (global timer, ns), its SM and its page count.
From that, per (shape, spread) and launch:

- the bytes arriving over time (each program's pages spread evenly from its first page's
  landing to its end, in 1-µs bins), the steady rate (median of the middle half's bins), the
  *ramp* (launch start until the rate first reaches 90% of the steady one) and the *tail*
  (the rate's last 90% bin until the last program ends);
- the span (first start to last end) against ``bytes / steady rate``, and the ends' spread
  (the last end against the median working program's);
- each program's prologue (start to first page landed) and, in the first wave, the spread of
  its rate (pages per µs from its first page to its end).

Attend + Merge is also timed from CUDA-graph replays with the default build and the probe's
(what the probe itself costs), in each variant (``--variants``: the chunk floor C and the
stages), on the kernel suite's page lists
(``bench_kernels``: 22% of each row's pages, CV 0 / 1.0 and one layer of the real-like
spread, random positions, scattered pages).

    PYTHONPATH=. OUT=$OUT python3 benchmarks/attend_timeline.py [--shapes 8k32,32k16,131k4]
        [--spreads cv0,cv1,real5] [--launches 5]
        [--variants grid24,grid12,grid24s3,grid24j2,grid24w2048] [--rounds 2]
    python3 benchmarks/attend_timeline.py --plot results/<run>.json   # the plot again

Writes ``$OUT/timeline.json`` (summaries of every launch, one launch's programs raw) and
``$OUT/timeline.png``.
"""

import argparse
import gzip
import json
import os
import re
import statistics
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernels import (EXTRA_SHAPES, GROUP, HEAD_DIM, KV_HEADS,  # noqa: E402
                           MEAN_FRACTION, PAGE_BYTES, REAL_MEANS, SHAPES, Shape, bench,
                           layer_lists, patched)

import moira  # noqa: E402
from moira.config import MoiraConfig  # noqa: E402

from moira.kernels import attend as attend_module  # noqa: E402
from moira.kernels import attend_cuda  # noqa: E402

BIN_US = 1.0
STEADY = 0.9  # the ramp ends and the tail starts where the rate crosses 90% of the steady one


def spread_lists(pages, rows, spread):
    """The suite's lists (``bench_kernels.main``'s seeds): "cv0", "cv1" or "real<layer>"."""
    if spread.startswith("real"):
        layer = int(spread[4:])
        return layer_lists(pages, rows, REAL_MEANS[layer], 0.7, seed=1000 * layer + 7)
    cv = float(spread[2:])
    return layer_lists(pages, rows, MEAN_FRACTION, cv, seed=int(10 * cv))


RAW_FIELDS = ["start_ns", "first_page_ns", "end_ns", "sm", "pages"]  # ns from the first start


def compact(records):
    """One launch's records as ``RAW_FIELDS`` rows (first page -1 where none landed)."""
    start, first, end, _, _, _, sm, pages = records.T
    t0 = start.min()
    first = torch.where(pages > 0, first - t0, -1)
    return torch.stack([start - t0, first, end - t0, sm, pages], dim=1).tolist()


def variant_settings(variant):
    """(chunk_pages, CUDA stages, max_chunks_per_row, block-table pages) of a variant name:
    "grid24" (the default), "grid12", "grid24s3" (3 stages), "grid24j2" (J at most 2: no
    program past a 28-page row's chunks), "grid24w2048" (the block table widened to 2,048
    pages, as in an engine of 131k-token contexts: J from Eq. (4)'s cap on that width)."""
    match = re.fullmatch(r"grid([1-9][0-9]*)(?:s([234]))?(?:j([1-9][0-9]*))?(?:w([1-9][0-9]*))?",
                         variant)
    if not match:
        raise SystemExit(f"--variants: {variant!r} is not grid<C>[s<S>][j<J>][w<pages>]")
    chunk, stages, most, width = match.groups()
    return int(chunk), int(stages or 2), most and int(most), width and int(width)


def variant_run(s, page_lists, counts, variant):
    """Attend + Merge of one variant on a ``bench_kernels.Shape``'s caches."""
    chunk_pages, _, most, width = variant_settings(variant)
    table = s.table
    if width and width > s.pages:  # the extra entries are never listed, so never read
        table = torch.cat([table, table.new_zeros(s.batch, width - s.pages)], dim=1)
    fields = dict(chunk_pages=chunk_pages)
    if most:
        fields.update(min_chunks_per_row=min(MoiraConfig.min_chunks_per_row, most),
                      max_chunks_per_row=most)
    workspace = moira.DecodeWorkspace(s.batch, table.shape[1], KV_HEADS * GROUP, KV_HEADS,
                                      HEAD_DIM, device="cuda", config=MoiraConfig(**fields))
    lists = page_lists.view(s.batch, KV_HEADS, -1)
    page_counts = counts.view(s.batch, KV_HEADS)
    return lambda: moira.attend(s.query, s.key_nhd, s.value_nhd, table, s.seq_lens, lists,
                                page_counts, scale=s.scale, workspace=workspace, out=s.out)


def analyse(records, rows):
    """Summary of one launch's records ([programs, 8] int64, ``attend_cuda.TIMELINE``)."""
    start, first, end, _, _, _, sm, pages = records.double().T
    t0 = start.min()
    start, end = (start - t0) / 1e3, (end - t0) / 1e3
    working = pages > 0
    first = torch.where(working, (first - t0) / 1e3, start)
    span = float(end.max())
    bins = int(span / BIN_US) + 1
    # page 0 at its landing, the others evenly from there up to the end
    lo, hi, n = first[working], end[working].maximum(first[working] + 1e-3), pages[working]
    edges = torch.arange(bins + 1, dtype=torch.float64) * BIN_US
    overlap = (torch.minimum(edges[None, 1:], hi[:, None])
               - torch.maximum(edges[None, :-1], lo[:, None])).clamp(min=0)
    arrived = (overlap / (hi - lo)[:, None] * (n - 1)[:, None]).sum(0) * PAGE_BYTES
    arrived += torch.bincount((lo / BIN_US).long().clamp(max=bins - 1),
                              minlength=bins).double() * PAGE_BYTES
    rate = arrived / BIN_US / 1e6  # TB/s per bin
    middle = rate[bins // 4: max(bins // 4 + 1, 3 * bins // 4)]
    steady = float(middle.median())
    above = (rate >= STEADY * steady).nonzero().flatten()
    ramp = float(above[0]) * BIN_US if len(above) else span
    tail = span - float(above[-1] + 1) * BIN_US if len(above) else 0.0
    total = float(pages.sum()) * PAGE_BYTES
    ends = end[working]
    wave = working & (start < 2.0)  # started with the launch
    rates = pages[wave] / (end[wave] - first[wave]).clamp(min=1e-3)
    return dict(
        programs=len(records), working=int(working.sum()), rows=rows,
        sms=int(sm.unique().numel()), bytes=total, span_us=round(span, 2),
        steady_tbps=round(steady, 3), ideal_us=round(total / steady / 1e6, 2),
        ramp_us=round(ramp, 1), tail_us=round(tail, 1),
        last_start_us=round(float(start.max()), 2),
        end_median_us=round(float(ends.median()), 2),
        end_p90_us=round(float(ends.quantile(0.9)), 2), end_max_us=round(float(ends.max()), 2),
        prologue_median_us=round(float((first - start)[working].median()), 2),
        prologue_p90_us=round(float((first - start)[working].quantile(0.9)), 2),
        empty_median_us=round(float((end - start)[~working].median()), 2)
        if (~working).any() else None,
        first_wave_programs=int(wave.sum()),
        first_wave_rate_cv=round(float(rates.std() / rates.mean()), 3) if len(rates) > 1
        else None,
        rate_tbps=[round(x, 3) for x in rate.tolist()])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="8k32,32k16,131k4")
    parser.add_argument("--spreads", default="cv0,cv1,real5")
    parser.add_argument("--launches", type=int, default=5)
    parser.add_argument("--variants", default="grid24",
                        help="comma-separated grid<C>[s<S>][j<J>][w<pages>]: chunk floor C "
                             "(chunk_pages), S pages' stages (attend.CUDA_STAGES, default 2), "
                             "at most J programs per row, the block table <pages> wide")
    parser.add_argument("--rounds", type=int, default=2, help="timings of each variant, in "
                        "alternation")
    parser.add_argument("--plot", metavar="JSON", help="only plot a run's timeline.json[.gz] "
                        "(to the same name with .png)")
    args = parser.parse_args()
    if args.plot:
        with (gzip.open if args.plot.endswith(".gz") else open)(args.plot, "rt") as f:
            plot(json.load(f), args.plot.removesuffix(".gz").removesuffix(".json") + ".png")
        return
    shapes = {**SHAPES, **EXTRA_SHAPES}
    unknown = [name for name in args.shapes.split(",") if name not in shapes]
    if unknown:
        parser.error(f"--shapes: unknown {unknown}; known: {', '.join(shapes)}")
    variants = args.variants.split(",")
    for variant in variants:
        variant_settings(variant)  # a bad name fails here, not after the first shape
    out = os.environ.get("OUT", ".")
    report = dict(command="python3 " + " ".join(sys.argv), gpu=torch.cuda.get_device_name(),
                  date=time.strftime("%Y-%m-%d %H:%M:%S"),
                  versions=dict(torch=torch.__version__, triton=triton.__version__),
                  mean_fraction=MEAN_FRACTION, bin_us=BIN_US, results=[])
    for shape_name in args.shapes.split(","):
        context, batch = shapes[shape_name]
        s = Shape(context, batch)
        capacity = s.rows * s.pages  # more programs than any plan launches
        timeline = torch.full((capacity, attend_cuda.TIMELINE_FIELDS), -1, dtype=torch.int64,
                              device="cuda")
        for spread in args.spreads.split(","):
            lists = spread_lists(s.pages, s.rows, spread)
            counts, page_lists = lists["counts"], lists["lists"]
            bytes_read = int(counts.sum()) * PAGE_BYTES
            runs = {variant: variant_run(s, page_lists, counts, variant)
                    for variant in variants}
            timed = {variant: [] for variant in variants}
            for _ in range(args.rounds):  # the variants in alternation
                for variant in variants:
                    stages = variant_settings(variant)[1]
                    with patched(attend_module, IMPLEMENTATION="cuda", CUDA_STAGES=stages):
                        timed[variant].append(bench(runs[variant])[0])
            for variant in variants:
                stages = variant_settings(variant)[1]
                with patched(attend_module, IMPLEMENTATION="cuda", CUDA_STAGES=stages), \
                        patched(attend_cuda, TIMELINE=timeline):
                    probe_us, _ = bench(runs[variant])
                    launches = []
                    for _ in range(args.launches):
                        timeline.fill_(-1)
                        runs[variant]()
                        torch.cuda.synchronize()
                        written = timeline[timeline[:, 0] != -1].cpu()
                        launches.append(analyse(written, s.rows))
                    raw = compact(written)
                plain_us = statistics.median(timed[variant])
                row = dict(shape=shape_name, spread=spread, variant=variant, bytes=bytes_read,
                           attend_merge_us=round(plain_us, 2),
                           attend_merge_us_rounds=[round(x, 2) for x in timed[variant]],
                           vs_grid24=round(plain_us / statistics.median(timed["grid24"]), 4)
                           if "grid24" in timed else None,
                           probe_attend_merge_us=round(probe_us, 2), launches=launches,
                           raw_fields=RAW_FIELDS,
                           raw_last_launch=raw)
                keys = ("span_us", "ideal_us", "steady_tbps", "ramp_us", "tail_us",
                        "end_median_us", "end_max_us", "prologue_median_us",
                        "first_wave_rate_cv")
                row["medians"] = {k: statistics.median(x[k] for x in launches) for k in keys
                                  if launches[0][k] is not None}
                report["results"].append(row)
                print(f"{shape_name:>6} {spread:>6} {variant:>13} attend+merge {plain_us:7.1f} us"
                      f" ({row['vs_grid24']}; probe {probe_us:7.1f}) records "
                      f"{launches[0]['programs']} working {launches[0]['working']}  "
                      + "  ".join(f"{k} {v}" for k, v in row["medians"].items()), flush=True)
                with open(os.path.join(out, "timeline.json"), "w") as f:
                    json.dump(report, f, separators=(",", ":"))
        del s, timeline
        torch.cuda.empty_cache()
    try:
        plot(report, os.path.join(out, "timeline.png"))
    except ImportError as error:  # the GPU host may lack matplotlib: plot the JSON elsewhere
        print(f"no plot ({error}): python3 benchmarks/attend_timeline.py --plot timeline.json")


def plot(report, path):
    """One panel per (shape, spread): the bytes' arrival rate over one launch of each variant,
    and its Attend + Merge time in the legend."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = {}
    for row in report["results"]:
        panels.setdefault((row["shape"], row["spread"]), []).append(row)
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 2.4 * len(panels)), squeeze=False)
    for ax, ((shape, spread), rows) in zip(axes[:, 0], panels.items()):
        for row in rows:
            rate = row["launches"][0]["rate_tbps"]
            m = row["medians"]
            ax.plot([i * report["bin_us"] for i in range(len(rate))], rate, lw=0.9,
                    label=f"{row.get('variant', 'grid24')}: {row['attend_merge_us']:.1f} µs "
                          f"(ramp {m['ramp_us']:.0f}, tail {m['tail_us']:.0f})")
        ax.set_title(f"{shape} {spread}", fontsize=8)
        ax.set_ylabel("TB/s")
        ax.legend(fontsize=6, loc="lower left")
    axes[-1, 0].set_xlabel("µs since the first program started")
    fig.suptitle(f"Attend's bytes over one launch ({report['gpu']}, {report['date']})",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
