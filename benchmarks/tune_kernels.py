"""Sweep the launch parameters of Estimate, Select and Attend on the GPU (issue 3's tuning log).

Llama-3.1-8B geometry (8 KV heads, G = 4, D = 128, bf16), one layer; Attend on fixed 22%
page lists (top-k mode, all rows equal: CV 0) and on full lists. Every variant is timed in the
same run with triton.testing.do_bench_cudagraph (median of graph replays, so host launch
overhead is excluded); the KV cache of every shape is >= 1 GB, far
beyond the 60 MiB L2, and the selected pages are scattered. Variants are set through the
kernel modules' tuning constants. Prints a table; writes JSON to $OUT/tune.json.

    PYTHONPATH=. python benchmarks/tune_kernels.py [--quick]
"""

import argparse
import itertools
import json
import math
import os
import sys
import time

import torch
import triton

import moira
from moira.kernels import attend as attend_module
from moira.kernels import estimate as estimate_module
from moira import decode
from moira.kernels import estimate_cuda, estimate_select_cuda
from moira.kernels import select as select_module

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernels import estimate_bytes, estimate_rotation, patched  # noqa: E402

from moira.config import MoiraConfig  # noqa: E402

KV_HEADS, GROUP, HEAD_DIM = 8, 4, 128
SHAPES = [(8192, 32), (32768, 16), (65536, 8), (131072, 4)]
EXTRA_SHAPES = [(16384, 32)]  # timed only when named in --shapes (256-page rows: Select's warps)
PAGE_KV_BYTES = 2 * 64 * HEAD_DIM * 2  # K and V of one page of one KV head
# --kinds ("exact": Estimate's exact-page forms alone; "registers": Estimate's and Attend's
# register ceilings; "query": Estimate's query of the next head loaded ahead; "cuda":
# Estimate in CUDA C++ at several grid sizes and Select in CUDA C++, each checked against the
# Triton kernel first, then the whole step with each and the step's parts per Select;
# "selectwarps": the whole step with the Triton Select at 4 / 8 / 16 warps and the CUDA one;
# "halfbytes": the CUDA Estimate with half its summary bytes, same instructions (below);
# "estparts": the CUDA Estimate whole, its exact programs alone and its mvar programs alone;
# "sumlayout": the CUDA Estimate with the summaries page-major or head-major, each over
# scattered and over consecutive physical pages; "fused": Estimate and Select in one launch
# against the two CUDA kernels; "fusedparts": the fused launch's phases by its timeline probe)
KINDS = ("estimate", "exact", "registers", "query", "cuda", "select", "attend", "tiles",
         "balanced", "fractions", "step", "wide", "selectwarps", "halfbytes", "estparts",
         "sumlayout", "fused", "fusedparts")


def bench(fn):
    """Median µs of fn replayed from a CUDA graph: no Python launch overhead in the number."""
    fn()  # compile outside the capture
    # do_bench_cudagraph runs on a new side stream that does not wait for this one: inputs
    # still being written here would be read half-made
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3


def step_inputs(context, batch):
    """One layer's inputs, each row one token short of a full page (the common decode step;
    until session 24 every row's token filled its page, so Estimate also summarized it), and
    the summaries of every page (for ``estimate_rotation``)."""
    pages = context // 64
    keys = torch.randn(batch * pages, 64, KV_HEADS, HEAD_DIM, device="cuda",
                       dtype=torch.bfloat16)
    values = torch.randn_like(keys)
    table = torch.randperm(batch * pages, device="cuda").view(batch, pages).int()
    full = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    query = torch.randn(batch, KV_HEADS * GROUP, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    summaries = moira.summarize(keys, table, full)
    return query, keys, values, summaries, table, full - 1


def binned_passes(k_b):
    """K_B = ``k_b`` for every table (64: the CUDA Select's binned passes), or as configured
    (None), for one measurement."""
    return patched(MoiraConfig, **({"bisection_ways_for": lambda self, max_pages: k_b}
                                   if k_b else {}))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer variants")
    parser.add_argument("--kinds", default="estimate,select,attend,step",
                        help=f"comma-separated subset of {','.join(KINDS)}")
    parser.add_argument("--shapes", default="",
                        help="comma-separated subset of 8k32,32k16,64k8,128k4 (default: all)")
    parser.add_argument("--table-pages", type=int, default=2048,
                        help="wide: block-table columns, as in an engine whose longest admitted "
                             "context is this many pages (vllm_tpot.py's: ~2,040)")
    args = parser.parse_args()
    kinds = set(args.kinds.split(","))
    if kinds - set(KINDS):  # a kind since removed would otherwise time nothing, silently
        parser.error(f"--kinds: unknown {sorted(kinds - set(KINDS))}; known: {', '.join(KINDS)}")
    results = []
    names = {f"{context // 1024}k{batch}" for context, batch in SHAPES + EXTRA_SHAPES}
    wanted = set(filter(None, args.shapes.split(",")))
    if wanted - names:
        parser.error(f"--shapes: unknown {sorted(wanted - names)}; known: {sorted(names)}")
    out_path = os.path.join(os.environ.get("OUT", "."), "tune.json")

    def record(kind, shape, variant, micros, bytes_read=None):
        row = dict(kind=kind, shape=shape, variant=variant, us=round(micros, 2))
        if bytes_read:
            row["GBps"] = round(bytes_read / micros / 1e3)
        results.append(row)
        print(f"{kind:>8} {shape:>9} {variant:<34} {micros:8.1f} us"
              + (f" {row['GBps']:6d} GB/s" if bytes_read else ""), flush=True)
        # written as results arrive: a variant that fails ends the run, not its results
        with open(out_path, "w") as f:
            json.dump(dict(command="python3 " + " ".join(sys.argv),
                           gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                           triton=triton.__version__, date=time.strftime("%Y-%m-%d"),
                           results=results), f, indent=1)

    selected = wanted or {f"{context // 1024}k{batch}" for context, batch in SHAPES}
    for context, batch in SHAPES + EXTRA_SHAPES:
        if f"{context // 1024}k{batch}" not in selected:
            continue
        shape = f"{context // 1024}k x{batch}"
        query, keys, values, summaries, table, seq_lens = step_inputs(context, batch)
        pages = context // 64
        workspace = moira.DecodeWorkspace(batch, pages, KV_HEADS * GROUP, KV_HEADS, HEAD_DIM,
                                          device="cuda")
        log_masses, lists, counts = workspace.selection_buffers(batch, pages)
        scale = 1 / math.sqrt(HEAD_DIM)
        summary_bytes = estimate_bytes(batch * KV_HEADS, pages, summaries.element_size())

        # rotating over inputs larger than the L2 (one copy before session 24, whose Estimate
        # rates were of data in the L2)
        rotation = estimate_rotation(summaries, table, pages, summary_bytes)

        def time_estimate(label, rotation=rotation, masses=log_masses, lens=seq_lens,
                          bytes_read=summary_bytes, **settings):
            """Time Estimate with some of its module's settings changed (the sweeps are of the
            Triton kernel's knobs: its IMPLEMENTATION unless ``settings`` name one)."""
            with patched(estimate_module, **{"IMPLEMENTATION": "triton", **settings}):
                micros = bench(lambda: [estimate_module.estimate(
                    query, keys, copy, rolled, lens, scale, masses)
                    for copy, rolled in rotation]) / len(rotation)
            record("estimate", shape, label, micros, bytes_read)

        blocks = [16, 32, 64] if not args.quick else [32, 64]
        for block, warps in itertools.product(blocks if "estimate" in kinds else [],
                                              [2, 4, 8] if not args.quick else [4, 8]):
            time_estimate(f"pages={block} warps={warps}", PAGES_PER_PROGRAM=block,
                          NUM_WARPS=warps)
        # a ceiling on Estimate's registers (estimate.MAX_REGISTERS, 96 since session 26):
        # more blocks per SM (none: ptxas's 117, 4 blocks of 4 warps; 96: 5, 80: 6, 72: 7,
        # 64: 8, the last three with spills), the default first and last
        for label, settings in ([("default", {}), ("no register ceiling",
                                                   dict(MAX_REGISTERS=None))] + [
                (f"max registers {registers}" + (f" pages={block}" if block != 32 else ""),
                 dict(MAX_REGISTERS=registers, PAGES_PER_PROGRAM=block))
                for registers, block in [(80, 32), (72, 32), (64, 32), (96, 16), (80, 16),
                                         (64, 16)]]
                + [("default again", {})]) if "registers" in kinds else []:
            time_estimate(label, **settings)
        # each head's query loaded while the previous head computes (estimate.QUERY_HEAD_AHEAD)
        # and the register ceiling (MAX_REGISTERS), the defaults since session 26, against
        # each head's query in its turn without and with the ceiling, twice each in alternation
        for label, settings in [("default", {}), ("query head in turn",
                                                  dict(QUERY_HEAD_AHEAD=False)),
                                ("query head in turn no register ceiling",
                                 dict(QUERY_HEAD_AHEAD=False, MAX_REGISTERS=None))] * 2 \
                if "query" in kinds else []:
            time_estimate(label, **settings)
        # the exact pages' heads: chained (the default) or side by side
        # (estimate.EXACT_PAGES), twice each in alternation
        for exact in ["chained", "side by side"] * 2 \
                if kinds & {"estimate", "exact"} else []:
            time_estimate(f"exact pages {exact}", EXACT_PAGES=exact)

        # Estimate in CUDA C++ (estimate.IMPLEMENTATION = "cuda", session 36): its log-masses
        # against the Triton kernel's on this shape's first copy, then timed at several grids
        # (estimate_cuda.TARGET_PROGRAMS) between two timings of the Triton default
        if "cuda" in kinds:
            copy, rolled = rotation[0]
            outputs = {}
            for implementation in ("triton", "cuda"):
                masses = torch.full_like(log_masses, float("nan"))
                with patched(estimate_module, IMPLEMENTATION=implementation):
                    estimate_module.estimate(query, keys, copy, rolled, seq_lens, scale, masses)
                outputs[implementation] = masses[..., :pages]
            difference = (outputs["cuda"] - outputs["triton"]).abs().max().item()
            record("check", shape, f"cuda - triton max |log-mass| {difference:.2e}", 0.0)
            if not difference < 1e-3:  # NaN too: a page one of them did not write
                raise SystemExit(f"the CUDA Estimate differs from Triton's by {difference}")
            # the grid at the build's default blocks per SM, then session 37's build (ptxas'
            # own choice, 0) and a build for 4 blocks with a grid of 4 per SM
            fits = estimate_cuda.MIN_BLOCKS_PER_SM
            variants = [("triton", None, fits)] + [
                (f"cuda programs={n}", n, fits) for n in (330, 660, 1320, 2640)] + [
                ("cuda programs=660 min_blocks=0", 660, 0),
                ("cuda programs=528 min_blocks=4", 528, 4), ("triton again", None, fits)]
            for label, cuda_programs, min_blocks in variants:
                with patched(estimate_cuda, TARGET_PROGRAMS=cuda_programs or 660,
                             MIN_BLOCKS_PER_SM=min_blocks):
                    time_estimate(label, **({"IMPLEMENTATION": "cuda"} if cuda_programs else {}))

        # What fewer summary bytes could save (session 49, before building FP8 summaries):
        # the CUDA Estimate as configured, and with the variance lanes pointed at the mean
        # (the summaries' stride_ss = 0), so each page's loads read 256 of its 512 bytes from
        # DRAM with the same instructions and pages. An FP8 form would add its conversions,
        # so this bounds its gain. The half arm's log-masses are not mvar's: timing only.
        # Both arms rotate over the same copies, enough for the half arm to exceed the L2.
        if "halfbytes" in kinds:
            half_bytes = estimate_bytes(batch * KV_HEADS, pages, 1)  # one byte per value
            full = estimate_rotation(summaries, table, pages, half_bytes)
            halved = [(copy.as_strided(copy.shape, (copy.stride(0), copy.stride(1), 0,
                                                    copy.stride(3))), rolled)
                      for copy, rolled in full]
            for label, arm, arm_bytes in [("cuda", full, summary_bytes),
                                          ("cuda half summary bytes", halved, half_bytes)] * 2:
                time_estimate(label, rotation=arm, bytes_read=arm_bytes, IMPLEMENTATION="cuda")

        # What each part of the CUDA Estimate costs (session 53): the whole kernel, its exact
        # programs alone (rows x 2: the sink's, and the current page's with the step's token
        # written, as in vLLM) and its mvar programs alone (rows x J), twice each in
        # alternation. The parts overlap in the whole kernel, so they need not add up: the
        # whole less the mvar part is what the exact programs add to the step
        if kinds & {"estparts", "sumlayout", "fused", "fusedparts"}:
            new_keys = torch.randn(batch, KV_HEADS, HEAD_DIM, device="cuda",
                                   dtype=torch.bfloat16)
            last = (seq_lens.long() - 1) // 64

            def token_write(rolled):  # (new keys, new values, value cache, slots) of a table
                pages_now = rolled.long().gather(1, last[:, None])[:, 0]
                return (new_keys, new_keys, values,
                        pages_now * 64 + (seq_lens.long() - 1) % 64)

            writes = [token_write(rolled) for _, rolled in rotation]
            for part in ["all", "exact", "mvar"] * 2 if "estparts" in kinds else []:
                micros = bench(lambda part=part: [estimate_cuda.estimate(
                    query, keys, copy, rolled, seq_lens, scale, log_masses, new_kv=write,
                    parts=part) for (copy, rolled), write in zip(rotation, writes)])
                record("estparts", shape, part, micros / len(rotation))
            # Where the mvar programs' 33.5 MB go at ~2.3 TB/s (session 53): the summaries
            # page-major ([page, head, 2, D], a row reads 512 bytes of each page's 4 KB) or
            # head-major (the same view over [head, page, 2, D] storage: a row's pages are
            # one head's 512-byte slots), each over the bench's scattered physical pages and
            # over consecutive ones (each request's pages in order, as a fresh engine hands
            # out a prompt's blocks); the whole kernel and its mvar part, twice in alternation
            if "sumlayout" in kinds:
                consecutive = torch.arange(batch * pages, device="cuda").view(batch, pages).int()
                head_major = [(copy.permute(1, 0, 2, 3).contiguous().permute(1, 0, 2, 3), rolled)
                              for copy, rolled in rotation]
                layouts = {"page-major": rotation, "head-major": head_major}
                tables = {"scattered": lambda rolled, i: rolled,
                          "consecutive": lambda rolled, i: consecutive.roll(i, dims=1)}
                for layout, order, part in [
                        (layout, order, part) for layout in layouts for order in tables
                        for part in ("all", "mvar")] * 2:
                    arm = [(copy, tables[order](rolled, i))
                           for i, (copy, rolled) in enumerate(layouts[layout])]
                    arm_writes = [token_write(table_now) for _, table_now in arm]
                    micros = bench(lambda arm=arm, arm_writes=arm_writes, part=part: [
                        estimate_cuda.estimate(query, keys, copy, table_now, seq_lens, scale,
                                               log_masses, new_kv=write, parts=part)
                        for (copy, table_now), write in zip(arm, arm_writes)])
                    record("sumlayout", shape, f"{layout} {order} {part}",
                           micros / len(rotation))

        # Estimate and Select in one launch (estimate_select_cuda, session 56) against the two
        # CUDA kernels, as a decode step calls them (the token written): coverage at 0.98 and
        # 22% fractions, in the rows' own table and in one as wide as an engine's, twice in
        # alternation; first the lists and counts of both compared on one copy
        if "fused" in kinds:
            fractions = torch.full((KV_HEADS,), 0.22, device="cuda")
            for width in sorted({pages, max(pages, args.table_pages)}):
                arm = [(copy, torch.cat([rolled, rolled.new_zeros(batch, width - pages)], 1))
                       for copy, rolled in rotation]
                wide = moira.DecodeWorkspace(batch, width, KV_HEADS * GROUP, KV_HEADS, HEAD_DIM,
                                             device="cuda")
                masses_w, lists_w, counts_w = wide.selection_buffers(batch, width)
                for mode, keep in [("coverage", None), ("fractions 22%", fractions)]:
                    selection = dict(gamma=0.98, top_k=None, keep_fractions=keep, gammas=None,
                                     ways=wide.config.bisection_ways_for(width),
                                     dense_below_pages=0, programmatic_launch=False)

                    def both(fused, arm=arm, selection=selection):
                        # "default": the two kernels as configured (Select's default is Triton's)
                        select_kernel = select_module.IMPLEMENTATION if fused == "default" \
                            else "cuda"
                        with patched(estimate_select_cuda,
                                     FUSED="off" if fused == "default" else fused), \
                                patched(estimate_module, IMPLEMENTATION="cuda"), \
                                patched(select_module, IMPLEMENTATION=select_kernel):
                            for (copy, table_now), write in zip(arm, writes):
                                decode._estimate_and_select(
                                    query, keys, copy, table_now, seq_lens, scale, masses_w,
                                    lists_w, counts_w, write, selection)

                    outputs = {}
                    for fused in ("off", "on"):
                        lists_w.fill_(-1)
                        both(fused, arm=arm[:1])
                        outputs[fused] = (lists_w.clone(), counts_w.clone())
                    (lists_off, counts_off), (lists_on, counts_on) = outputs["off"], outputs["on"]
                    kept = torch.arange(width, device="cuda") < counts_off[..., None]
                    # Select's sums are the two kernels' in the same order only where
                    # select_cuda.shape gives its row program the fused one's 256 threads
                    # (1,025-2,048 pages); elsewhere a near-tie may part them: counted
                    rows_apart = int(((counts_on != counts_off)
                                      | ((lists_on != lists_off) & kept).any(-1)).sum())
                    most = int((counts_on - counts_off).abs().max())
                    record("check", shape, f"fused rows apart from two kernels, {mode} "
                           f"width={width} (most pages apart {most})", rows_apart)
                    for fused in ("off", "default", "on") * 2:
                        micros = bench(lambda fused=fused: both(fused)) / len(arm)
                        record("fused", shape, f"{mode} width={width} fused {fused}", micros)

        # where a fused program's time goes (estimate_select_cuda.TIMELINE): one launch in a
        # table as wide as an engine's at 22% fractions, the token written; medians over the
        # programs of each phase (µs), the launch's span and its programs' start spread
        if "fusedparts" in kinds:
            width = max(pages, args.table_pages)
            wide = moira.DecodeWorkspace(batch, width, KV_HEADS * GROUP, KV_HEADS, HEAD_DIM,
                                         device="cuda")
            masses_w, lists_w, counts_w = wide.selection_buffers(batch, width)
            selection = dict(gamma=0.98, top_k=None,
                             keep_fractions=torch.full((KV_HEADS,), 0.22, device="cuda"),
                             gammas=None, ways=wide.config.bisection_ways_for(width),
                             dense_below_pages=0, programmatic_launch=False)
            timeline = torch.full((batch * KV_HEADS, estimate_select_cuda.TIMELINE_FIELDS), -1,
                                  dtype=torch.int64, device="cuda")
            phases = {}
            for i, ((copy, rolled), write) in enumerate(zip(rotation, writes)):
                table_now = torch.cat([rolled, rolled.new_zeros(batch, width - pages)], 1)
                with patched(estimate_select_cuda, FUSED="on", TIMELINE=timeline), \
                        patched(estimate_module, IMPLEMENTATION="cuda"), \
                        patched(select_module, IMPLEMENTATION="cuda"):
                    decode._estimate_and_select(query, keys, copy, table_now, seq_lens, scale,
                                                masses_w, lists_w, counts_w, write, selection)
                torch.cuda.synchronize()
                if i == 0:  # the first launch builds and loads the probe's kernel
                    continue
                t = (timeline - timeline[:, 0].min()).double().cpu() / 1e3
                parts = {"start": t[:, 0], "token": t[:, 1] - t[:, 0],
                         "exact sink": t[:, 2] - t[:, 1], "mvar group 0": t[:, 3] - t[:, 2],
                         "exact current": t[:, 4] - t[:, 1], "mvar group 1": t[:, 5] - t[:, 4],
                         "barrier": t[:, 6] - t[:, [3, 5]].max(1).values,
                         "select": t[:, 7] - t[:, 6], "program": t[:, 7] - t[:, 0]}
                for name, values in parts.items():
                    phases.setdefault(name, []).append(float(values.median()))
                phases.setdefault("span", []).append(float(t[:, 7].max()))
            for name, values in phases.items():
                record("fusedparts", shape, f"{name} (median of {len(values)} launches)",
                       sorted(values)[len(values) // 2])

        top_k = round(0.22 * pages)
        ways = workspace.config.bisection_ways_for(pages)

        def select_modes(label, masses=log_masses, width=pages, out_lists=lists,
                         out_counts=counts, implementation="triton"):
            """Time Select in coverage mode and at 22% fixed counts, as set up now (the
            sweeps are of the Triton kernel's knobs)."""
            for mode, kwargs in [("coverage", dict(gamma=0.98, top_k=None)),
                                 ("top22%", dict(gamma=0.98, top_k=top_k))]:
                with patched(select_module, IMPLEMENTATION=implementation):
                    micros = bench(lambda: select_module.select(
                        masses, seq_lens, out_lists, out_counts, num_kv_heads=KV_HEADS,
                        max_pages=width, ways=workspace.config.bisection_ways_for(width),
                        **kwargs))
                record("select", shape, f"{mode}{label}", micros)

        # wider passes need more threads to hold the [K_B, pages] comparison tile
        for k_b, warps in itertools.product([2, 4, 8, 16] if "select" in kinds else [],
                                            [1, 2, 4, 8]):
            with patched(select_module, num_warps=lambda block, warps=warps: warps,
                         IMPLEMENTATION="triton"):
                micros = bench(lambda: select_module.select(
                    log_masses, seq_lens, lists, counts, num_kv_heads=KV_HEADS,
                    max_pages=pages, ways=k_b, gamma=0.98, top_k=None))
            record("select", shape, f"coverage K_B={k_b} warps={warps}", micros)
        # one warp: every reduction within the warp, no block barrier (the sm_90 build of the
        # coverage kernel has 0 barriers at 1 warp against 38-76 at 4; 255 registers at 2,048
        # lanes, no spill)
        select_warps = [1, 2, 4, 8, 16] if not args.quick else [1, 4, 8]
        for warps in select_warps if "select" in kinds else []:
            with patched(select_module, num_warps=lambda block, warps=warps: warps):
                select_modes(f" warps={warps}")
        # a row's G softmaxes head by head (0) or side by side in one tile
        for tile in [0, 1 << 14] if "select" in kinds else []:
            with patched(select_module, SOFTMAX_TILE=tile):
                select_modes(f" softmax tile {tile}")
        # how much the bisection's passes cost: 18 bits (K_B = 4 or 8, these shapes' schedule:
        # 9 or 6 passes instead of 12 or 8) keep the coverage rule (a superset of the exact
        # set, by pages within max share * 2**-18 of the threshold) -- a probe, not a setting
        for bits in [18] if "select" in kinds else []:
            with patched(select_module, BISECTION_BITS=bits):
                select_modes(f" {bits} bits")

        # Select in CUDA C++ (select.IMPLEMENTATION = "cuda", session 36), with the
        # configured K_B, with 16 and with 64, whose passes bin the shares (session 39): its page
        # counts against the Triton kernel's in both modes (coverage may differ by pages at
        # the threshold, fixed counts not at all), then all timed, twice in alternation
        if "cuda" in kinds:
            estimate_module.estimate(query, keys, summaries, table, seq_lens, scale, log_masses)
            for mode, kwargs in [("coverage", dict(gamma=0.98, top_k=None)),
                                 ("top22%", dict(gamma=0.98, top_k=top_k))]:
                found = {}
                for label, implementation, k_b in [("triton", "triton", ways),
                                                   ("cuda", "cuda", ways),
                                                   ("cuda K_B=16", "cuda", 16),
                                                   ("cuda binned", "cuda", 64)]:
                    counts.fill_(-1)
                    with patched(select_module, IMPLEMENTATION=implementation):
                        select_module.select(log_masses, seq_lens, lists, counts,
                                             num_kv_heads=KV_HEADS, max_pages=pages, ways=k_b,
                                             **kwargs)
                    found[label] = counts.clone()
                for label in ("cuda", "cuda K_B=16", "cuda binned"):
                    differing = (found[label] - found["triton"]).abs().max().item()
                    record("check", shape,
                           f"select {mode} {label} - triton max |count| {differing}", 0.0)
            # K_B = 16: 6 passes instead of 12, each a 16-value reduce-scatter that costs about
            # what a 1-value one does (5 shuffle rounds; Triton's wider passes cost more)
            for label, implementation, k_b in [("", "triton", None), (" cuda", "cuda", None),
                                               (" cuda K_B=16", "cuda", 16),
                                               (" cuda binned", "cuda", 64)] * 2:
                with binned_passes(k_b):
                    select_modes(label, implementation=implementation)

        # the 22% lists from this shape's own estimates (whichever kinds ran before)
        estimate_module.estimate(query, keys, summaries, table, seq_lens, scale, log_masses)
        select_module.select(log_masses, seq_lens, lists, counts, num_kv_heads=KV_HEADS,
                             max_pages=pages, gamma=0.98, top_k=top_k, ways=ways)
        sparse_lists, sparse_counts = lists.clone(), counts.clone()
        sparse_bytes = int(sparse_counts.sum()) * PAGE_KV_BYTES
        full_lists = torch.arange(pages, device="cuda", dtype=torch.int32).expand(
            batch, KV_HEADS, pages).contiguous()
        full_counts = torch.full((batch, KV_HEADS), pages, device="cuda", dtype=torch.int32)
        out = torch.empty_like(query)
        variants = itertools.product([4, 8, 16, 24], [4096, 16384], [(4, 2), (4, 3), (8, 2)])
        if args.quick:
            variants = [(c, n, (4, 3)) for c in (4, 8, 16, 24) for n in (4096, 16384)]
            variants += [(8, 4096, (4, 2)), (16, 4096, (4, 2)), (24, 4096, (4, 2)),
                         (24, 4096, (4, 4)), (32, 4096, (4, 3))]
            # J = N_J (32) at 32-64 rows: the small-batch split (floor_rows 96, min_programs 1)
            variants += [(8, 1, (4, 2)), (16, 1, (4, 2))]
        for chunk, min_programs, (warps, stages) in variants if "attend" in kinds else []:
            # J from N_T alone, as the arm's name says (the ceiling on J lifted)
            config = moira.MoiraConfig(chunk_pages=chunk, min_programs=min_programs,
                                       max_chunks_per_row=max(min_programs, 32))
            ws = moira.DecodeWorkspace(batch, pages, KV_HEADS * GROUP, KV_HEADS, HEAD_DIM,
                                       device="cuda", config=config)
            name = f"C={chunk} N_T={min_programs} warps={warps} stages={stages}"
            # the Triton kernel's warps and stages (the default Attend is CUDA's since session 36)
            with patched(attend_module, IMPLEMENTATION="triton", NUM_WARPS=warps,
                         NUM_STAGES=stages):
                micros = bench(lambda: moira.attend(query, keys, values, table, seq_lens,
                                                    sparse_lists, sparse_counts, workspace=ws,
                                                    out=out))
                record("attend22", shape, name, micros, sparse_bytes)
                if chunk == 24 and min_programs == 4096:
                    micros = bench(lambda: moira.attend(query, keys, values, table, seq_lens,
                                                        full_lists, full_counts, workspace=ws,
                                                        out=out))
                    record("attend100", shape, name, micros,
                           batch * KV_HEADS * pages * PAGE_KV_BYTES)
        # several listed pages per inner-loop tile: more loads in flight per program
        for per_tile, warps, stages in itertools.product(
                [1, 2, 4] if "tiles" in kinds else [], [4, 8], [2, 3]):
            with patched(attend_module, IMPLEMENTATION="triton", PAGES_PER_ITER=per_tile,
                         NUM_WARPS=warps, NUM_STAGES=stages):
                micros = bench(lambda: moira.attend(query, keys, values, table, seq_lens,
                                                    sparse_lists, sparse_counts,
                                                    workspace=workspace, out=out))
            record("attend22", shape, f"pages/tile={per_tile} warps={warps} stages={stages}",
                   micros, sparse_bytes)
        # Attend under a register ceiling (attend.MAX_REGISTERS): one page per tile halves its
        # shared memory, so that registers decide its blocks per SM (default: 3; one page with
        # 128 registers: 4, with 96: 5), the default first and last
        for label, settings in ([("default", {})] + [
                (f"pages/tile={per_tile} stages={stages} max registers {registers}",
                 dict(PAGES_PER_ITER=per_tile, NUM_STAGES=stages, MAX_REGISTERS=registers))
                for per_tile, stages, registers in [(1, 2, None), (1, 2, 128), (1, 2, 96),
                                                    (1, 3, 128), (1, 3, 96)]]
                + [("default again", {})]) if "registers" in kinds else []:
            with patched(attend_module, IMPLEMENTATION="triton", **settings):  # Triton's knobs
                micros = bench(lambda: moira.attend(query, keys, values, table, seq_lens,
                                                    sparse_lists, sparse_counts,
                                                    workspace=workspace, out=out))
            record("attend22", shape, label, micros, sparse_bytes)
        # the balanced global split: programs P and minimum pages per program C
        for programs, floor in itertools.product(
                [264, 528, 792, 1056, 1584, 2112] if "balanced" in kinds else [], [4, 8, 16]):
            config = moira.MoiraConfig(schedule="balanced", programs=programs, chunk_pages=floor)
            ws = moira.DecodeWorkspace(batch, pages, KV_HEADS * GROUP, KV_HEADS, HEAD_DIM,
                                       device="cuda", config=config)
            micros = bench(lambda: moira.attend(query, keys, values, table, seq_lens,
                                                sparse_lists, sparse_counts, workspace=ws,
                                                out=out))
            record("attend22", shape, f"balanced P={programs} C={floor}", micros, sparse_bytes)
        # time against bytes: Attend + Merge at several fixed fractions of every row; the
        # intercept of time over bytes is the fixed cost per layer (launches, ramp, Merge)
        for fraction in [0.05, 0.11, 0.22, 0.44, 1.0] if "fractions" in kinds else []:
            count = max(2, round(fraction * pages))
            select_module.select(log_masses, seq_lens, lists, counts, num_kv_heads=KV_HEADS,
                                 max_pages=pages, gamma=0.98, top_k=count, ways=ways)
            micros = bench(lambda: moira.attend(query, keys, values, table, seq_lens,
                                                lists, counts, workspace=workspace, out=out))
            record("fraction", shape, f"{fraction:.0%} ({count} pages/row)", micros,
                   batch * KV_HEADS * count * PAGE_KV_BYTES)

        def padded(width):
            """The block table padded to ``width`` columns, as in an engine whose longest
            admitted context is that many pages, and a workspace for it."""
            return (torch.cat([table, torch.zeros(batch, width - pages, dtype=table.dtype,
                                                  device="cuda")], dim=1),
                    moira.DecodeWorkspace(batch, width, KV_HEADS * GROUP, KV_HEADS, HEAD_DIM,
                                          device="cuda"))

        if "wide" in kinds and args.table_pages > pages:
            # the engine's view: every row's table padded to the longest admitted context, so
            # grids sized by the width launch programs that find nothing to do
            width = args.table_pages
            wide_table, wide = padded(width)
            wide_masses, wide_lists, wide_counts = wide.selection_buffers(batch, width)
            name = f"table {width} pages"
            # each kernel in Triton and in CUDA C++ (whose "auto" rule goes by the width,
            # the only length the host knows: is it safe for short rows?), then the step with
            # each pair, twice in alternation
            wide_rotation = estimate_rotation(summaries, wide_table, pages, summary_bytes)
            for implementation in ("triton", "cuda") * 2:
                time_estimate(f"{name} {implementation}", masses=wide_masses,
                              rotation=wide_rotation, IMPLEMENTATION=implementation)
                select_modes(f", {name} {implementation}", wide_masses, width, wide_lists,
                             wide_counts, implementation=implementation)
            for estimate_kernel, select_kernel in [("triton", "triton"), ("cuda", "triton"),
                                                   ("triton", "cuda"), ("cuda", "cuda")] * 2:
                with patched(estimate_module, IMPLEMENTATION=estimate_kernel), \
                        patched(select_module, IMPLEMENTATION=select_kernel):
                    micros = bench(lambda: moira.sparse_decode(
                        query, keys, values, summaries, wide_table, seq_lens, top_k=top_k,
                        workspace=wide, out=out))
                record("step22", shape, f"estimate+select+attend+merge, {name}, "
                       f"{estimate_kernel} estimate, {select_kernel} select", micros,
                       sparse_bytes + summary_bytes)
        # the Triton Select's warps and softmax form in the whole step, where its code comes
        # cold from HBM (Attend's K/V evict it from the L2): more warps, fewer straight-line
        # instructions per thread, so fewer to fetch (sm_90, 2,048 lanes: 4,720 at 4 warps,
        # 3,264 at 8, 2,184 at 16; head by head, SOFTMAX_TILE 0: 3,456 / 2,760 / 2,088);
        # against the CUDA Select, in the shape's own table and in a --table-pages one, twice
        # in alternation
        widths = [pages] + ([args.table_pages] if args.table_pages > pages else [])
        for width in widths if "selectwarps" in kinds else []:
            padded_table, space = padded(width)
            for label, warps, tile, kernel in [
                    ("triton", None, None, "triton"), ("triton 4 warps", 4, None, "triton"),
                    ("triton 8 warps", 8, None, "triton"),
                    ("triton 16 warps", 16, None, "triton"),
                    ("triton head by head", None, 0, "triton"),
                    ("triton 16 warps head by head", 16, 0, "triton"),
                    ("cuda", None, None, "cuda"), ("cuda binned", None, None, "cuda")] * 2:
                settings = dict(IMPLEMENTATION=kernel)
                if tile is not None:
                    settings["SOFTMAX_TILE"] = tile
                if warps:
                    settings["num_warps"] = lambda block, warps=warps: warps
                for mode, k in (("fixed 22%", top_k), ("coverage", None)):
                    with patched(select_module, **settings), \
                            binned_passes(64 if label.endswith("binned") else None):
                        micros = bench(lambda: moira.sparse_decode(
                            query, keys, values, summaries, padded_table, seq_lens, top_k=k,
                            workspace=space, out=out))
                    record("step", shape, f"{mode}, table {width} pages, {label} select",
                           micros)
        if "step" in kinds:
            # a row's chunks made equal (the default since session 8) and Eq. (4)'s as is
            for even in (True, False):
                with patched(attend_module, IMPLEMENTATION="triton", EVEN_CHUNKS=even):
                    micros = bench(lambda: moira.attend(query, keys, values, table, seq_lens,
                                                        sparse_lists, sparse_counts,
                                                        workspace=workspace, out=out))
                record("attend22", shape, "equal chunks" if even else "Eq. (4) chunks as is",
                       micros, sparse_bytes)
            micros = bench(lambda: moira.sparse_decode(query, keys, values, summaries, table,
                                                       seq_lens, top_k=top_k,
                                                       workspace=workspace, out=out))
            record("step22", shape, "estimate+select+attend+merge, defaults", micros,
                   sparse_bytes + summary_bytes)
        # the whole step (fixed 22%) with the CUDA Estimate and Select, each alone and both,
        # against the Triton kernels, twice in alternation
        for label, settings in [("triton", ("triton", "triton")),
                                ("cuda estimate", ("cuda", "triton")),
                                ("cuda select", ("triton", "cuda")),
                                ("cuda both", ("cuda", "cuda"))] * 2 if "cuda" in kinds else []:
            with patched(estimate_module, IMPLEMENTATION=settings[0]), \
                    patched(select_module, IMPLEMENTATION=settings[1]):
                micros = bench(lambda: moira.sparse_decode(query, keys, values, summaries, table,
                                                           seq_lens, top_k=top_k,
                                                           workspace=workspace, out=out))
            record("step22", shape, f"estimate+select+attend+merge, {label}", micros,
                   sparse_bytes + summary_bytes)
        # where the CUDA Select's gain in the step comes from (session 37: 12 us at 128k x 4,
        # where alone it is 1 us slower): per Select, the step's parts in the step's buffers
        # (the workspace's), alone and in sequence (Attend + Merge alone on the lists that
        # Select left), twice in alternation
        if "cuda" in kinds:
            def estimate_step():  # Triton's, as when these parts were first timed
                with patched(estimate_module, IMPLEMENTATION="triton"):
                    estimate_module.estimate(query, keys, summaries, table, seq_lens, scale,
                                             log_masses)

            def select_step():
                select_module.select(log_masses, seq_lens, lists, counts,
                                     num_kv_heads=KV_HEADS, max_pages=pages, gamma=0.98,
                                     top_k=top_k, ways=ways)

            def attend_step():
                moira.attend(query, keys, values, table, seq_lens, lists, counts,
                             workspace=workspace, out=out)

            estimate_step()
            parts = [("select", select_step), ("attend+merge", attend_step),
                     ("estimate, select", lambda: (estimate_step(), select_step())),
                     ("select, attend+merge", lambda: (select_step(), attend_step()))]
            for implementation in ("triton", "cuda") * 2:
                with patched(select_module, IMPLEMENTATION=implementation):
                    select_step()  # the lists Attend alone reads
                    for label, fn in parts:
                        record("parts", shape, f"{label}, {implementation} select", bench(fn))


if __name__ == "__main__":
    main()
