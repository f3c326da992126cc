"""Sweep the kernels' tuning constants and backends on the GPU, every variant in one run.

Llama-3.1-8B geometry (8 KV heads, G = 4, D = 128, bf16), one layer per shape; Attend on fixed
22% page lists (top-k mode, all rows equal) and on full lists. Every variant is a
``moira.KernelOptions`` (``--kernels`` gives the base the variants change) or a
``MoiraConfig``, timed with ``triton.testing.do_bench_cudagraph`` (median of graph replays:
no host launch cost); every shape's KV cache is >= 1 GB, far beyond the 60 MiB L2, the
selected pages are scattered, and Estimate rotates over copies of its input larger than twice
the L2. Prints a table; writes ``$OUT/tune.json`` as results arrive (``report.py tune``
compares each variant with its shape's default).

    PYTHONPATH=. python3 benchmarks/tune.py [--kinds estimate,select,attend,step] [--quick]
        [--shapes 8k32,131k4] [--table-pages 2048] [--kernels attend=triton]

Kinds:
- ``estimate``: the Triton Estimate's pages per program x warps, its exact pages chained or
  side by side; ``exact``: the latter alone; ``registers``: Estimate's and Attend's register
  ceilings; ``query``: each head's query loaded while the previous head computes.
- ``cuda``: the CUDA Estimate (checked against the Triton one, then at several grids and
  builds) and the CUDA Select (counts against the Triton one's), the step with each, and the
  step's parts per Select.
- ``select``: the Triton Select's K_B x warps, warps (1 to 16 forced, ``select.num_warps``,
  against its default, by the table's width), softmax tile; ``selectwarps``: the whole step
  with the Triton Select at its default warps and at 4, 8 and 16, head by head (softmax tile
  0), and with the CUDA one.
- ``attend``: the Triton Attend's chunk floor C, N_T, warps and stages; ``tiles``: pages per
  inner-loop tile; ``balanced``: the balanced schedule's P and C; ``fractions``: Attend +
  Merge against the bytes read; ``step``: equal or Eq. (4) chunks and the whole step.
- ``wide``: Estimate, Select and the step in a ``--table-pages`` wide table (an engine's),
  Triton and CUDA each.
- ``halfbytes``: the CUDA Estimate with half its summary bytes (same instructions: what FP8
  summaries could save at most); ``estparts``: its exact and mvar programs alone;
  ``sumlayout``: summaries page- or head-major over scattered or consecutive pages.
- ``fused``: Estimate and Select in one launch against the two CUDA kernels (lists compared
  first); ``fusedparts``: the fused launch's phases from its timeline probe.
"""

import argparse
import itertools
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
from common import GROUP, HEAD_DIM, KV_HEADS  # noqa: E402

SHAPES = [(8192, 32), (32768, 16), (65536, 8), (131072, 4)]
EXTRA_SHAPES = [(16384, 32)]  # timed only when named in --shapes (256-page rows: Select's warps)
PAGE_KV_BYTES = 2 * 64 * HEAD_DIM * 2  # K and V of one page of one KV head
KINDS = ("estimate", "exact", "registers", "query", "cuda", "select", "attend", "tiles",
         "balanced", "fractions", "step", "wide", "selectwarps", "halfbytes", "estparts",
         "sumlayout", "fused", "fusedparts")
# the Triton Select's warps forced (tuning select.num_warps; 0, its default, picks them by the
# table's width): "select" (--quick: QUICK_SELECT_WARPS), and "selectwarps" in the whole step
SELECT_WARPS, QUICK_SELECT_WARPS, STEP_SELECT_WARPS = (1, 2, 4, 8, 16), (1, 4, 8), (4, 8, 16)
# K_B for every table width: the CUDA Select's binned passes (64), or 16
BINNED = ((1, 64),)


def shape_name(context, batch):
    return f"{context // 1024}k{batch}"


def select_kernels(warps=0, softmax_tile=None):
    """``common.with_kernels`` fields of the Triton Select in ``warps`` (0: by the table's
    width) and, where given, that ``select.softmax_tile``."""
    tuning = {"select.num_warps": warps}
    if softmax_tile is not None:
        tuning["select.softmax_tile"] = softmax_tile
    return dict(select="triton", tuning=tuning)


def step_select_arms():
    """``selectwarps``' arms, (label, kernel fields, ``MoiraConfig`` fields): the Triton
    Select at its default warps and at ``STEP_SELECT_WARPS``, the default and 16 warps also
    head by head, then the CUDA Select with the configured K_B and binned (K_B 64)."""
    arms = [("triton", select_kernels(), {})]
    arms += [(f"triton {warps} warps", select_kernels(warps), {}) for warps in STEP_SELECT_WARPS]
    arms += [("triton head by head", select_kernels(softmax_tile=0), {}),
             ("triton 16 warps head by head", select_kernels(16, softmax_tile=0), {})]
    return arms + [("cuda", dict(select="cuda"), {}),
                   ("cuda binned", dict(select="cuda"), dict(bisection_ways=BINNED))]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer variants")
    parser.add_argument("--kinds", default="estimate,select,attend,step",
                        help=f"comma-separated subset of {','.join(KINDS)}")
    parser.add_argument("--shapes", default="",
                        help="comma-separated subset of 8k32,32k16,64k8,128k4 (16k32 when "
                             "named; default: the four)")
    parser.add_argument("--table-pages", type=int, default=2048,
                        help="wide, selectwarps, fused: block-table columns, as in an engine "
                             "whose longest admitted context is this many pages")
    common.add_kernel_options(parser)
    args = parser.parse_args(argv)
    kinds = set(args.kinds.split(","))
    if kinds - set(KINDS):  # an unknown kind would otherwise time nothing, silently
        parser.error(f"--kinds: unknown {sorted(kinds - set(KINDS))}; known: {', '.join(KINDS)}")
    names = {shape_name(context, batch) for context, batch in SHAPES + EXTRA_SHAPES}
    wanted = set(filter(None, args.shapes.split(",")))
    if wanted - names:
        parser.error(f"--shapes: unknown {sorted(wanted - names)}; known: {sorted(names)}")
    base = common.kernel_options(parser, args)
    selected = wanted or {shape_name(context, batch) for context, batch in SHAPES}
    out_path = common.out_path("tune.json")
    report = dict(common.run_info(), kernels=base.describe(), results=[])

    def record(kind, shape, variant, micros, bytes_read=None):
        row = dict(kind=kind, shape=shape, variant=variant, us=round(micros, 2))
        if bytes_read:
            row["GBps"] = round(bytes_read / micros / 1e3)
        report["results"].append(row)
        print(f"{kind:>8} {shape:>9} {variant:<34} {micros:8.1f} us"
              + (f" {row['GBps']:6d} GB/s" if bytes_read else ""), flush=True)
        # written as results arrive: a variant that fails ends the run, not its results
        common.write_json(out_path, report)

    for context, batch in SHAPES + EXTRA_SHAPES:
        if shape_name(context, batch) in selected:
            tune_shape(context, batch, kinds, args, base, record)


def tune_shape(context, batch, kinds, args, base, record):
    import torch

    import moira
    from moira import decode
    from moira.benchmarking import timeline as probes

    bench = common.graph_us
    shape = f"{context // 1024}k x{batch}"
    query, keys, values, summaries, table, seq_lens = common.step_inputs(context, batch)
    pages = context // 64
    spaces = {}

    def space(width=pages, **fields):
        """A workspace for a ``width``-page table: ``MoiraConfig(**fields)`` with ``kernels``
        (a ``common.with_kernels`` mapping) applied to the base options."""
        kernels = common.with_kernels(base, fields.pop("kernels", {}))
        key = (width, kernels, tuple(sorted(fields.items())))
        if key not in spaces:
            spaces[key] = moira.DecodeWorkspace(batch, width, KV_HEADS * GROUP, KV_HEADS,
                                                HEAD_DIM, device="cuda",
                                                config=moira.MoiraConfig(kernels=kernels,
                                                                         **fields))
        return spaces[key]

    workspace = space()
    log_masses, lists, counts = workspace.selection_buffers(batch, pages)
    scale = 1 / math.sqrt(HEAD_DIM)
    summary_bytes = common.estimate_bytes(batch * KV_HEADS, pages, summaries.element_size())
    rotation = common.estimate_rotation(summaries, table, pages, summary_bytes)

    def time_estimate(label, rotation=rotation, masses=log_masses, lens=seq_lens,
                      bytes_read=summary_bytes, backend="triton", **tuning):
        """Time Estimate on ``backend`` with ``tuning`` (``estimate.<name>`` constants; the
        sweeps are of the Triton kernel's unless ``backend`` says otherwise)."""
        ws = space(masses.shape[-1], kernels=dict(
            estimate=backend, tuning={f"estimate.{k}": v for k, v in tuning.items()}))
        micros = bench(lambda: [common.estimate(ws, query, keys, copy, rolled, lens, scale,
                                                masses)
                                for copy, rolled in rotation]) / len(rotation)
        record("estimate", shape, label, micros, bytes_read)

    blocks = [16, 32, 64] if not args.quick else [32, 64]
    for block, warps in itertools.product(blocks if "estimate" in kinds else [],
                                          [2, 4, 8] if not args.quick else [4, 8]):
        time_estimate(f"pages={block} warps={warps}", pages_per_program=block, num_warps=warps)
    # a ceiling on Estimate's registers (estimate.max_registers): more blocks per SM, the
    # last ones with spills; the default first and last
    for label, tuning in ([("default", {}), ("no register ceiling", dict(max_registers=None))]
                          + [(f"max registers {registers}"
                              + (f" pages={block}" if block != 32 else ""),
                              dict(max_registers=registers, pages_per_program=block))
                             for registers, block in [(80, 32), (72, 32), (64, 32), (96, 16),
                                                      (80, 16), (64, 16)]]
                          + [("default again", {})]) if "registers" in kinds else []:
        time_estimate(label, **tuning)
    # each head's query loaded while the previous head computes (estimate.query_head_ahead)
    # and the register ceiling against each head's query in its turn without and with it,
    # twice each in alternation
    for label, tuning in [("default", {}), ("query head in turn", dict(query_head_ahead=False)),
                          ("query head in turn no register ceiling",
                           dict(query_head_ahead=False, max_registers=None))] * 2 \
            if "query" in kinds else []:
        time_estimate(label, **tuning)
    # the exact pages' heads: chained (the default) or side by side, twice each in alternation
    for exact in ["chained", "side by side"] * 2 if kinds & {"estimate", "exact"} else []:
        time_estimate(f"exact pages {exact}", exact_pages=exact)

    # the CUDA Estimate: its log-masses against the Triton kernel's on this shape's first copy,
    # then timed at several grids (estimate.cuda_target_programs) and builds
    # (estimate.cuda_min_blocks_per_sm) between two timings of the Triton default
    if "cuda" in kinds:
        copy, rolled = rotation[0]
        outputs = {}
        for backend in ("triton", "cuda"):
            masses = torch.full_like(log_masses, float("nan"))
            common.estimate(space(kernels=dict(estimate=backend)), query, keys, copy, rolled,
                            seq_lens, scale, masses)
            outputs[backend] = masses[..., :pages]
        difference = (outputs["cuda"] - outputs["triton"]).abs().max().item()
        record("check", shape, f"cuda - triton max |log-mass| {difference:.2e}", 0.0)
        if not difference < 1e-3:  # NaN too: a page one of them did not write
            raise SystemExit(f"the CUDA Estimate differs from Triton's by {difference}")
        fits = moira.KernelOptions().value("estimate.cuda_min_blocks_per_sm")
        variants = [("triton", None, fits)] + [
            (f"cuda programs={n}", n, fits) for n in (330, 660, 1320, 2640)] + [
            ("cuda programs=660 min_blocks=0", 660, 0),
            ("cuda programs=528 min_blocks=4", 528, 4), ("triton again", None, fits)]
        for label, cuda_programs, min_blocks in variants:
            if cuda_programs:
                time_estimate(label, backend="cuda", cuda_target_programs=cuda_programs,
                              cuda_min_blocks_per_sm=min_blocks)
            else:
                time_estimate(label)

    # what fewer summary bytes could save: the CUDA Estimate as configured, and with the
    # variance lanes pointed at the mean (the summaries' stride_ss = 0), so each page's loads
    # read 256 of its 512 bytes from DRAM with the same instructions and pages (an FP8 form
    # would add its conversions: this bounds its gain; the half arm's log-masses are not
    # mvar's). Both arms rotate over the same copies, enough for the half arm to exceed the L2
    if "halfbytes" in kinds:
        half_bytes = common.estimate_bytes(batch * KV_HEADS, pages, 1)  # one byte per value
        full = common.estimate_rotation(summaries, table, pages, half_bytes)
        halved = [(copy.as_strided(copy.shape, (copy.stride(0), copy.stride(1), 0,
                                                copy.stride(3))), rolled)
                  for copy, rolled in full]
        for label, arm, arm_bytes in [("cuda", full, summary_bytes),
                                      ("cuda half summary bytes", halved, half_bytes)] * 2:
            time_estimate(label, rotation=arm, bytes_read=arm_bytes, backend="cuda")

    # what each part of the CUDA Estimate costs: the whole kernel, its exact programs alone
    # (rows x 2: the sink's, and the current page's with the step's token written, as in vLLM)
    # and its mvar programs alone (rows x J), twice each in alternation. The parts overlap in
    # the whole kernel, so they need not add up
    if kinds & {"estparts", "sumlayout", "fused", "fusedparts"}:
        cuda_estimate = space(kernels=dict(estimate="cuda"))
        new_keys = torch.randn(batch, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        last = (seq_lens.long() - 1) // 64

        def token_write(rolled):  # (new keys, new values, value cache, slots) of a table
            pages_now = rolled.long().gather(1, last[:, None])[:, 0]
            return (new_keys, new_keys, values, pages_now * 64 + (seq_lens.long() - 1) % 64)

        writes = [token_write(rolled) for _, rolled in rotation]
        for part in ["all", "exact", "mvar"] * 2 if "estparts" in kinds else []:
            micros = bench(lambda part=part: [common.estimate(
                cuda_estimate, query, keys, copy, rolled, seq_lens, scale, log_masses,
                new_kv=write, parts=part) for (copy, rolled), write in zip(rotation, writes)])
            record("estparts", shape, part, micros / len(rotation))
        # the summaries page-major ([page, head, 2, D], a row reads 512 bytes of each page's
        # 4 KB) or head-major (the same view over [head, page, 2, D] storage), each over
        # scattered and over consecutive physical pages (as a fresh engine hands out a
        # prompt's blocks); the whole kernel and its mvar part, twice in alternation
        if "sumlayout" in kinds:
            consecutive = torch.arange(batch * pages, device="cuda").view(batch, pages).int()
            head_major = [(copy.permute(1, 0, 2, 3).contiguous().permute(1, 0, 2, 3), rolled)
                          for copy, rolled in rotation]
            layouts = {"page-major": rotation, "head-major": head_major}
            tables = {"scattered": lambda rolled, i: rolled,
                      "consecutive": lambda rolled, i: consecutive.roll(i, dims=1)}
            for layout, order, part in [(layout, order, part) for layout in layouts
                                        for order in tables for part in ("all", "mvar")] * 2:
                arm = [(copy, tables[order](rolled, i))
                       for i, (copy, rolled) in enumerate(layouts[layout])]
                arm_writes = [token_write(table_now) for _, table_now in arm]
                micros = bench(lambda arm=arm, arm_writes=arm_writes, part=part: [
                    common.estimate(cuda_estimate, query, keys, copy, table_now, seq_lens,
                                    scale, log_masses, new_kv=write, parts=part)
                    for (copy, table_now), write in zip(arm, arm_writes)])
                record("sumlayout", shape, f"{layout} {order} {part}", micros / len(rotation))

    # Estimate and Select in one launch against the two CUDA kernels, as a decode step calls
    # them (the token written): coverage at 0.98 and 22% fractions, in the rows' own table and
    # in one as wide as an engine's, twice in alternation; first the lists and counts of both
    # compared on one copy
    if "fused" in kinds:
        fractions = torch.full((KV_HEADS,), 0.22, device="cuda")
        for width in sorted({pages, max(pages, args.table_pages)}):
            arm = [(copy, torch.cat([rolled, rolled.new_zeros(batch, width - pages)], 1))
                   for copy, rolled in rotation]
            masses_w, lists_w, counts_w = space(width).selection_buffers(batch, width)
            # "default": the two kernels as configured (the base options' Select)
            modes = {"off": dict(estimate="cuda", select="cuda", fused="off"),
                     "on": dict(estimate="cuda", select="cuda", fused="on"),
                     "default": dict(estimate="cuda", fused="off")}
            for mode, keep in [("coverage", None), ("fractions 22%", fractions)]:
                selection = dict(gamma=0.98, top_k=None, keep_fractions=keep, gammas=None,
                                 ways=space(width).config.bisection_ways_for(width),
                                 dense_below_pages=0, programmatic_launch=False)

                def both(fused, arm=arm, selection=selection, width=width):
                    ws = space(width, kernels=modes[fused])
                    for (copy, table_now), write in zip(arm, writes):
                        decode._estimate_and_select(query, keys, copy, table_now, seq_lens,
                                                    scale, masses_w, lists_w, counts_w, write,
                                                    selection, ws)

                outputs = {}
                for fused in ("off", "on"):
                    lists_w.fill_(-1)
                    both(fused, arm=arm[:1])
                    outputs[fused] = (lists_w.clone(), counts_w.clone())
                (lists_off, counts_off), (lists_on, counts_on) = outputs["off"], outputs["on"]
                kept = torch.arange(width, device="cuda") < counts_off[..., None]
                # Select's sums are the two kernels' in the same order only where the CUDA
                # Select's row program has the fused one's 256 threads (1,025-2,048 pages);
                # elsewhere a near-tie may part them: counted
                rows_apart = int(((counts_on != counts_off)
                                  | ((lists_on != lists_off) & kept).any(-1)).sum())
                most = int((counts_on - counts_off).abs().max())
                record("check", shape, f"fused rows apart from two kernels, {mode} "
                       f"width={width} (most pages apart {most})", rows_apart)
                for fused in ("off", "default", "on") * 2:
                    micros = bench(lambda fused=fused: both(fused)) / len(arm)
                    record("fused", shape, f"{mode} width={width} fused {fused}", micros)

    # where a fused program's time goes (its timeline probe): one launch in a table as wide
    # as an engine's at 22% fractions, the token written; medians over the programs of each
    # phase (µs), the launch's span and its programs' start spread
    if "fusedparts" in kinds:
        width = max(pages, args.table_pages)
        fused_space = space(width, kernels=dict(estimate="cuda", select="cuda", fused="on"))
        masses_w, lists_w, counts_w = fused_space.selection_buffers(batch, width)
        selection = dict(gamma=0.98, top_k=None,
                         keep_fractions=torch.full((KV_HEADS,), 0.22, device="cuda"),
                         gammas=None, ways=fused_space.config.bisection_ways_for(width),
                         dense_below_pages=0, programmatic_launch=False)
        buffer = torch.full((batch * KV_HEADS, probes.FIELDS), -1, dtype=torch.int64,
                            device="cuda")
        phases = {}
        for i, ((copy, rolled), write) in enumerate(zip(rotation, writes)):
            table_now = torch.cat([rolled, rolled.new_zeros(batch, width - pages)], 1)
            with probes.recording("estimate_select", buffer):
                decode._estimate_and_select(query, keys, copy, table_now, seq_lens, scale,
                                            masses_w, lists_w, counts_w, write, selection,
                                            fused_space)
            torch.cuda.synchronize()
            if i == 0:  # the first launch builds and loads the probe's kernel
                continue
            t = (buffer - buffer[:, 0].min()).double().cpu() / 1e3
            parts = {"start": t[:, 0], "token": t[:, 1] - t[:, 0],
                     "exact sink": t[:, 2] - t[:, 1], "mvar group 0": t[:, 3] - t[:, 2],
                     "exact current": t[:, 4] - t[:, 1], "mvar group 1": t[:, 5] - t[:, 4],
                     "barrier": t[:, 6] - t[:, [3, 5]].max(1).values,
                     "select": t[:, 7] - t[:, 6], "program": t[:, 7] - t[:, 0]}
            for name, phase in parts.items():
                phases.setdefault(name, []).append(float(phase.median()))
            phases.setdefault("span", []).append(float(t[:, 7].max()))
        for name, phase in phases.items():
            record("fusedparts", shape, f"{name} (median of {len(phase)} launches)",
                   sorted(phase)[len(phase) // 2])

    top_k = round(0.22 * pages)
    ways = workspace.config.bisection_ways_for(pages)

    def select_modes(label, masses=log_masses, width=pages, out_lists=lists,
                     out_counts=counts, backend="triton", ways=None, **tuning):
        """Time Select in coverage mode and at 22% fixed counts on ``backend`` with ``tuning``
        (``select.<name>``) and K_B ``ways`` (default: the configuration's)."""
        ws = space(width, kernels=dict(select=backend, tuning={f"select.{k}": v
                                                               for k, v in tuning.items()}))
        for mode, kwargs in [("coverage", dict(gamma=0.98, top_k=None)),
                             ("top22%", dict(gamma=0.98, top_k=top_k))]:
            micros = bench(lambda: common.select(ws, masses, seq_lens, out_lists, out_counts,
                                                 max_pages=width, ways=ways, **kwargs))
            record("select", shape, f"{mode}{label}", micros)

    select_warps = QUICK_SELECT_WARPS if args.quick else SELECT_WARPS
    # wider passes need more threads to hold the [K_B, pages] comparison tile
    for k_b, warps in itertools.product([2, 4, 8, 16] if "select" in kinds else [],
                                        select_warps):
        ws = space(kernels=select_kernels(warps))
        micros = bench(lambda: common.select(ws, log_masses, seq_lens, lists, counts,
                                             max_pages=pages, ways=k_b, gamma=0.98,
                                             top_k=None))
        record("select", shape, f"coverage K_B={k_b} warps={warps}", micros)
    # forced warps against the default's (by the table's width), timed first and last; one
    # warp keeps every reduction within the warp (no block barrier)
    for label, warps in ([(" default", 0)] + [(f" warps={w}", w) for w in select_warps]
                         + [(" default again", 0)]) if "select" in kinds else []:
        select_modes(label, num_warps=warps)
    # a row's G softmaxes head by head (0) or side by side in one tile
    for tile in [0, 1 << 14] if "select" in kinds else []:
        select_modes(f" softmax tile {tile}", softmax_tile=tile)

    # the CUDA Select, with the configured K_B, with 16 and with 64 (binned passes): its page
    # counts against the Triton kernel's in both modes (coverage may differ by pages at the
    # threshold, fixed counts not at all), then all timed, twice in alternation
    if "cuda" in kinds:
        common.estimate(workspace, query, keys, summaries, table, seq_lens, scale, log_masses)
        for mode, kwargs in [("coverage", dict(gamma=0.98, top_k=None)),
                             ("top22%", dict(gamma=0.98, top_k=top_k))]:
            found = {}
            for label, backend, k_b in [("triton", "triton", ways), ("cuda", "cuda", ways),
                                        ("cuda K_B=16", "cuda", 16),
                                        ("cuda binned", "cuda", 64)]:
                counts.fill_(-1)
                common.select(space(kernels=dict(select=backend)), log_masses, seq_lens, lists,
                              counts, max_pages=pages, ways=k_b, **kwargs)
                found[label] = counts.clone()
            for label in ("cuda", "cuda K_B=16", "cuda binned"):
                differing = (found[label] - found["triton"]).abs().max().item()
                record("check", shape, f"select {mode} {label} - triton max |count| {differing}",
                       0.0)
        for label, backend, k_b in [("", "triton", None), (" cuda", "cuda", None),
                                    (" cuda K_B=16", "cuda", 16),
                                    (" cuda binned", "cuda", 64)] * 2:
            select_modes(label, backend=backend, ways=k_b)

    # the 22% lists from this shape's own estimates (whichever kinds ran before)
    common.estimate(workspace, query, keys, summaries, table, seq_lens, scale, log_masses)
    common.select(workspace, log_masses, seq_lens, lists, counts, max_pages=pages, gamma=0.98,
                  top_k=top_k, ways=ways)
    sparse_lists, sparse_counts = lists.clone(), counts.clone()
    sparse_bytes = int(sparse_counts.sum()) * PAGE_KV_BYTES
    full_lists = torch.arange(pages, device="cuda", dtype=torch.int32).expand(
        batch, KV_HEADS, pages).contiguous()
    full_counts = torch.full((batch, KV_HEADS), pages, device="cuda", dtype=torch.int32)
    out = torch.empty_like(query)

    def attend(ws, page_lists=sparse_lists, page_counts=sparse_counts):
        return bench(lambda: moira.attend(query, keys, values, table, seq_lens, page_lists,
                                          page_counts, workspace=ws, out=out))

    def triton_attend(**tuning):
        return dict(attend="triton", tuning={f"attend.{k}": v for k, v in tuning.items()})

    variants = itertools.product([4, 8, 16, 24], [4096, 16384], [(4, 2), (4, 3), (8, 2)])
    if args.quick:
        variants = [(c, n, (4, 3)) for c in (4, 8, 16, 24) for n in (4096, 16384)]
        variants += [(8, 4096, (4, 2)), (16, 4096, (4, 2)), (24, 4096, (4, 2)),
                     (24, 4096, (4, 4)), (32, 4096, (4, 3))]
        # J = N_J (32) at 32-64 rows: the small-batch split (floor_rows 96, min_programs 1)
        variants += [(8, 1, (4, 2)), (16, 1, (4, 2))]
    for chunk, min_programs, (warps, stages) in variants if "attend" in kinds else []:
        # J from N_T alone, as the arm's name says (the ceiling on J lifted); the Triton
        # kernel's warps and stages
        ws = space(chunk_pages=chunk, min_programs=min_programs,
                   max_chunks_per_row=max(min_programs, 32),
                   kernels=triton_attend(num_warps=warps, num_stages=stages))
        name = f"C={chunk} N_T={min_programs} warps={warps} stages={stages}"
        record("attend22", shape, name, attend(ws), sparse_bytes)
        if chunk == 24 and min_programs == 4096:
            record("attend100", shape, name, attend(ws, full_lists, full_counts),
                   batch * KV_HEADS * pages * PAGE_KV_BYTES)
    # several listed pages per inner-loop tile: more loads in flight per program
    for per_tile, warps, stages in itertools.product([1, 2, 4] if "tiles" in kinds else [],
                                                     [4, 8], [2, 3]):
        ws = space(kernels=triton_attend(pages_per_iter=per_tile, num_warps=warps,
                                         num_stages=stages))
        record("attend22", shape, f"pages/tile={per_tile} warps={warps} stages={stages}",
               attend(ws), sparse_bytes)
    # Attend under a register ceiling (attend.max_registers): one page per tile halves its
    # shared memory, so that registers decide its blocks per SM; the default first and last
    for label, tuning in ([("default", {})] + [
            (f"pages/tile={per_tile} stages={stages} max registers {registers}",
             dict(pages_per_iter=per_tile, num_stages=stages, max_registers=registers))
            for per_tile, stages, registers in [(1, 2, None), (1, 2, 128), (1, 2, 96),
                                                (1, 3, 128), (1, 3, 96)]]
            + [("default again", {})]) if "registers" in kinds else []:
        record("attend22", shape, label, attend(space(kernels=triton_attend(**tuning))),
               sparse_bytes)
    # the balanced global split: programs P and minimum pages per program C
    for programs, floor in itertools.product(
            [264, 528, 792, 1056, 1584, 2112] if "balanced" in kinds else [], [4, 8, 16]):
        ws = space(schedule="balanced", programs=programs, chunk_pages=floor)
        record("attend22", shape, f"balanced P={programs} C={floor}", attend(ws), sparse_bytes)
    # time against bytes: Attend + Merge at several fixed fractions of every row; the
    # intercept of time over bytes is the fixed cost per layer (launches, ramp, Merge)
    for fraction in [0.05, 0.11, 0.22, 0.44, 1.0] if "fractions" in kinds else []:
        count = max(2, round(fraction * pages))
        common.select(workspace, log_masses, seq_lens, lists, counts, max_pages=pages,
                      gamma=0.98, top_k=count, ways=ways)
        record("fraction", shape, f"{fraction:.0%} ({count} pages/row)",
               attend(workspace, lists, counts), batch * KV_HEADS * count * PAGE_KV_BYTES)

    def padded(width):
        """The block table padded to ``width`` columns, as in an engine whose longest admitted
        context is that many pages."""
        return torch.cat([table, torch.zeros(batch, width - pages, dtype=table.dtype,
                                             device="cuda")], dim=1)

    if "wide" in kinds and args.table_pages > pages:
        # the engine's view: every row's table padded to the longest admitted context, so
        # grids sized by the width launch programs that find nothing to do
        width = args.table_pages
        wide_table = padded(width)
        wide_masses, wide_lists, wide_counts = space(width).selection_buffers(batch, width)
        name = f"table {width} pages"
        # each kernel in Triton and in CUDA C++ (whose "auto" rule goes by the width, the only
        # length the host knows), then the step with each pair, twice in alternation
        wide_rotation = common.estimate_rotation(summaries, wide_table, pages, summary_bytes)
        for backend in ("triton", "cuda") * 2:
            time_estimate(f"{name} {backend}", masses=wide_masses, rotation=wide_rotation,
                          backend=backend)
            select_modes(f", {name} {backend}", wide_masses, width, wide_lists, wide_counts,
                         backend=backend)
        for estimate_kernel, select_kernel in [("triton", "triton"), ("cuda", "triton"),
                                               ("triton", "cuda"), ("cuda", "cuda")] * 2:
            ws = space(width, kernels=dict(estimate=estimate_kernel, select=select_kernel))
            micros = bench(lambda: moira.sparse_decode(query, keys, values, summaries,
                                                       wide_table, seq_lens, top_k=top_k,
                                                       workspace=ws, out=out))
            record("step22", shape, f"estimate+select+attend+merge, {name}, "
                   f"{estimate_kernel} estimate, {select_kernel} select", micros,
                   sparse_bytes + summary_bytes)
    # the Triton Select's warps and softmax form in the whole step, where its code comes cold
    # from HBM (Attend's K/V evict it from the L2): more warps, fewer straight-line
    # instructions per thread; against the CUDA Select, in the shape's own table and in a
    # --table-pages one, twice in alternation
    widths = [pages] + ([args.table_pages] if args.table_pages > pages else [])
    for width in widths if "selectwarps" in kinds else []:
        padded_table = padded(width) if width > pages else table
        for label, kernels, config in step_select_arms() * 2:
            ws = space(width, kernels=kernels, **config)
            for mode, k in (("fixed 22%", top_k), ("coverage", None)):
                micros = bench(lambda: moira.sparse_decode(query, keys, values, summaries,
                                                           padded_table, seq_lens, top_k=k,
                                                           workspace=ws, out=out))
                record("step", shape, f"{mode}, table {width} pages, {label} select", micros)
    if "step" in kinds:
        # a row's chunks made equal and Eq. (4)'s as is (the Triton Attend's option)
        for even in (True, False):
            record("attend22", shape, "equal chunks" if even else "Eq. (4) chunks as is",
                   attend(space(kernels=triton_attend(even_chunks=even))), sparse_bytes)
        micros = bench(lambda: moira.sparse_decode(query, keys, values, summaries, table,
                                                   seq_lens, top_k=top_k, workspace=workspace,
                                                   out=out))
        record("step22", shape, "estimate+select+attend+merge, defaults", micros,
               sparse_bytes + summary_bytes)
    # the whole step (fixed 22%) with the CUDA Estimate and Select, each alone and both,
    # against the Triton kernels, twice in alternation
    for label, (estimate_kernel, select_kernel) in [
            ("triton", ("triton", "triton")), ("cuda estimate", ("cuda", "triton")),
            ("cuda select", ("triton", "cuda")), ("cuda both", ("cuda", "cuda"))] * 2 \
            if "cuda" in kinds else []:
        ws = space(kernels=dict(estimate=estimate_kernel, select=select_kernel))
        micros = bench(lambda: moira.sparse_decode(query, keys, values, summaries, table,
                                                   seq_lens, top_k=top_k, workspace=ws,
                                                   out=out))
        record("step22", shape, f"estimate+select+attend+merge, {label}", micros,
               sparse_bytes + summary_bytes)
    # where the CUDA Select's gain in the step comes from: per Select, the step's parts in the
    # step's buffers, alone and in sequence (Attend + Merge alone on the lists that Select
    # left), twice in alternation
    if "cuda" in kinds:
        triton_estimate = space(kernels=dict(estimate="triton"))

        def estimate_step():
            common.estimate(triton_estimate, query, keys, summaries, table, seq_lens, scale,
                            log_masses)

        def attend_step():
            moira.attend(query, keys, values, table, seq_lens, lists, counts,
                         workspace=workspace, out=out)

        estimate_step()
        for backend in ("triton", "cuda") * 2:
            select_space = space(kernels=dict(select=backend))

            def select_step(select_space=select_space):
                common.select(select_space, log_masses, seq_lens, lists, counts,
                              max_pages=pages, gamma=0.98, top_k=top_k, ways=ways)

            select_step()  # the lists Attend alone reads
            parts = [("select", select_step), ("attend+merge", attend_step),
                     ("estimate, select", lambda: (estimate_step(), select_step())),
                     ("select, attend+merge", lambda: (select_step(), attend_step()))]
            for label, fn in parts:
                record("parts", shape, f"{label}, {backend} select", bench(fn))


if __name__ == "__main__":
    main()
