"""Kernel benchmark suite (issue 3, paper section 5.5.3, Figure 4, Table 6): one decode layer of
Llama-3.1-8B geometry (8 KV heads, G = 4, head_dim 128, bf16, 64-token pages).

For every shape (context x batch) and every spread of list lengths (CV of the per-(request,
KV head) page counts at a mean of 22% of each row's pages, plus a "real-like" spread: 8 layers
with means from 9% to 68% and CV 0.7 across rows), every arm reads the same page lists:

- ``moira``          Attend + Merge on vLLM's cache layout (NHD, ``[pages, 64, Hkv, D]``), as
                     configured by default: since session 36 the CUDA Attend
                     (``attend.IMPLEMENTATION = "auto"``), the Triton one in earlier files.
- ``moira_balanced`` the same lists with ``MoiraConfig(schedule="balanced")``: all rows'
                     pages split evenly over P programs (``moira/kernels/balanced.py``).
- ``moira_hnd``      the same on the head-major layout the folded peers need.
- ``moira_packed``, ``moira_packed_hnd``: ``moira`` on vLLM 0.26's own cache tensors, K and V
                     packed in one ``[..., 2 D]`` tensor: token-major (``[pages, 64, Hkv, 2 D]``,
                     vLLM's default NHD) and head-major (``[pages, Hkv, 64, 2 D]``,
                     ``VLLM_KV_CACHE_LAYOUT=HND``: a page-head's K and V in one 32 KiB run);
                     before the options below too, e.g. ``moira_packed_hnd_c32``.
- ``moira_eq4``, ``moira_t128``: ``moira`` with the short-row floor off (``step_programs=0``,
                     Eq. 4 alone) and at T = 128 instead of the default 256 (session 14's;
                     files of session 15 have ``moira_t256`` beside a default of 128).
- ``moira_c<N>``     ``moira`` with Eq. (4)'s chunk floor C = N pages (``chunk_pages``; the
                     default 24 was chosen at CV 0 only, session 1), e.g. ``moira_c12``.
- ``moira_ahead<P><S>[w<warps>]``  ``moira`` with each tile's page ids loaded a tile ahead
                     (``attend.PAGE_IDS_AHEAD``), P pages per tile, S pipeline stages and
                     that many warps (``PAGES_PER_ITER``, ``NUM_STAGES``, ``NUM_WARPS``; 4),
                     e.g. ``moira_ahead13``, ``moira_ahead13w8``; with a chunk floor too,
                     ``moira_c<N>_ahead<P><S>[w<warps>]``, e.g. ``moira_c32_ahead13``.
- ``moira_cuda<S>``  ``moira`` with the CUDA Attend (``attend.IMPLEMENTATION = "cuda"``,
                     attend_cuda.cu) and S pages in flight per program (``CUDA_STAGES``,
                     2-4), e.g. ``moira_cuda2``; after a packed layout or a floor too,
                     e.g. ``moira_packed_hnd_c32_cuda3``.
- ``moira_triton``   ``moira`` with the Triton Attend (``attend.IMPLEMENTATION = "triton"``;
                     also after a packed layout or a floor, ``moira_c32_triton``).
- ``fa3_varlen``     vLLM's FA3 (``vllm_flash_attn``, ``fa_version=3``), each (request, KV head)
                     row its own sequence over the HND cache viewed as ``[pages*Hkv, 64, 1, D]``;
                     scheduler metadata built beforehand on the GPU (``fa3_metadata``, timed
                     separately); ``fa3_varlen_inline`` lets the call build it.
- ``pad``            Moira's kernel on lists padded with unselected pages to the longest row
                     (the padding is read like real pages: the cost of a rectangular grid;
                     its ``tbps`` / ``rel_bw`` count the selected bytes, an effective rate,
                     and ``read`` the bytes it read).
- ``pow2``           the same, each row padded to the next power of two (bucketing's reads).
- ``flashinfer``     FlashInfer's batch decode (tensor cores) on the folded rows;
                     ``flashinfer_plan`` is its host ``plan()`` including the device-to-host
                     copy of the counts, timed on the host.
- ``flex``           PyTorch FlexAttention (compiled) with a block mask of 64-token blocks, KV
                     heads folded into the batch.
- ``dense_fa3``      FA3 over every page (what vLLM runs today), the bandwidth reference:
                     ``rel_bw`` of an arm = (its K/V bytes / its time) / (dense bytes / dense time).

(Files of sessions 4 and 6 also time ``moira_fused``: Merge folded into Attend, an option
removed since as slower, benchmarks/RESULTS.md; session 51's ``moira_lm``, the CUDA Attend's
last program of each split row merging it, likewise.)

Also, per shape: Estimate (rotating over copies of the summaries that exceed twice the L2, as
consecutive layers' do, each copy's sink and current pages other physical pages; before
session 7 one copy stayed in the L2; its bytes: summaries, exact pages' keys and log-masses
written, ``estimate_bytes``, since session 24, summaries alone before), Select (coverage 0.98 and
fixed 22%; its input, written by Estimate just before, is in the L2 in an engine too), and the
whole four-kernel step (fixed 22%) in one CUDA graph. These three run every row one token
short of a full page (since session 24; before, every row's token filled its page, so
Estimate also summarized it at every replay, a step that comes once in 64 per row). The block tables are as wide as the rows;
``tune_kernels.py --kinds wide`` times Estimate and Select with an engine's wider table.

Every time is the median of CUDA-graph replays (``triton.testing.do_bench_cudagraph``), except
the host plan. The caches are >= 1 GB per shape and the selected pages (>= 235 MB) are scattered,
far beyond the 60 MiB L2. Results go to ``$OUT/kernels.json`` after every shape. Shapes: 8k32,
32k16, 64k8, 131k4 by default; 16k32 when named.

    PYTHONPATH=/tmp/site:. python3 benchmarks/bench_kernels.py [--shapes 8k32,32k16] [--quick]
"""

import argparse
import contextlib
import json
import math
import os
import re
import statistics
import sys
import time
import traceback

import torch
import triton

import moira
from moira.decode import _launch_estimate, _launch_select
from moira.kernels import attend as attend_module
from moira.synthetic import spread_fractions

KV_HEADS, GROUP, HEAD_DIM, PAGE = 8, 4, 128, 64
SHAPES = {"8k32": (8192, 32), "32k16": (32768, 16), "64k8": (65536, 8), "131k4": (131072, 4)}
# timed only when named in --shapes: 16k x 32 is the engines' shape between 8k x 32 and 32k x 16
# whose rows (256 pages) Eq. (4)'s chunk floor cuts into a few chunks
EXTRA_SHAPES = {"16k32": (16384, 32)}
CVS = [0.0, 0.5, 1.0, 1.2]
MEAN_FRACTION = 0.22
REAL_LAYERS = 8  # real-like spread: per-layer means 9% .. 68% (geometric), CV 0.7 across rows
REAL_MEANS = [0.09 * (0.68 / 0.09) ** (i / (REAL_LAYERS - 1)) for i in range(REAL_LAYERS)]
PAGE_BYTES = 2 * PAGE * HEAD_DIM * 2  # K and V of one page of one KV head, bf16


def estimate_bytes(rows, pages, summary_size, cache_size=2, group=GROUP, head_dim=HEAD_DIM):
    """HBM bytes of one Estimate launch over ``rows`` rows of ``pages`` pages each (>= 2):
    every page's summary (mean and variance), the sink's and the current page's keys (computed
    exactly), and the G float32 log-masses written per page."""
    summaries = rows * pages * 2 * head_dim * summary_size
    exact_keys = rows * 2 * PAGE * head_dim * cache_size
    log_masses = rows * group * pages * 4
    return summaries + exact_keys + log_masses


def tbps(bytes_read, us):
    """Terabytes per second of ``bytes_read`` in ``us`` microseconds."""
    return bytes_read / us / 1e6


def estimate_rotation(summaries, table, pages, bytes_per_call, min_bytes=128 << 20):
    """``(summaries, block_table)`` pairs for Estimate to rotate over, as an engine's consecutive
    layers do: copies of the summaries that together exceed twice the 60 MiB L2, each with the
    table's first ``pages`` columns rolled, so that its sink and current pages are other
    physical pages (whose keys the previous call did not leave in the L2). Every physical page
    must have a summary (summarize with every page full)."""
    copies = max(1, -(-min_bytes // bytes_per_call))
    return [(summaries if i == 0 else summaries.clone(),
             torch.cat([table[:, :pages].roll(i, dims=1), table[:, pages:]], dim=1))
            for i in range(copies)]


def bench(fn):
    """(median µs, how): replays of a CUDA graph of ``fn`` (no host launch cost in the number);
    if ``fn`` cannot be captured, ``do_bench`` with an L2 flush between calls."""
    fn()  # compile / JIT outside the capture
    torch.cuda.synchronize()  # do_bench_cudagraph's side stream does not wait for this one
    try:
        return triton.testing.do_bench_cudagraph(fn, rep=60, return_mode="median") * 1e3, "graph"
    except Exception as error:  # noqa: BLE001
        print(f"  not capturable ({type(error).__name__}: {str(error)[:120]}); eager timing")
        torch.cuda.synchronize()
        return triton.testing.do_bench(fn, rep=60, return_mode="median") * 1e3, "eager"


# --------------------------------------------------------------------------------------------
# Page lists
# --------------------------------------------------------------------------------------------


def page_ranks(rows, pages, generator):
    """A random priority of every page per row; the sink (0) and current (last) pages first."""
    keys = torch.rand(rows, pages, generator=generator)
    keys[:, 0], keys[:, -1] = -2.0, -1.0
    return keys.argsort(dim=1).argsort(dim=1).cuda()


def lists_from(ranks, counts):
    """[rows, pages] int32 ascending logical pages of rank < count; the tail holds ``pages``."""
    pages = ranks.shape[1]
    positions = torch.arange(pages, device=ranks.device).expand_as(ranks)
    keep = ranks < counts[:, None]
    return torch.where(keep, positions, pages).sort(dim=1).values.int()


def layer_lists(pages, rows, mean, cv, seed):
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


# --------------------------------------------------------------------------------------------
# One shape
# --------------------------------------------------------------------------------------------


class Shape:
    def __init__(self, context, batch):
        self.context, self.batch = context, batch
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
        self.workspace = moira.DecodeWorkspace(batch, self.pages, KV_HEADS * GROUP, KV_HEADS,
                                               HEAD_DIM, device="cuda")
        self.packed = {}  # moira_packed's caches, made on first use
        self.workspace_f = moira.DecodeWorkspace(self.rows, self.pages, GROUP, 1, HEAD_DIM,
                                                 device="cuda")
        self.workspace_balanced = moira.DecodeWorkspace(
            batch, self.pages, KV_HEADS * GROUP, KV_HEADS, HEAD_DIM, device="cuda",
            config=moira.MoiraConfig(schedule="balanced"))
        self.workspaces = {}  # an arm's config fields -> its workspace, built when asked
        self.out = torch.empty_like(self.query)

    def arm_workspace(self, arm):
        """The workspace of one of Moira's configured arms (``config_fields``)."""
        fields = config_fields(arm)
        key = tuple(sorted(fields.items()))
        if key not in self.workspaces:
            self.workspaces[key] = moira.DecodeWorkspace(
                self.batch, self.pages, KV_HEADS * GROUP, KV_HEADS, HEAD_DIM, device="cuda",
                config=moira.MoiraConfig(**fields))
        return self.workspaces[key]

    def kv_bytes(self, counts):
        return int(counts.sum()) * PAGE_BYTES

    def physical_f(self, lists, counts):
        """Folded physical page ids of each row's list (0 past the count)."""
        valid = torch.arange(lists.shape[1], device="cuda")[None, :] < counts[:, None]
        ids = torch.gather(self.table_f, 1, lists.clamp(max=self.pages - 1).long())
        return torch.where(valid, ids, 0).int()

    # ---- arms: each returns a no-argument callable writing its output ------------------------

    def moira(self, lists, counts, workspace=None, caches=None):
        """``caches``: (keys, values, out) other than the default's (``packed_caches``)."""
        keys, values, out = caches or (self.key_nhd, self.value_nhd, self.out)
        lists3 = lists.view(self.batch, KV_HEADS, -1)
        counts2 = counts.view(self.batch, KV_HEADS)
        return lambda: moira.attend(self.query, keys, values, self.table, self.seq_lens, lists3,
                                    counts2, scale=self.scale,
                                    workspace=workspace or self.workspace, out=out)

    def moira_configured(self, arm, lists, counts):
        """``moira`` as one of its configured arms runs it: on that arm's caches
        (``cache_layout``), with its workspace (``config_fields``), launched under its Attend
        settings (``attend_settings``; read at each launch, so also when a graph is
        captured)."""
        layout = cache_layout(arm)
        run = self.moira(lists, counts, self.arm_workspace(arm),
                         self.packed_caches(layout) if layout else None)

        def launch():
            with patched(attend_module, **attend_settings(arm)):
                return run()
        return launch

    def moira_hnd(self, lists, counts):
        lists3, counts2 = lists.view(self.rows, 1, -1), counts.view(self.rows, 1)
        out = torch.empty_like(self.query_f)
        return lambda: moira.attend(self.query_f, self.key_f, self.value_f, self.table_f,
                                    self.seq_lens_f, lists3, counts2, scale=self.scale,
                                    workspace=self.workspace_f, out=out)

    def packed_caches(self, layout):
        """(keys, values, out) on a packed K|V copy of the cache (``cache_layout``: "packed" or
        "packed_hnd"), made on first use: one more copy of K and V on the GPU."""
        if layout not in self.packed:
            if layout == "packed_hnd":  # [pages, Hkv, 64, 2D], viewed as [pages, 64, Hkv, 2D]
                kv = torch.cat([self.key_hnd, self.value_hnd], -1).transpose(1, 2)
            else:
                kv = torch.cat([self.key_nhd, self.value_nhd], -1)
            self.packed[layout] = (kv[..., :HEAD_DIM], kv[..., HEAD_DIM:],
                                   torch.empty_like(self.query))
        return self.packed[layout]

    def fa3_inputs(self, lists, counts):
        seqused = (counts * PAGE).int()
        cu_q = torch.arange(self.rows + 1, device="cuda", dtype=torch.int32)
        return dict(table=self.physical_f(lists, counts), seqused=seqused, cu_q=cu_q,
                    max_k=int(counts.max()) * PAGE)

    def fa3_metadata(self, fa, inputs):
        return lambda: fa.get_scheduler_metadata(
            self.rows, 1, inputs["max_k"], GROUP, 1, HEAD_DIM, inputs["seqused"],
            qkv_dtype=torch.bfloat16, cu_seqlens_q=inputs["cu_q"], page_size=PAGE,
            causal=True)

    def fa3_varlen(self, fa, inputs, metadata):
        out = torch.empty_like(self.query_f)
        return lambda: fa.flash_attn_varlen_func(
            self.query_f, self.key_f, self.value_f, 1, inputs["cu_q"], inputs["max_k"],
            seqused_k=inputs["seqused"], softmax_scale=self.scale, causal=True,
            block_table=inputs["table"], scheduler_metadata=metadata, fa_version=3, out=out)

    def dense_fa3(self, fa, num_splits):
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
        workspace = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "HND",
                                                                use_tensor_cores=True)
        physical = self.physical_f(lists, counts)
        valid = torch.arange(physical.shape[1], device="cuda")[None, :] < counts[:, None]
        indices = physical[valid].int()  # row-major: each row's pages in order
        last_page_len = torch.full((self.rows,), PAGE, dtype=torch.int32, device="cuda")
        cache = (self.key_hnd.view(-1, 1, PAGE, HEAD_DIM), self.value_hnd.view(-1, 1, PAGE,
                                                                               HEAD_DIM))

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


def host_time_us(fn, repeats=30):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


ARMS = {"moira", "moira_balanced", "moira_hnd", "moira_eq4", "moira_t128", "fa3_varlen", "pad",
        "pow2", "flashinfer", "flex"}


# the configured arms of ``moira``: vLLM's packed caches, a chunk floor, the CUDA Attend or
# Attend's page ids a tile ahead, or several of them
CONFIGURED_ARM = re.compile(r"moira(_packed(?:_hnd)?)?(?:_c([1-9][0-9]*))?"
                            r"(?:_cuda([2-4])|_(triton)|_ahead([124])([1-9])(?:w([48]))?)?")


def cache_layout(arm):
    """"packed" or "packed_hnd" for an arm on vLLM's packed K|V caches, else None."""
    configured = CONFIGURED_ARM.fullmatch(arm)
    return configured.group(1)[1:] if configured and configured.group(1) else None


def config_fields(arm):
    """``MoiraConfig`` fields of an arm that runs ``moira`` under another configuration
    (``moira_eq4``, ``moira_t128``, ``moira_c<N>``; ``moira_ahead<P><S>``, ``moira_cuda<S>``:
    the default configuration, ``attend_settings``; ``moira_packed[_hnd]``: the default on other caches,
    ``cache_layout``; ``moira_packed_hnd_c<N>_ahead<P><S>``: all three); None for any other
    arm."""
    if arm == "moira_eq4":
        return dict(step_programs=0)
    if arm == "moira_t128":
        return dict(step_programs=128)
    configured = CONFIGURED_ARM.fullmatch(arm)
    if not configured or arm == "moira":
        return None
    chunk = configured.group(2)
    return dict(chunk_pages=int(chunk)) if chunk else {}


def attend_settings(arm):
    """Attend's module constants under which a configured arm launches
    (``[_c<N>]_cuda<S>``: the CUDA Attend with S pages in flight; ``[_c<N>]_triton``: the
    Triton Attend; ``[_c<N>]_ahead<P><S>
    [w<warps>]``: page ids a tile ahead, P pages per tile, S stages, that many warps); {} for
    any other arm."""
    configured = CONFIGURED_ARM.fullmatch(arm)
    if not configured:
        return {}
    cuda_stages, triton, pages, stages, warps = configured.groups()[2:]
    if cuda_stages:
        return dict(IMPLEMENTATION="cuda", CUDA_STAGES=int(cuda_stages))
    if triton:
        return dict(IMPLEMENTATION="triton")
    if not pages:
        return {}
    settings = dict(IMPLEMENTATION="triton", PAGE_IDS_AHEAD=True, PAGES_PER_ITER=int(pages),
                    NUM_STAGES=int(stages))
    return settings | ({"NUM_WARPS": int(warps)} if warps else {})


@contextlib.contextmanager
def patched(module, **settings):
    """A kernel module's tuning constants changed for one measurement, restored afterwards
    (also when the measurement fails)."""
    saved = {name: getattr(module, name) for name in settings}
    for name, value in settings.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--arms", default="moira,moira_balanced,moira_hnd,"
                                          "fa3_varlen,pad,pow2,flashinfer,flex")
    parser.add_argument("--quick", action="store_true", help="CV 0 and 1.0 only, no real-like")
    args = parser.parse_args()
    arms = set(args.arms.split(","))
    unknown = {arm for arm in arms - ARMS if config_fields(arm) is None}
    if unknown:  # a misspelt or retired arm would time nothing and say nothing
        parser.error(f"unknown arms {', '.join(sorted(unknown))}; known: "
                     f"{', '.join(sorted(ARMS))}, moira_c<N>, moira_packed[_hnd], "
                     f"moira[_packed[_hnd]][_c<N>][_cuda<S>|_triton|_ahead<P><S>[w<warps>]] "
                     f"(moira_t256 is moira_t128 since session 15)")
    shapes = {**SHAPES, **EXTRA_SHAPES}
    unknown_shapes = [name for name in args.shapes.split(",") if name not in shapes]
    if unknown_shapes:  # before the imports and the JSON, not as a KeyError halfway through
        parser.error(f"unknown shapes {', '.join(unknown_shapes)}; known: {', '.join(shapes)}")
    out_path = os.path.join(os.environ.get("OUT", "."), "kernels.json")

    versions = dict(torch=torch.__version__, triton=triton.__version__)
    try:
        import vllm
        from vllm.vllm_flash_attn import flash_attn_interface as fa
        versions["vllm"] = vllm.__version__
    except Exception as error:  # noqa: BLE001 -- the peers are optional; say why they are absent
        fa = None
        versions["vllm"] = f"unavailable: {error}"
    try:
        import flashinfer
        versions["flashinfer"] = flashinfer.__version__
    except Exception as error:  # noqa: BLE001
        flashinfer = None
        versions["flashinfer"] = f"unavailable: {error}"
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
    flex_compiled = torch.compile(flex_attention, dynamic=False)

    report = dict(command="python3 " + " ".join(sys.argv), gpu=torch.cuda.get_device_name(),
                  date=time.strftime("%Y-%m-%d %H:%M:%S"), versions=versions,
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
            us, how = (host_time_us(fn), "host") if host else bench(fn)
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
        s = Shape(context, batch)
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
        option_arms = sorted(arm for arm in arms if attend_settings(arm))  # Attend's options
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

        # --- Estimate, Select, whole step (fixed 22%), each row one token short of a full page:
        # the common step (a step whose token fills the current page also summarizes it, one
        # step in 64 per row; until session 24 every row here did, at every replay)
        step_lens = s.seq_lens - 1
        summaries = moira.summarize(s.key_nhd, s.table, s.seq_lens)  # every page, for rotation
        log_masses, sel_lists, sel_counts = s.workspace.selection_buffers(batch, s.pages)
        estimate_read = estimate_bytes(s.rows, s.pages, summaries.element_size())
        top_k = round(MEAN_FRACTION * s.pages)
        ways = s.workspace.config.bisection_ways_for(s.pages)
        # Estimate's input is 17-34 MB per layer: one copy would sit in the 60 MiB L2 across
        # replays, while an engine reads each layer's from HBM
        rotation = estimate_rotation(summaries, s.table, s.pages, estimate_read)
        timed(shape_name, "estimate", lambda: lambda: [_launch_estimate(
            s.query, s.key_nhd, copy, table, step_lens, s.scale, log_masses)
            for copy, table in rotation], bytes_read=estimate_read, calls=len(rotation))
        for mode, kw in (("select_coverage", dict(gamma=0.98, top_k=None)),
                         ("select_top22", dict(gamma=0.98, top_k=top_k))):
            timed(shape_name, mode, lambda kw=kw: lambda: _launch_select(
                log_masses, step_lens, sel_lists, sel_counts, num_kv_heads=KV_HEADS,
                max_pages=s.pages, ways=ways, **kw))
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
        with open(out_path, "w") as f:
            json.dump(report, f, indent=1)
        torch.cuda.empty_cache()
    print(f"wrote {out_path}")


# outputs of random attention are below 1 in magnitude, where two bf16 ulps are at most 2^-7:
# two correct kernels that only round differently stay within it (sessions 4-6: 2^-9)
CHECK_TOLERANCE = 2 ** -7


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


if __name__ == "__main__":
    main()
