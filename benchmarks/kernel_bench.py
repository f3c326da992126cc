"""Moira's kernels on one GPU, outside vLLM: Llama-3.1-8B geometry (8 KV heads, G = 4,
head_dim 128, bf16, 64-token pages), caches far larger than the L2, medians of CUDA-graph
replays. Every routine takes ``--kernels`` (``moira.KernelOptions``' text form, e.g.
``attend=cuda,attend.cuda_stages=3``) for the workspaces it builds.

    PYTHONPATH=. python3 benchmarks/kernel_bench.py suite [--shapes 8k32,32k16] [--arms ...]
    PYTHONPATH=. python3 benchmarks/kernel_bench.py single [--contexts 2048,8192] [--gemm] ...
    PYTHONPATH=. python3 benchmarks/kernel_bench.py cache-write
    PYTHONPATH=. python3 benchmarks/kernel_bench.py estimators [--shapes 8k32]
    PYTHONPATH=. python3 benchmarks/kernel_bench.py timeline [--shapes 8k32] [--variants ...]
    PYTHONPATH=. ncu ... python3 benchmarks/kernel_bench.py profile [--shapes 131072x4]
    python3 benchmarks/kernel_bench.py single|cache-write|timeline --plot RESULT.json  # PNG again

Results go to ``$OUT`` (``kernels.json``, ``single.json``, ``cache-write.json``,
``estimators.json``, ``timeline.json``) as they arrive; ``report.py kernels`` / ``report.py
single`` tabulate them.

suite: one decode layer per shape (context x batch: 8k32, 32k16, 64k8, 131k4; 16k32 when
named) and spread of list lengths (CV of the per-(request, KV head) page counts at a mean of
22% of each row's pages, and a "real-like" spread: 8 layers with means from 9% to 68% and CV
0.7 across rows); every arm reads the same page lists:

- ``moira``          Attend + Merge on vLLM's cache layout (NHD, ``[pages, 64, Hkv, D]``).
- ``moira_balanced`` the same with ``MoiraConfig(schedule="balanced")``.
- ``moira_hnd``      the same on the head-major layout the folded peers read.
- ``moira_packed``, ``moira_packed_hnd``: ``moira`` on vLLM's own K|V cache tensors
                     (``[pages, 64, Hkv, 2 D]``, and ``VLLM_KV_CACHE_LAYOUT=HND``'s
                     ``[pages, Hkv, 64, 2 D]``); before the options below too.
- ``moira_eq4``, ``moira_t128``: the short-row floor off (``step_programs=0``) and at T = 128.
- ``moira_c<N>``     Eq. (4)'s chunk floor C = N pages (``chunk_pages``).
- ``moira_ahead<P><S>[w<warps>]``  the Triton Attend with each tile's page ids loaded a tile
                     ahead, P pages per tile, S pipeline stages, that many warps
                     (``attend.page_ids_ahead``, ``attend.pages_per_iter``, ``attend.num_stages``,
                     ``attend.num_warps``); after a floor too, ``moira_c32_ahead13``.
- ``moira_cuda<S>``  the CUDA Attend with S pages in flight (``attend.cuda_stages``, 2-4).
- ``moira_triton``   the Triton Attend.
- ``fa3_varlen``     vLLM's FA3, each (request, KV head) row its own sequence over the HND
                     cache (scheduler metadata built beforehand, ``fa3_metadata`` timed apart;
                     ``fa3_varlen_inline`` lets the call build it).
- ``pad``, ``pow2``  Moira's kernel on lists padded to the longest row / the next power of two
                     (the padding read like real pages; ``tbps`` counts the selected bytes).
- ``flashinfer``     FlashInfer's batch decode (tensor cores) on the folded rows;
                     ``flashinfer_plan`` its host ``plan()`` with the counts' copy to the host.
- ``flex``           PyTorch FlexAttention (compiled) with a block mask of 64-token blocks.
- ``dense_fa3``      FA3 over every page: ``rel_bw`` of an arm = its bytes per second over
                     dense FA3's.

Per shape also Estimate (rotating over summaries that exceed twice the L2, as consecutive
layers' do), Select (coverage 0.98 and fixed 22%) and the whole step (fixed 22%) in one CUDA
graph, every row one token short of a full page. Every arm's output is checked against
``moira``'s (``checks``).

single: a single request's decode step (and ``--batches`` small ones), 32 layers of own caches
per CUDA graph, per-layer µs: ``fa3_dense``, ``estimate``, ``select``, ``attend_merge``,
``step`` (``sparse_decode``), ``step_full_rows`` (rows read in full, as the plugin's
``dense_below_tokens`` does), ``*_c2`` (chunk floor 2), ``step_floor_off``; on the Triton
Estimate, Select and Attend (the only ones programmatic launch chains; the CUDA Estimate and
Attend launch plainly): ``*_triton`` launched plainly, ``*_pdl`` (programmatic dependent
launch, every kernel chained across layers: an upper bound on its gain in vLLM),
``*_pdl_no_attend`` (Estimate, Select and Merge chained, Attend launched plainly) and
``*_pdl_est_sel`` (Estimate and Select only; ``launch.chained``); ``--split-sweep`` /
``--programs-sweep`` Attend's split; ``--gemm`` each arm also with the MLP's gate/up GEMM
after every layer (``<arm>+gemm``, ``gemm_only``, and with ``--gemm-profile`` the GEMM's own
per-call times; ``--gemm-probes`` arms that only write, read or gather memory before it);
``--spread`` the plugin's per-(layer, KV head) fractions.

cache-write: Estimate with the decode token's K/V write in its launch (``fused``) against
Estimate alone and a separate write before it, in a 2,048-page table.

estimators: per shape and estimator (``MoiraConfig.estimator``: mvar, int2, int4), Estimate
alone (rotating over summaries that exceed twice the L2), Estimate then the coverage Select,
and the whole step at 22% of the pages, against dense FA3 in the same run: what reading the
codes costs per layer, to weigh against the pages a better estimate saves.

timeline: the CUDA Attend's timeline probe (``moira.benchmarking.timeline``): per program its
start, first page landed, end and SM; from them the bytes' arrival rate, ramp, tail and
spread, per variant (``grid<C>[s<S>][j<J>][w<pages>]``).

profile: one launch of each kernel per shape (twice: the first compiles) for Nsight Compute::

    ncu --clock-control none -k regex:"estimate|select|attend|merge" --section SpeedOfLight \\
        python3 benchmarks/kernel_bench.py profile
"""

import argparse
import dataclasses
import gzip
import json
import math
import os
import re
import statistics
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
from common import GROUP, HEAD_DIM, KV_HEADS, PAGE, PAGE_BYTES, tbps  # noqa: E402

SHAPES = {"8k32": (8192, 32), "32k16": (32768, 16), "64k8": (65536, 8), "131k4": (131072, 4)}
# timed only when named in --shapes: 16k x 32, whose rows (256 pages) the chunk floor cuts
# into a few chunks
EXTRA_SHAPES = {"16k32": (16384, 32)}
CVS = [0.0, 0.5, 1.0, 1.2]
MEAN_FRACTION = 0.22
REAL_LAYERS = 8  # real-like spread: per-layer means 9% .. 68% (geometric), CV 0.7 across rows
REAL_MEANS = [0.09 * (0.68 / 0.09) ** (i / (REAL_LAYERS - 1)) for i in range(REAL_LAYERS)]
# outputs of random attention are below 1 in magnitude, where two bf16 ulps are at most 2^-7:
# two correct kernels that only round differently stay within it
CHECK_TOLERANCE = 2 ** -7


def workspace(batch, pages, config=None, rows_as_requests=False):
    """A ``DecodeWorkspace`` of this geometry (``rows_as_requests``: KV heads folded into the
    batch, one KV head per request)."""
    import moira

    if rows_as_requests:
        return moira.DecodeWorkspace(batch * KV_HEADS, pages, GROUP, 1, HEAD_DIM, device="cuda",
                                     config=config)
    return moira.DecodeWorkspace(batch, pages, KV_HEADS * GROUP, KV_HEADS, HEAD_DIM,
                                 device="cuda", config=config)


def config_with(options, config=None):
    """``config`` (default ``MoiraConfig()``) with ``options`` as its kernels."""
    import moira

    return (config or moira.MoiraConfig()).replace(kernels=options)


# ============================================================================================
# suite
# ============================================================================================

ARMS = {"moira", "moira_balanced", "moira_hnd", "moira_eq4", "moira_t128", "fa3_varlen", "pad",
        "pow2", "flashinfer", "flex"}

# the configured arms of ``moira``: vLLM's packed caches, a chunk floor, the CUDA Attend or
# the Triton one (with its page ids a tile ahead), or several of them
CONFIGURED_ARM = re.compile(r"moira(_packed(?:_hnd)?)?(?:_c([1-9][0-9]*))?"
                            r"(?:_cuda([2-4])|_(triton)|_ahead([124])([1-8])(?:w([48]))?)?")


def cache_layout(arm):
    """"packed" or "packed_hnd" for an arm on vLLM's packed K|V caches, else None."""
    configured = CONFIGURED_ARM.fullmatch(arm)
    return configured.group(1)[1:] if configured and configured.group(1) else None


def config_fields(arm):
    """``MoiraConfig`` fields of an arm that runs ``moira`` under another configuration
    (``moira_eq4``, ``moira_t128``, ``moira_c<N>``; the kernel arms, ``arm_kernels``, and the
    packed layouts, ``cache_layout``: the default's fields); None for any other arm."""
    if arm == "moira_eq4":
        return dict(step_programs=0)
    if arm == "moira_t128":
        return dict(step_programs=128)
    configured = CONFIGURED_ARM.fullmatch(arm)
    if not configured or arm == "moira":
        return None
    chunk = configured.group(2)
    return dict(chunk_pages=int(chunk)) if chunk else {}


def arm_kernels(arm):
    """``KernelOptions`` fields of a configured arm's Attend (``_cuda<S>``: the CUDA Attend
    with S pages in flight; ``_triton``: the Triton one; ``_ahead<P><S>[w<warps>]``: the
    Triton one with page ids a tile ahead, P pages per tile, S stages, that many warps); {}
    for any other arm."""
    configured = CONFIGURED_ARM.fullmatch(arm)
    if not configured:
        return {}
    cuda_stages, triton, pages, stages, warps = configured.groups()[2:]
    if cuda_stages:
        return dict(attend="cuda", tuning={"attend.cuda_stages": int(cuda_stages)})
    if triton:
        return dict(attend="triton")
    if not pages:
        return {}
    tuning = {"attend.page_ids_ahead": True, "attend.pages_per_iter": int(pages),
              "attend.num_stages": int(stages)}
    if warps:
        tuning["attend.num_warps"] = int(warps)
    return dict(attend="triton", tuning=tuning)


def page_ranks(rows, pages, generator):
    """A random priority of every page per row; the sink (0) and current (last) pages first."""
    import torch

    keys = torch.rand(rows, pages, generator=generator)
    keys[:, 0], keys[:, -1] = -2.0, -1.0
    return keys.argsort(dim=1).argsort(dim=1).cuda()


def lists_from(ranks, counts):
    """[rows, pages] int32 ascending logical pages of rank < count; the tail holds ``pages``."""
    import torch

    pages = ranks.shape[1]
    positions = torch.arange(pages, device=ranks.device).expand_as(ranks)
    keep = ranks < counts[:, None]
    return torch.where(keep, positions, pages).sort(dim=1).values.int()


def layer_lists(pages, rows, mean, cv, seed):
    """One layer's page lists at a mean fraction and CV, and the padded forms (``pad``,
    ``pow2``)."""
    import torch

    from moira.synthetic import spread_fractions

    generator = torch.Generator().manual_seed(seed)
    fractions = spread_fractions(rows, mean, cv, generator)
    counts = (fractions * pages).round().clamp(2, pages).to(torch.int32).cuda()
    ranks = page_ranks(rows, pages, generator)
    longest = counts.max()
    pow2 = torch.minimum(2 ** torch.ceil(torch.log2(counts.double())), torch.tensor(
        pages, dtype=torch.float64, device="cuda")).int()
    return dict(counts=counts, lists=lists_from(ranks, counts),
                pad_counts=torch.full_like(counts, int(longest)),
                pad_lists=lists_from(ranks, torch.full_like(counts, int(longest))),
                pow2_counts=pow2, pow2_lists=lists_from(ranks, pow2))


class Shape:
    """One layer of ``batch`` requests of ``context`` tokens: caches in vLLM's layout and the
    head-major copy, a random block table, workspaces under ``options``."""

    def __init__(self, context, batch, options=None):
        import torch

        import moira

        self.context, self.batch = context, batch
        self.options = options or moira.KernelOptions()
        self.pages = context // PAGE
        self.rows = batch * KV_HEADS
        total = batch * self.pages
        gen = torch.Generator(device="cuda").manual_seed(context + batch)
        dt = torch.bfloat16
        # vLLM's layout [pages, 64, Hkv, D], and the head-major copy the folded peers need
        self.key_nhd = torch.randn(total, PAGE, KV_HEADS, HEAD_DIM, device="cuda", dtype=dt,
                                   generator=gen)
        self.value_nhd = torch.randn_like(self.key_nhd)
        self.key_hnd = self.key_nhd.transpose(1, 2).contiguous()  # [pages, Hkv, 64, D]
        self.value_hnd = self.value_nhd.transpose(1, 2).contiguous()
        self.table = torch.randperm(total, device="cuda", generator=gen).view(
            batch, self.pages).int()
        self.seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        self.query = torch.randn(batch, KV_HEADS * GROUP, HEAD_DIM, device="cuda", dtype=dt,
                                 generator=gen)
        self.scale = 1 / math.sqrt(HEAD_DIM)
        # folded view: row r = b * Hkv + h is a request of one KV head
        self.query_f = self.query.view(self.rows, GROUP, HEAD_DIM)
        self.key_f = self.key_hnd.view(total * KV_HEADS, PAGE, 1, HEAD_DIM)
        self.value_f = self.value_hnd.view(total * KV_HEADS, PAGE, 1, HEAD_DIM)
        heads = torch.arange(KV_HEADS, device="cuda", dtype=torch.int32)
        self.table_f = (self.table[:, None, :] * KV_HEADS + heads[None, :, None]).view(
            self.rows, self.pages)
        self.seq_lens_f = self.seq_lens.repeat_interleave(KV_HEADS)
        base = config_with(self.options)
        self.workspace = workspace(batch, self.pages, base)
        self.workspace_f = workspace(batch, self.pages, base, rows_as_requests=True)
        self.workspace_balanced = workspace(batch, self.pages, base.replace(schedule="balanced"))
        self.packed = {}  # moira_packed's caches, made on first use
        self.workspaces = {}  # an arm's configuration -> its workspace, built when asked
        self.out = torch.empty_like(self.query)

    def arm_workspace(self, arm):
        """The workspace of one of Moira's configured arms (``config_fields``,
        ``arm_kernels``)."""
        import moira

        fields = dict(config_fields(arm) or {},
                      kernels=common.with_kernels(self.options, arm_kernels(arm)))
        key = tuple(sorted(fields.items()))
        if key not in self.workspaces:
            self.workspaces[key] = workspace(self.batch, self.pages, moira.MoiraConfig(**fields))
        return self.workspaces[key]

    def kv_bytes(self, counts):
        return int(counts.sum()) * PAGE_BYTES

    def physical_f(self, lists, counts):
        """Folded physical page ids of each row's list (0 past the count)."""
        import torch

        valid = torch.arange(lists.shape[1], device="cuda")[None, :] < counts[:, None]
        ids = torch.gather(self.table_f, 1, lists.clamp(max=self.pages - 1).long())
        return torch.where(valid, ids, 0).int()

    # ---- arms: each returns a no-argument callable writing its output ------------------------

    def moira(self, lists, counts, workspace=None, caches=None):
        """``caches``: (keys, values, out) other than the default's (``packed_caches``)."""
        import moira

        keys, values, out = caches or (self.key_nhd, self.value_nhd, self.out)
        lists3 = lists.view(self.batch, KV_HEADS, -1)
        counts2 = counts.view(self.batch, KV_HEADS)
        return lambda: moira.attend(self.query, keys, values, self.table, self.seq_lens, lists3,
                                    counts2, scale=self.scale,
                                    workspace=workspace or self.workspace, out=out)

    def moira_configured(self, arm, lists, counts):
        """``moira`` as one of its configured arms runs it: on that arm's caches
        (``cache_layout``), with its workspace (its configuration and kernel options)."""
        layout = cache_layout(arm)
        return self.moira(lists, counts, self.arm_workspace(arm),
                          self.packed_caches(layout) if layout else None)

    def moira_hnd(self, lists, counts):
        import torch

        import moira

        lists3, counts2 = lists.view(self.rows, 1, -1), counts.view(self.rows, 1)
        out = torch.empty_like(self.query_f)
        return lambda: moira.attend(self.query_f, self.key_f, self.value_f, self.table_f,
                                    self.seq_lens_f, lists3, counts2, scale=self.scale,
                                    workspace=self.workspace_f, out=out)

    def packed_caches(self, layout):
        """(keys, values, out) on a packed K|V copy of the cache (``cache_layout``: "packed" or
        "packed_hnd"), made on first use: one more copy of K and V on the GPU."""
        import torch

        if layout not in self.packed:
            if layout == "packed_hnd":  # [pages, Hkv, 64, 2D], viewed as [pages, 64, Hkv, 2D]
                kv = torch.cat([self.key_hnd, self.value_hnd], -1).transpose(1, 2)
            else:
                kv = torch.cat([self.key_nhd, self.value_nhd], -1)
            self.packed[layout] = (kv[..., :HEAD_DIM], kv[..., HEAD_DIM:],
                                   torch.empty_like(self.query))
        return self.packed[layout]

    def fa3_inputs(self, lists, counts):
        import torch

        seqused = (counts * PAGE).int()
        cu_q = torch.arange(self.rows + 1, device="cuda", dtype=torch.int32)
        return dict(table=self.physical_f(lists, counts), seqused=seqused, cu_q=cu_q,
                    max_k=int(counts.max()) * PAGE)

    def fa3_metadata(self, fa, inputs):
        import torch

        return lambda: fa.get_scheduler_metadata(
            self.rows, 1, inputs["max_k"], GROUP, 1, HEAD_DIM, inputs["seqused"],
            qkv_dtype=torch.bfloat16, cu_seqlens_q=inputs["cu_q"], page_size=PAGE,
            causal=True)

    def fa3_varlen(self, fa, inputs, metadata):
        import torch

        out = torch.empty_like(self.query_f)
        return lambda: fa.flash_attn_varlen_func(
            self.query_f, self.key_f, self.value_f, 1, inputs["cu_q"], inputs["max_k"],
            seqused_k=inputs["seqused"], softmax_scale=self.scale, causal=True,
            block_table=inputs["table"], scheduler_metadata=metadata, fa_version=3, out=out)

    def dense_fa3(self, fa, num_splits):
        import torch

        cu_q = torch.arange(self.batch + 1, device="cuda", dtype=torch.int32)
        metadata = fa.get_scheduler_metadata(
            self.batch, 1, self.context, KV_HEADS * GROUP, KV_HEADS, HEAD_DIM, self.seq_lens,
            qkv_dtype=torch.bfloat16, cu_seqlens_q=cu_q, page_size=PAGE, causal=True,
            num_splits=num_splits)
        return lambda: fa.flash_attn_varlen_func(
            self.query, self.key_nhd, self.value_nhd, 1, cu_q, self.context,
            seqused_k=self.seq_lens, softmax_scale=self.scale, causal=True,
            block_table=self.table, scheduler_metadata=metadata, num_splits=num_splits,
            fa_version=3, out=self.out)

    def flashinfer(self, flashinfer, lists, counts):
        """(run callable, host plan callable)."""
        import torch

        buffer = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(buffer, "HND",
                                                                use_tensor_cores=True)
        physical = self.physical_f(lists, counts)
        valid = torch.arange(physical.shape[1], device="cuda")[None, :] < counts[:, None]
        indices = physical[valid].int()  # row-major: each row's pages in order
        last_page_len = torch.full((self.rows,), PAGE, dtype=torch.int32, device="cuda")
        cache = (self.key_hnd.view(-1, 1, PAGE, HEAD_DIM),
                 self.value_hnd.view(-1, 1, PAGE, HEAD_DIM))

        def plan():
            counts_host = counts.cpu()  # the device-to-host copy a host plan needs
            indptr = torch.zeros(self.rows + 1, dtype=torch.int32)
            torch.cumsum(counts_host, 0, out=indptr[1:])
            wrapper.plan(indptr, indices, last_page_len, GROUP, 1, HEAD_DIM, PAGE,
                         q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16,
                         sm_scale=self.scale)

        plan()
        out = torch.empty_like(self.query_f)
        return (lambda: wrapper.run(self.query_f, cache, out=out)), plan

    def flex(self, flex_attention, block_mask_cls, lists, counts):
        import torch

        tokens = self.key_f.shape[0] * PAGE
        # every row sees the whole folded cache (stride-0 batch); its block mask picks its pages
        key = self.key_f.view(1, 1, tokens, HEAD_DIM).expand(self.rows, 1, tokens, HEAD_DIM)
        value = self.value_f.view(1, 1, tokens, HEAD_DIM).expand(self.rows, 1, tokens, HEAD_DIM)
        query = self.query_f.view(self.rows, GROUP, 1, HEAD_DIM)
        # FlexAttention wants kv_indices as wide as the KV sequence has blocks
        blocks = self.key_f.shape[0]
        physical = torch.zeros(self.rows, 1, 1, blocks, dtype=torch.int32, device="cuda")
        physical[:, 0, 0, :lists.shape[1]] = self.physical_f(lists, counts)
        mask = block_mask_cls.from_kv_blocks(
            torch.zeros(self.rows, 1, 1, dtype=torch.int32, device="cuda"),
            torch.zeros_like(physical),
            full_kv_num_blocks=counts.view(self.rows, 1, 1).int(),
            full_kv_indices=physical, BLOCK_SIZE=(PAGE, PAGE), seq_lengths=(1, tokens),
            compute_q_blocks=False)
        return lambda: flex_attention(query, key, value, block_mask=mask, scale=self.scale,
                                      enable_gqa=True)


def record_check(report, shape_name, tag, arm, fn, reference):
    """One arm's output (``fn()``, any shape of ``reference``'s elements) against Moira's
    ``reference`` ``[rows, G, D]`` float32: a ``report["checks"]`` entry, and a line."""
    try:
        result = fn().reshape(reference.shape).float()
        diff = (result - reference).abs().max().item()
        agrees = diff <= CHECK_TOLERANCE
        report["checks"].append(dict(shape=shape_name, spread=tag, arm=arm,
                                     max_abs_diff_to_moira=diff, agrees=agrees))
        print(f"check {shape_name} {tag} {arm}: max |diff| to moira {diff:.2e}"
              + ("" if agrees else f" > {CHECK_TOLERANCE:.1e}: OUTPUTS DIFFER"))
    except Exception as error:  # noqa: BLE001 -- one failing arm must not lose the rest
        report["checks"].append(dict(shape=shape_name, spread=tag, arm=arm,
                                     error=f"{type(error).__name__}: {error}"[:300]))


def check_outputs(report, shape_name, tag, s, fa, flashinfer, flex_compiled, block_mask_cls,
                  lists, counts, arms=()):
    """Every arm must compute the same attention: max |difference| to Moira's output, and
    ``agrees`` (at most ``CHECK_TOLERANCE``). ``pad`` and ``pow2`` are not checked: their
    padded lists hold other pages, so they compute other attention (they time the reads)."""
    try:
        s.moira(lists, counts)()
        reference = s.out.view(s.rows, GROUP, HEAD_DIM).float().clone()

        outputs = {"moira_hnd": s.moira_hnd(lists, counts),
                   "moira_balanced": lambda: s.moira(lists, counts,
                                                     s.workspace_balanced)().clone()}
        # the other configurations of Moira's own kernels
        outputs.update({arm: lambda arm=arm: s.moira_configured(arm, lists, counts)().clone()
                        for arm in ["moira_eq4", "moira_t128"] + sorted(
                            arm for arm in arms if config_fields(arm) is not None)})
        if fa is not None:
            outputs["fa3_varlen"] = s.fa3_varlen(fa, s.fa3_inputs(lists, counts), None)
        if flashinfer is not None:
            outputs["flashinfer"] = s.flashinfer(flashinfer, lists, counts)[0]
        if flex_compiled is not None:
            outputs["flex"] = s.flex(flex_compiled, block_mask_cls, lists, counts)
        for arm, fn in outputs.items():
            record_check(report, shape_name, tag, arm, fn, reference)
    except Exception as error:  # noqa: BLE001
        traceback.print_exc()
        report["checks"].append(dict(shape=shape_name, spread=tag, error=str(error)[:300]))


def suite(parser, args):
    arms = set(args.arms.split(","))
    unknown = {arm for arm in arms - ARMS if config_fields(arm) is None}
    if unknown:  # a misspelt arm would time nothing and say nothing
        parser.error(f"unknown arms {', '.join(sorted(unknown))}; known: "
                     f"{', '.join(sorted(ARMS))}, moira_c<N>, moira_packed[_hnd], "
                     f"moira[_packed[_hnd]][_c<N>][_cuda<S>|_triton|_ahead<P><S>[w<warps>]]")
    shapes = {**SHAPES, **EXTRA_SHAPES}
    unknown_shapes = [name for name in args.shapes.split(",") if name not in shapes]
    if unknown_shapes:  # before the imports and the JSON, not as a KeyError halfway through
        parser.error(f"unknown shapes {', '.join(unknown_shapes)}; known: {', '.join(shapes)}")
    options = common.kernel_options(parser, args)
    import torch

    import moira

    out_path = common.out_path("kernels.json")
    try:
        from vllm.vllm_flash_attn import flash_attn_interface as fa
    except Exception as error:  # noqa: BLE001 -- the peers are optional; say why they are absent
        fa = None
        print(f"no FA3 arms: {error}")
    try:
        import flashinfer
    except Exception as error:  # noqa: BLE001
        flashinfer = None
        print(f"no FlashInfer arm: {error}")
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
    flex_compiled = torch.compile(flex_attention, dynamic=False)

    report = dict(common.run_info("vllm", "flashinfer"), kernels=options.describe(),
                  geometry=dict(kv_heads=KV_HEADS, group=GROUP, head_dim=HEAD_DIM, page=PAGE,
                                dtype="bfloat16"),
                  mean_fraction=MEAN_FRACTION, results=[], checks=[])

    def record(**row):
        report["results"].append(row)
        us = row.get("us")
        print(f"{row['shape']:>6} {row.get('spread') or '':>6} {row['arm']:<22} "
              + (f"{us:9.1f} us" if us is not None else f"ERROR {row.get('error')}")
              + (f"  {row['tbps']:.2f} TB/s" if row.get("tbps") else ""), flush=True)

    def timed(shape_name, arm, make, spread=None, bytes_read=None, host=False, calls=1,
              **extra):
        """Time ``make()``; ``calls``: how many launches of the arm one call of it makes (the
        time recorded is per launch)."""
        try:
            fn = make()
            us, how = (common.host_us(fn), "host") if host else common.timed_us(fn)
            us /= calls
            row = dict(shape=shape_name, spread=spread, arm=arm, us=round(us, 2), timing=how,
                       **extra)
            if bytes_read:
                row["bytes"] = bytes_read
                row["tbps"] = round(tbps(bytes_read, us), 3)
            record(**row)
            return us
        except Exception as error:  # noqa: BLE001 -- one failing arm must not lose the rest
            traceback.print_exc()
            record(shape=shape_name, spread=spread, arm=arm, us=None,
                   error=f"{type(error).__name__}: {error}"[:400])
            return None

    for shape_name in args.shapes.split(","):
        context, batch = shapes[shape_name]
        s = Shape(context, batch, options)
        dense_bytes = s.rows * s.pages * PAGE_BYTES
        full_counts = torch.full((s.rows,), s.pages, dtype=torch.int32, device="cuda")
        full_lists = torch.arange(s.pages, device="cuda", dtype=torch.int32).expand(
            s.rows, s.pages).contiguous()

        # --- references: dense FA3 (two split policies) and Moira on every page
        dense = {}
        if fa is not None:
            for splits in (0, 32):  # FA3's own heuristic, and vLLM's cap under CUDA graphs
                dense[splits] = timed(shape_name, f"dense_fa3_splits{splits}",
                                      lambda: s.dense_fa3(fa, splits), bytes_read=dense_bytes)
        timed(shape_name, "moira_all_pages", lambda: s.moira(full_lists, full_counts),
              bytes_read=dense_bytes)
        option_arms = sorted(arm for arm in arms if arm_kernels(arm))  # Attend's options
        for name in option_arms:
            timed(shape_name, f"{name}_all_pages", lambda name=name: s.moira_configured(
                name, full_lists, full_counts), bytes_read=dense_bytes)
        if option_arms:  # rows as long as their lists (a lookahead ends each list; the CUDA
            # Attend's staged ids and zero-filled tails)
            s.moira(full_lists, full_counts)()
            reference = s.out.view(s.rows, GROUP, HEAD_DIM).float().clone()
            for name in option_arms:
                record_check(report, shape_name, "all pages", name,
                             lambda name=name: s.moira_configured(name, full_lists,
                                                                  full_counts)().clone(),
                             reference)
        dense_us = min([t for t in dense.values() if t] or [float("nan")])

        # --- Estimate, Select, whole step (fixed 22%), each row one token short of a full
        # page: the common step (a step whose token fills the current page also summarizes
        # it, one step in 64 per row)
        step_lens = s.seq_lens - 1
        summaries = moira.summarize(s.key_nhd, s.table, s.seq_lens)  # every page, for rotation
        log_masses, sel_lists, sel_counts = s.workspace.selection_buffers(batch, s.pages)
        estimate_read = common.estimate_bytes(s.rows, s.pages, summaries.element_size())
        top_k = round(MEAN_FRACTION * s.pages)
        # Estimate's input is 17-34 MB per layer: one copy would sit in the 60 MiB L2 across
        # replays, while an engine reads each layer's from HBM
        rotation = common.estimate_rotation(summaries, s.table, s.pages, estimate_read)
        timed(shape_name, "estimate", lambda: lambda: [common.estimate(
            s.workspace, s.query, s.key_nhd, copy, table, step_lens, s.scale, log_masses)
            for copy, table in rotation], bytes_read=estimate_read, calls=len(rotation))
        for mode, kw in (("select_coverage", dict(gamma=0.98, top_k=None)),
                         ("select_top22", dict(gamma=0.98, top_k=top_k))):
            timed(shape_name, mode, lambda kw=kw: lambda: common.select(
                s.workspace, log_masses, step_lens, sel_lists, sel_counts, max_pages=s.pages,
                **kw))
        timed(shape_name, "step_top22", lambda: lambda: moira.sparse_decode(
            s.query, s.key_nhd, s.value_nhd, summaries, s.table, step_lens, top_k=top_k,
            scale=s.scale, workspace=s.workspace, out=s.out),
            bytes_read=top_k * s.rows * PAGE_BYTES + estimate_read)

        # --- the spreads
        spreads = [(f"cv{cv}", [(MEAN_FRACTION, cv)]) for cv in (CVS if not args.quick
                                                                  else [0.0, 1.0])]
        if not args.quick:
            spreads.append(("real", [(m, 0.7) for m in REAL_MEANS]))
        for spread, layers in spreads:
            for layer, (mean, cv) in enumerate(layers):
                tag = spread if len(layers) == 1 else f"{spread}/{layer}"
                L = layer_lists(s.pages, s.rows, mean, cv, seed=1000 * layer + int(10 * cv))
                counts, lists = L["counts"], L["lists"]
                bytes_read = s.kv_bytes(counts)
                cf = counts.double()
                info = dict(fraction=round(bytes_read / dense_bytes, 4),
                            cv=round((cf.std(unbiased=False) / cf.mean()).item(), 3))
                if "moira" in arms:
                    timed(shape_name, "moira", lambda: s.moira(lists, counts), tag, bytes_read,
                          **info)
                if "moira_balanced" in arms:
                    timed(shape_name, "moira_balanced",
                          lambda: s.moira(lists, counts, s.workspace_balanced),
                          tag, bytes_read, **info)
                for name in sorted(arm for arm in arms if config_fields(arm) is not None):
                    timed(shape_name, name, lambda name=name: s.moira_configured(
                        name, lists, counts), tag, bytes_read, **info)
                if "moira_hnd" in arms:
                    timed(shape_name, "moira_hnd", lambda: s.moira_hnd(lists, counts), tag,
                          bytes_read, **info)
                if "pad" in arms:
                    timed(shape_name, "pad", lambda: s.moira(L["pad_lists"], L["pad_counts"]),
                          tag, bytes_read, read=s.kv_bytes(L["pad_counts"]), **info)
                if "pow2" in arms:
                    timed(shape_name, "pow2", lambda: s.moira(L["pow2_lists"],
                                                             L["pow2_counts"]),
                          tag, bytes_read, read=s.kv_bytes(L["pow2_counts"]), **info)
                if fa is not None and "fa3_varlen" in arms:
                    inputs = s.fa3_inputs(lists, counts)
                    timed(shape_name, "fa3_metadata", lambda: s.fa3_metadata(fa, inputs), tag,
                          **info)
                    metadata = s.fa3_metadata(fa, inputs)()
                    timed(shape_name, "fa3_varlen", lambda: s.fa3_varlen(fa, inputs, metadata),
                          tag, bytes_read, **info)
                    timed(shape_name, "fa3_varlen_inline",
                          lambda: s.fa3_varlen(fa, inputs, None), tag, bytes_read, **info)
                if flashinfer is not None and "flashinfer" in arms:
                    made = {}

                    def make_run():
                        made["run"], made["plan"] = s.flashinfer(flashinfer, lists, counts)
                        return made["run"]

                    if timed(shape_name, "flashinfer", make_run, tag, bytes_read, **info):
                        timed(shape_name, "flashinfer_plan", lambda: made["plan"], tag,
                              host=True, **info)
                if "flex" in arms:
                    timed(shape_name, "flex", lambda: s.flex(flex_compiled, BlockMask, lists,
                                                             counts), tag, bytes_read, **info)
                if spread == "cv0.0" or (spread == "cv1.0" and len(layers) == 1):
                    check_outputs(report, shape_name, tag, s, fa, flashinfer,
                                  flex_compiled if "flex" in arms else None, BlockMask, lists,
                                  counts, arms)
        for row in report["results"]:
            if row["shape"] == shape_name and row.get("tbps") and dense_us == dense_us:
                row["rel_bw"] = round(row["tbps"] / tbps(dense_bytes, dense_us), 3)
        common.write_json(out_path, report)
        s = None  # this shape's caches go before the next one's are made
        torch.cuda.empty_cache()
    print(f"wrote {out_path}")


# ============================================================================================
# single: one request's step, 32 layers per graph
# ============================================================================================

LAYERS = 32
HIDDEN, GATE_UP = 4096, 2 * 14336  # Llama-3.1-8B's MLP input and gate/up widths (--gemm)
WIDTH = 1030  # block-table pages of a 66k-token engine
# --split-sweep: Attend's split at batch 1 (8 rows), (floor_rows, J, T): chunk floors of 6, 4,
# 3 and 2 pages with J the default, 32 or 16 and T = 0 (Eq. 4 alone); then the short-row floor
# T at the default floor_rows, J the default or 32 (min_programs 1: no programs launched only
# to exit)
SPLIT_SWEEP = [(floor_rows, chunks, 0) for floor_rows in (32, 48, 64, 96)
               for chunks in (None, 32, 16)] + [(32, chunks, programs) for chunks in (None, 32)
                                                for programs in (128, 256)]
# --programs-sweep: N_T (MoiraConfig.min_programs) without the ceiling on J (programs_config)
PROGRAMS_SWEEP = (4096, 2048, 1024, 512, 256)
# the paper's mean read fraction at gamma 0.98 (Llama-3.1-8B, Table 3), clamped below 8k
READS = {2048: 0.42, 8192: 0.42, 16384: 0.37, 32768: 0.31, 65536: 0.16, 131072: 0.15}
# the programmatic-launch arms (suffix of step / step_full_rows) and the kernels each chains
# (tuning "launch.chained"); "_triton": the same kernels launched plainly
PDL_CHAINS = {"_triton": None, "_pdl": "estimate,select,attend,merge",
              "_pdl_no_attend": "estimate,select,merge", "_pdl_est_sel": "estimate,select"}


def programs_config(min_programs, options=None):
    """The ``--programs-sweep`` arm of N_T ``min_programs``: J from N_T alone (its ceiling,
    ``max_chunks_per_row``, lifted to N_T, where it never binds)."""
    import moira

    return moira.MoiraConfig(min_programs=min_programs, max_chunks_per_row=min_programs,
                             kernels=options or moira.KernelOptions())


def pdl_config(chained, options=None):
    """The ``MoiraConfig`` of a ``PDL_CHAINS`` arm: ``options`` (the run's ``--kernels``) on the
    Triton Estimate, Select and Attend, programmatic launch on with ``chained`` the kernels it
    chains, or off where ``chained`` is None. The options' constants of the CUDA kernels,
    which no longer run, are dropped."""
    import moira
    from moira.kernels.tuning import TUNABLES

    options = options or moira.KernelOptions()
    tuning = {name: value for name, value in options.tuning
              if TUNABLES[name].backend != "cuda"}
    if chained is not None:
        tuning["launch.chained"] = chained
    kernels = dataclasses.replace(options, estimate="triton", select="triton", attend="triton",
                                  tuning=tuning)
    return moira.MoiraConfig(programmatic_launch=chained is not None, kernels=kernels)


def gemm_calls(fn, replays=10):
    """Per-call statistics of the GEMM kernels when ``fn`` runs as one CUDA graph (CUPTI
    reports each kernel of a replayed graph): the GEMM's own time after an arm."""
    import torch
    from torch.profiler import ProfilerActivity, profile

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
    return common.call_stats([event.device_time_total for event in trace.events()
                              if event.device_type.name == "CUDA"
                              and common.kernel_class(event.name) == "GEMM"])


def cache_bytes(context, batch):
    """K and V of ``LAYERS`` layers of ``batch`` requests of ``context`` tokens."""
    return 2 * LAYERS * batch * context * KV_HEADS * HEAD_DIM * 2


class Layers:
    """``LAYERS`` layers of ``batch`` requests: own caches, summaries, queries; workspaces
    under ``options``. Each request's pages sit at random places in its layer's cache."""

    def __init__(self, context, batch=1, width=WIDTH, spread=False, gemm=False, options=None):
        import torch

        import moira
        from moira.synthetic import layer_head_fractions

        pages = context // PAGE
        self.width = max(width, pages + 2)
        self.context, self.batch = context, batch
        self.options = options or moira.KernelOptions()
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
        """A workspace for these layers' table: ``config`` (default ``MoiraConfig()``) with
        the run's kernel options where it names none."""
        import moira

        config = config or moira.MoiraConfig()
        if config.kernels == moira.KernelOptions():
            config = config.replace(kernels=self.options)
        return workspace(self.batch, self.width, config)

    def each(self, layer_fn, gemm=False):
        import torch

        def run():
            for layer in range(LAYERS):
                layer_fn(layer)
                if gemm:
                    torch.matmul(self.hidden, self.weights[layer].t(), out=self.gate_up)
        return run


def gemm_costs(times):
    """``--gemm``: per arm, what the GEMM after each layer adds (``<arm>+gemm`` minus
    ``<arm>``, µs per layer), beside ``gemm_only`` (the GEMM after nothing); an arm after
    which the GEMM runs slower than alone shows a larger cost."""
    costs = {name: round(times[name + "+gemm"] - times[name], 2) for name in times
             if name + "+gemm" in times}
    if "gemm_only" in times:
        costs["gemm_only"] = times["gemm_only"]
    return costs


def timed_shapes(contexts, batches, widths):
    """(context, batch, table width) in timing order, each width at least the row's pages and
    two more (as ``Layers`` builds the table), so a shape whose rows outgrow several of the
    requested widths is timed once at the width it gets."""
    batches, widths = list(batches), list(widths)
    return list(dict.fromkeys((context, batch, max(width, context // PAGE + 2))
                              for context in contexts for batch in batches for width in widths))


def single(parser, args):
    if args.plot:
        return single_plot(args.plot)
    if args.gemm_profile and not args.gemm:
        parser.error("--gemm-profile profiles the <arm>+gemm graphs: add --gemm")
    if args.gemm_probes and not args.gemm:
        parser.error("--gemm-probes are arms before the GEMM: add --gemm")
    if len(args.width) > 1 and (args.programs_sweep or args.split_sweep):
        parser.error("--programs-sweep and --split-sweep take one --width (their reports key "
                     "rows by shape)")
    options = common.kernel_options(parser, args)
    import torch

    import moira
    from moira.integrations.vllm.settings import MoiraSettings, full_read_pages

    try:
        from vllm.vllm_flash_attn import flash_attn_interface as fa
    except Exception as error:  # noqa: BLE001 -- FA3 arms are skipped, the rest still run
        fa = None
        print(f"no FA3 arm: {error}")

    report = dict(common.run_info("vllm"), kernels=options.describe(),
                  # the kernel options of the *_triton and *_pdl* arms
                  arm_kernels={suffix[1:]: pdl_config(chained, options).kernels.describe()
                               for suffix, chained in PDL_CHAINS.items()},
                  note="per-layer µs, 32 layers (own caches) per CUDA graph replay; read "
                       "fractions imposed (fraction mode), not chosen by the rule",
                  results=[])
    results = report["results"]
    shapes = timed_shapes(map(int, args.contexts.split(",")), map(int, args.batches.split(",")),
                          args.width)
    for context, batch, width in shapes:
        if cache_bytes(context, batch) > 80e9:
            print(f"{context:>7} x{batch} w{width}: skipped (caches over 80 GB)", flush=True)
            continue
        s = None  # the previous shape's caches go before this one's are made
        torch.cuda.empty_cache()
        s = Layers(context, batch, width, args.spread, args.gemm, options)
        rows = batch * KV_HEADS
        row = dict(context=context, batch=batch, read_fraction=s.fraction, width=s.width,
                   spread=args.spread, us_per_layer={})
        times = row["us_per_layer"]

        def timed(name, layer_fn, gemm=False):
            if args.gemm and not gemm:  # the arm with the GEMM right after, beside it
                timed(name + "+gemm", layer_fn, gemm=True)
            try:
                times[name] = round(common.graph_us(s.each(layer_fn, gemm)) / LAYERS, 2)
            except Exception as error:  # noqa: BLE001 -- one failed arm must not lose the rest
                row.setdefault("errors", {})[name] = f"{type(error).__name__}: {error}"[:300]
                print(f"{context:>7} x{batch} w{s.width} {name:<24} failed: "
                      f"{row['errors'][name]}", flush=True)
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
            # what slows the GEMM after an arm: dirty L2 lines to write back (probe_write_<N>m
            # writes N MiB), reads (probe_read_<N>m), or page-scattered reads as Attend's and
            # their writes (probe_gather: the layer's K/V pages in the table's order)
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

        space = s.workspace()
        log_masses, lists, counts = space.selection_buffers(batch, s.width)
        timed("estimate", lambda layer: common.estimate(
            space, s.queries[layer], s.caches[layer][0], s.summaries[layer], s.table,
            s.seq_lens, s.scale, log_masses))
        timed("select", lambda layer: common.select(
            space, log_masses, s.seq_lens, lists, counts, max_pages=s.width, gamma=0.98,
            keep_fractions=s.fractions[layer]))
        row["pages_listed_per_row"] = float(counts.float().mean())
        timed("attend_merge", lambda layer: moira.attend(
            s.queries[layer], *s.caches[layer], s.table, s.seq_lens, lists, counts,
            workspace=space, out=s.out))
        c2 = s.workspace(moira.MoiraConfig(floor_rows=96))
        arms = {"step": (space, 0), "step_c2": (c2, 0),
                "step_floor_off": (s.workspace(moira.MoiraConfig(floor_rows=1)), 0),
                "step_full_rows": (space, s.width), "step_full_rows_c2": (c2, s.width)}
        # programmatic launch chains the kernels of the graph here across layers too (the last
        # chained kernel of a layer into the first of the next); in vLLM the GEMMs between
        # layers are launched plainly, so _pdl is an upper bound on its gain
        for suffix, chained in PDL_CHAINS.items():
            ws = s.workspace(pdl_config(chained, options))
            arms.update({f"step{suffix}": (ws, 0), f"step_full_rows{suffix}": (ws, s.width)})
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
                config = programs_config(programs, options)
                arms[f"step_p{programs}"] = (s.workspace(config), full)
                row.setdefault("programs_sweep", {})[f"step_p{programs}"] = dict(
                    min_programs=programs, chunks_per_row=config.chunks_per_row(rows, s.width))
        for name, (ws, full) in arms.items():
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
        common.write_json(args.out, report)


def single_plot(path):
    """Per-layer time against context: FA3 (runs with vLLM), Moira's step (its kernels stacked)
    and the step with the row read in full; ``<path>.png``."""
    plt = common.pyplot()
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
    # (older files also timed a separate "summarize" launch: stacked where present)
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


# ============================================================================================
# cache-write: the decode token's K/V write inside Estimate's launch
# ============================================================================================

CACHE_WRITE_SHAPES = ((8192, 1), (8192, 32), (131072, 4))
CACHE_WRITE_WIDTH = 2048  # block-table pages of a 131,072-token vLLM engine
CACHE_WRITE_ARMS = ("estimate", "fused", "separate")


def cache_write(parser, args):
    """Estimate alone (``estimate``), writing each request's new K and V first (``fused``), and
    two ``index_copy_`` launches then Estimate (``separate``; vLLM writes both with one kernel,
    so this overstates the separate write), rows selecting or read in full."""
    if args.plot:
        return cache_write_plot(args.plot)
    options = common.kernel_options(parser, args)
    import torch

    import moira

    torch.manual_seed(0)
    report = dict(common.run_info(), kernels=options.describe(), results=[])
    for context, batch in CACHE_WRITE_SHAPES:
        pages = context // PAGE
        space = workspace(batch, CACHE_WRITE_WIDTH, moira.MoiraConfig(kernels=options))
        keys = torch.randn(batch * pages + 8, PAGE, KV_HEADS, HEAD_DIM, device="cuda",
                           dtype=torch.bfloat16)
        values = torch.randn_like(keys)
        table = torch.randperm(keys.shape[0], device="cuda")[:batch * pages].view(batch, pages)
        table = torch.cat([table.int(), torch.zeros(batch, max(0, CACHE_WRITE_WIDTH - pages),
                                                    dtype=torch.int32, device="cuda")], 1)
        seq_lens = torch.full((batch,), context - 5, dtype=torch.int32, device="cuda")
        query = torch.randn(batch, KV_HEADS * GROUP, HEAD_DIM, device="cuda",
                            dtype=torch.bfloat16)
        summaries = torch.zeros(keys.shape[0], KV_HEADS, 2, HEAD_DIM, device="cuda",
                                dtype=torch.bfloat16)
        log_masses = torch.empty(batch * KV_HEADS, GROUP, CACHE_WRITE_WIDTH, device="cuda")
        new_keys = torch.randn(batch, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        new_values = torch.randn_like(new_keys)
        last = (seq_lens - 1).long()
        slots = table[torch.arange(batch, device="cuda"), last // PAGE].long() * PAGE \
            + last % PAGE
        for mode, dense_below_pages in (("select", 0), ("full_rows", 1 << 20)):
            def plain():
                common.estimate(space, query, keys, summaries, table, seq_lens,
                                HEAD_DIM ** -0.5, log_masses,
                                dense_below_pages=dense_below_pages)

            def fused():
                common.estimate(space, query, keys, summaries, table, seq_lens,
                                HEAD_DIM ** -0.5, log_masses,
                                dense_below_pages=dense_below_pages,
                                new_kv=(new_keys, new_values, values, slots))

            def separate():
                keys.view(-1, KV_HEADS, HEAD_DIM).index_copy_(0, slots, new_keys)
                values.view(-1, KV_HEADS, HEAD_DIM).index_copy_(0, slots, new_values)
                plain()

            times = {arm: round(common.graph_us(fn, rep=50), 2)
                     for arm, fn in zip(CACHE_WRITE_ARMS, (plain, fused, separate))}
            row = dict(context=context, batch=batch, rows=mode, us=times)
            print(json.dumps(row), flush=True)
            report["results"].append(row)
    common.write_json(args.out, report)
    try:
        cache_write_plot(args.out)
    except ImportError as error:  # the GPU host may lack matplotlib: plot the JSON elsewhere
        print(f"no plot ({error}): python3 benchmarks/kernel_bench.py cache-write --plot "
              f"{args.out}")


def cache_write_plot(path):
    plt = common.pyplot()
    with open(path) as f:
        rows = json.load(f)["results"]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    width = 0.27
    for i, arm in enumerate(CACHE_WRITE_ARMS):
        ax.bar([j + (i - 1) * width for j in range(len(rows))], [r["us"][arm] for r in rows],
               width, label=arm)
    ax.set_xticks(range(len(rows)),
                  [f"{r['context'] // 1024}k×{r['batch']}\n{r['rows']}" for r in rows],
                  fontsize=7)
    ax.set_ylabel("µs per layer (median, CUDA graph)")
    ax.set_title("Estimate with the decode token's K/V write in its launch", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.splitext(path)[0] + ".png", dpi=110)
    plt.close(fig)


# ============================================================================================
# timeline: the CUDA Attend's programs over one launch
# ============================================================================================

BIN_US = 1.0
STEADY = 0.9  # the ramp ends and the tail starts where the rate crosses 90% of the steady one
RAW_FIELDS = ["start_ns", "first_page_ns", "end_ns", "sm", "pages"]  # ns from the first start


def spread_lists(pages, rows, spread):
    """The suite's lists (``suite``'s seeds): "cv0", "cv1" or "real<layer>"."""
    if spread.startswith("real"):
        layer = int(spread[4:])
        return layer_lists(pages, rows, REAL_MEANS[layer], 0.7, seed=1000 * layer + 7)
    cv = float(spread[2:])
    return layer_lists(pages, rows, MEAN_FRACTION, cv, seed=int(10 * cv))


ESTIMATORS = ("mvar", "int2", "int4")


def estimators(parser, args):
    unknown = [name for name in args.shapes.split(",") if name not in {**SHAPES, **EXTRA_SHAPES}]
    if unknown:
        parser.error(f"unknown shapes {', '.join(unknown)}")
    options = common.kernel_options(parser, args)
    import moira

    try:
        from vllm.vllm_flash_attn import flash_attn_interface as fa
    except Exception as error:  # noqa: BLE001 -- dense FA3 is the yardstick when present
        fa = None
        print(f"no dense FA3 arm: {error}")
    report = dict(common.run_info("vllm"), kernels=options.describe(),
                  geometry=dict(kv_heads=KV_HEADS, group=GROUP, head_dim=HEAD_DIM, page=PAGE,
                                dtype="bfloat16"), results=[])

    def timed(shape_name, arm, fn, bytes_read=None, calls=1):
        try:
            us = common.timed_us(fn)[0] / calls
        except Exception as error:  # noqa: BLE001 -- one failing arm must not lose the rest
            traceback.print_exc()
            report["results"].append(dict(shape=shape_name, arm=arm, us=None, error=str(error)))
            return
        row = dict(shape=shape_name, arm=arm, us=round(us, 2))
        if bytes_read:
            row.update(bytes=bytes_read, tbps=round(tbps(bytes_read, us), 3))
        report["results"].append(row)
        print(f"{shape_name:>6} {arm:<26} {us:9.1f} us"
              + (f"  {row['tbps']:.2f} TB/s" if bytes_read else ""), flush=True)
        common.write_json(common.out_path("estimators.json"), report)

    for shape_name in args.shapes.split(","):
        context, batch = {**SHAPES, **EXTRA_SHAPES}[shape_name]
        s = Shape(context, batch, options)
        step_lens = s.seq_lens - 1  # the common step: one token short of a full page
        top_k = round(MEAN_FRACTION * s.pages)
        if fa is not None:
            timed(shape_name, "dense_fa3", s.dense_fa3(fa, 0),
                  bytes_read=s.rows * s.pages * PAGE_BYTES)
        for estimator in ESTIMATORS:
            config = config_with(options).replace(estimator=estimator)
            space = workspace(batch, s.pages, config)
            summaries = moira.summarize(s.key_nhd, s.table, s.seq_lens, estimator=estimator)
            log_masses, lists, counts = space.selection_buffers(batch, s.pages)
            read = common.estimate_bytes(s.rows, s.pages, summaries.element_size(),
                                         estimator=estimator)
            rotation = common.estimate_rotation(summaries, s.table, s.pages, read)
            timed(shape_name, f"estimate_{estimator}", lambda: [common.estimate(
                space, s.query, s.key_nhd, copy, table, step_lens, s.scale, log_masses)
                for copy, table in rotation], bytes_read=read, calls=len(rotation))
            timed(shape_name, f"estimate_select_{estimator}", lambda: [
                (common.estimate(space, s.query, s.key_nhd, copy, table, step_lens, s.scale,
                                 log_masses),
                 common.select(space, log_masses, step_lens, lists, counts, max_pages=s.pages))
                for copy, table in rotation], calls=len(rotation))
            timed(shape_name, f"step_top22_{estimator}", lambda: moira.sparse_decode(
                s.query, s.key_nhd, s.value_nhd, summaries, s.table, step_lens, top_k=top_k,
                scale=s.scale, workspace=space, out=s.out),
                bytes_read=top_k * s.rows * PAGE_BYTES + read)


def compact(records):
    """One launch's records as ``RAW_FIELDS`` rows (first page -1 where none landed)."""
    import torch

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


def variant_run(s, page_lists, counts, variant, options=None):
    """Attend + Merge of one variant on a ``Shape``'s caches: the CUDA Attend at the variant's
    stages (``options``' other fields kept)."""
    import moira

    chunk_pages, stages, most, width = variant_settings(variant)
    table = s.table
    if width and width > s.pages:  # the extra entries are never listed, so never read
        table = torch_cat_zeros(table, width - s.pages)
    fields = dict(chunk_pages=chunk_pages)
    if most:
        fields.update(min_chunks_per_row=min(moira.MoiraConfig.min_chunks_per_row, most),
                      max_chunks_per_row=most)
    kernels = common.with_kernels(options or moira.KernelOptions(),
                             dict(attend="cuda", tuning={"attend.cuda_stages": stages}))
    space = workspace(s.batch, table.shape[1], moira.MoiraConfig(kernels=kernels, **fields))
    lists = page_lists.view(s.batch, KV_HEADS, -1)
    page_counts = counts.view(s.batch, KV_HEADS)
    return lambda: moira.attend(s.query, s.key_nhd, s.value_nhd, table, s.seq_lens, lists,
                                page_counts, scale=s.scale, workspace=space, out=s.out)


def torch_cat_zeros(table, columns):
    """``table`` with ``columns`` zero columns appended."""
    import torch

    return torch.cat([table, table.new_zeros(table.shape[0], columns)], dim=1)


def analyse(records, rows):
    """Summary of one launch's timeline records ([programs, 8] int64)."""
    import torch

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


def timeline(parser, args):
    if args.plot:
        with (gzip.open if args.plot.endswith(".gz") else open)(args.plot, "rt") as f:
            timeline_plot(json.load(f),
                          args.plot.removesuffix(".gz").removesuffix(".json") + ".png")
        return
    shapes = {**SHAPES, **EXTRA_SHAPES}
    unknown = [name for name in args.shapes.split(",") if name not in shapes]
    if unknown:
        parser.error(f"--shapes: unknown {unknown}; known: {', '.join(shapes)}")
    variants = args.variants.split(",")
    for variant in variants:
        variant_settings(variant)  # a bad name fails here, not after the first shape
    options = common.kernel_options(parser, args)
    import torch

    from moira.benchmarking import timeline as probes

    out = os.environ.get("OUT", ".")
    report = dict(common.run_info(), kernels=options.describe(), mean_fraction=MEAN_FRACTION,
                  bin_us=BIN_US, results=[])
    for shape_name in args.shapes.split(","):
        context, batch = shapes[shape_name]
        s = Shape(context, batch, options)
        capacity = s.rows * s.pages  # more programs than any plan launches
        buffer = torch.full((capacity, probes.FIELDS), -1, dtype=torch.int64, device="cuda")
        for spread in args.spreads.split(","):
            lists = spread_lists(s.pages, s.rows, spread)
            counts, page_lists = lists["counts"], lists["lists"]
            bytes_read = int(counts.sum()) * PAGE_BYTES
            runs = {variant: variant_run(s, page_lists, counts, variant, options)
                    for variant in variants}
            timed = {variant: [] for variant in variants}
            for _ in range(args.rounds):  # the variants in alternation
                for variant in variants:
                    timed[variant].append(common.timed_us(runs[variant])[0])
            for variant in variants:
                with probes.recording("attend", buffer):  # graphs are captured inside
                    probe_us, _ = common.timed_us(runs[variant])
                    launches = []
                    for _ in range(args.launches):
                        buffer.fill_(-1)
                        runs[variant]()
                        torch.cuda.synchronize()
                        written = buffer[buffer[:, 0] != -1].cpu()
                        launches.append(analyse(written, s.rows))
                    raw = compact(written)
                plain_us = statistics.median(timed[variant])
                row = dict(shape=shape_name, spread=spread, variant=variant, bytes=bytes_read,
                           attend_merge_us=round(plain_us, 2),
                           attend_merge_us_rounds=[round(x, 2) for x in timed[variant]],
                           vs_grid24=round(plain_us / statistics.median(timed["grid24"]), 4)
                           if "grid24" in timed else None,
                           probe_attend_merge_us=round(probe_us, 2), launches=launches,
                           raw_fields=RAW_FIELDS, raw_last_launch=raw)
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
                common.write_json(os.path.join(out, "timeline.json"), report, compact=True)
        s = buffer = None  # this shape's caches go before the next one's are made
        torch.cuda.empty_cache()
    try:
        timeline_plot(report, os.path.join(out, "timeline.png"))
    except ImportError as error:  # the GPU host may lack matplotlib: plot the JSON elsewhere
        print(f"no plot ({error}): python3 benchmarks/kernel_bench.py timeline --plot "
              f"timeline.json")


def timeline_plot(report, path):
    """One panel per (shape, spread): the bytes' arrival rate over one launch of each variant,
    and its Attend + Merge time in the legend."""
    plt = common.pyplot()
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
    plt.close(fig)


# ============================================================================================
# profile: one launch of each kernel, for Nsight Compute
# ============================================================================================


def profile(parser, args):
    options = common.kernel_options(parser, args)
    import torch

    import moira

    for shape in args.shapes.split(","):
        context, batch = (int(part) for part in shape.split("x"))
        query, keys, values, summaries, table, seq_lens = common.step_inputs(context, batch)
        pages = context // PAGE
        space = workspace(batch, pages, moira.MoiraConfig(kernels=options))
        out = torch.empty_like(query)
        for _ in range(2):  # the first launch compiles: profile the second
            moira.sparse_decode(query, keys, values, summaries, table, seq_lens,
                                top_k=round(0.22 * pages), workspace=space, out=out)
        torch.cuda.synchronize()


# ============================================================================================


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    routines = parser.add_subparsers(dest="routine", required=True)

    one = routines.add_parser("suite", help="one layer per shape and spread, every arm")
    one.add_argument("--shapes", default=",".join(SHAPES))
    one.add_argument("--arms", default="moira,moira_balanced,moira_hnd,"
                                       "fa3_varlen,pad,pow2,flashinfer,flex")
    one.add_argument("--quick", action="store_true", help="CV 0 and 1.0 only, no real-like")

    one = routines.add_parser("single", help="one request's step, 32 layers per graph")
    one.add_argument("--contexts", default="2048,8192,32768,65536,131072")
    one.add_argument("--batches", default="1",
                     help="requests per step, e.g. 1,2,4 (each context at each batch)")
    one.add_argument("--out", default=common.out_path("single.json"))
    one.add_argument("--plot", metavar="JSON", help="only draw the PNG of a result file")
    one.add_argument("--split-sweep", action="store_true",
                     help="also time the step (rows as the plugin runs them) at each "
                          "SPLIT_SWEEP chunk floor and J: split_c<floor>_j<J>")
    one.add_argument("--width", default=[WIDTH], type=common.positive_ints,
                     help="block-table pages per row (2048: a 131,072-token vLLM engine); "
                          "several, e.g. 261,2048, time each shape at each width in turn")
    one.add_argument("--spread", action="store_true",
                     help="per-(layer, KV head) fractions as the plugin imposes them")
    one.add_argument("--programs-sweep", action="store_true",
                     help="also time the step at each PROGRAMS_SWEEP min_programs")
    one.add_argument("--gemm", action="store_true",
                     help="also time each arm with the gate/up GEMM after every layer "
                          "(<arm>+gemm), and the GEMM alone (gemm_only)")
    one.add_argument("--gemm-probes", action="store_true",
                     help="with --gemm: also time arms that only write / read N MiB or "
                          "gather the K/V pages before the GEMM")
    one.add_argument("--gemm-profile", action="store_true",
                     help="with --gemm: also record the GEMM kernels' own per-call times "
                          "after each arm (profiler over the replayed graph)")

    one = routines.add_parser("cache-write", help="Estimate with the token's K/V write")
    one.add_argument("--out", default=common.out_path("cache-write.json"))
    one.add_argument("--plot", metavar="JSON", help="only draw the PNG of a result file")

    one = routines.add_parser("estimators", help="Estimate, Select and the step per estimator")
    one.add_argument("--shapes", default=",".join(SHAPES))

    one = routines.add_parser("timeline", help="the CUDA Attend's programs over one launch")
    one.add_argument("--shapes", default="8k32,32k16,131k4")
    one.add_argument("--spreads", default="cv0,cv1,real5")
    one.add_argument("--launches", type=int, default=5)
    one.add_argument("--variants", default="grid24",
                     help="comma-separated grid<C>[s<S>][j<J>][w<pages>]: chunk floor C "
                          "(chunk_pages), S pages' stages (attend.cuda_stages, default 2), "
                          "at most J programs per row, the block table <pages> wide")
    one.add_argument("--rounds", type=int, default=2,
                     help="timings of each variant, in alternation")
    one.add_argument("--plot", metavar="JSON", help="only plot a run's timeline.json[.gz] "
                     "(to the same name with .png)")

    one = routines.add_parser("profile", help="one launch of each kernel, for ncu")
    one.add_argument("--shapes", default="131072x4,8192x32",
                     help="comma-separated CONTEXTxBATCH, profiled in that order")
    for one in routines.choices.values():
        common.add_kernel_options(one)
    args = parser.parse_args(argv)
    routine = dict(suite=suite, single=single, timeline=timeline, profile=profile)
    routine["cache-write"] = cache_write
    routine["estimators"] = estimators
    routine[args.routine](routines.choices[args.routine], args)


if __name__ == "__main__":
    main()
