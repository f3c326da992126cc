"""What the benchmark entry points share.

- Geometry: one decode layer of Llama-3.1-8B (8 KV heads, G = 4, head_dim 128, bf16, 64-token
  pages) and the byte counts of its reads.
- Inputs bigger than the L2: Estimate's input rotated over copies that together exceed twice
  the H200's 60 MiB L2 (``estimate_rotation``), as an engine's consecutive layers read it.
- Timing: medians of CUDA-graph replays (``triton.testing.do_bench_cudagraph``: no host launch
  cost in the number), ``do_bench`` (CUDA events, L2 flushed between calls) where a call cannot
  be captured, host time for host-side work.
- Kernel choice: ``--kernels "attend=cuda,attend.cuda_stages=3"`` parsed into a
  ``moira.KernelOptions`` (``add_kernel_options`` / ``kernel_options``), and the stage
  launchers a workspace's options pick (``estimate``, ``select``) for timing one stage alone.
- Results: JSON with the command, GPU, versions, date, commit, whether the tree was dirty and
  the hash of its diff (``run_info``); markdown sections between ``<!-- NAME:begin/end -->`` markers
  (``write_section``); matplotlib without a display (``pyplot``).
- vLLM engines: the model configs of ``benchmarks/models``, the engine shapes and the paper's
  read fractions that Moira's engines impose on random weights.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = os.path.join(REPO, "benchmarks", "models")

# --------------------------------------------------------------------------------------------
# Geometry and bytes
# --------------------------------------------------------------------------------------------

KV_HEADS, GROUP, HEAD_DIM, PAGE = 8, 4, 128, 64
PAGE_BYTES = 2 * PAGE * HEAD_DIM * 2  # K and V of one page of one KV head, bf16
L2_BYTES = 60 << 20  # the H200's


def tbps(bytes_read, us):
    """Terabytes per second of ``bytes_read`` in ``us`` microseconds."""
    return bytes_read / us / 1e6


def estimate_bytes(rows, pages, summary_size, cache_size=2, group=GROUP, head_dim=HEAD_DIM,
                   estimator="mvar"):
    """HBM bytes of one Estimate launch over ``rows`` rows of ``pages`` pages each (>= 2):
    every page's summary (``estimator``'s rows: mean and variance, or bounds and codes), the
    sink's and the current page's keys (computed exactly), and the G float32 log-masses
    written per page."""
    from moira.config import summary_rows

    summaries = rows * pages * summary_rows(estimator, summary_size) * head_dim * summary_size
    exact_keys = rows * 2 * PAGE * head_dim * cache_size
    log_masses = rows * group * pages * 4
    return summaries + exact_keys + log_masses


def estimate_rotation(summaries, table, pages, bytes_per_call, min_bytes=2 * L2_BYTES + (8 << 20)):
    """``(summaries, block_table)`` pairs for Estimate to rotate over, as an engine's consecutive
    layers do: copies of the summaries that together exceed twice the L2, each with the table's
    first ``pages`` columns rolled, so that its sink and current pages are other physical pages
    (whose keys the previous call did not leave in the L2). Every physical page must have a
    summary (summarize with every page full)."""
    import torch

    copies = max(1, -(-min_bytes // bytes_per_call))
    return [(summaries if i == 0 else summaries.clone(),
             torch.cat([table[:, :pages].roll(i, dims=1), table[:, pages:]], dim=1))
            for i in range(copies)]


def step_inputs(context, batch):
    """One layer's inputs ``(query, keys, values, summaries, block_table, seq_lens)`` on the
    GPU: each row one token short of a full page (the common decode step), pages scattered at
    random in the cache, and the summaries of every page (for ``estimate_rotation``)."""
    import torch

    import moira

    pages = context // PAGE
    keys = torch.randn(batch * pages, PAGE, KV_HEADS, HEAD_DIM, device="cuda",
                       dtype=torch.bfloat16)
    values = torch.randn_like(keys)
    table = torch.randperm(batch * pages, device="cuda").view(batch, pages).int()
    full = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    query = torch.randn(batch, KV_HEADS * GROUP, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    summaries = moira.summarize(keys, table, full)
    return query, keys, values, summaries, table, full - 1


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------


def graph_us(fn, rep=100):
    """Median µs of ``fn`` replayed from a CUDA graph (no host launch cost in the number)."""
    import torch
    import triton

    fn()  # compile / JIT outside the capture
    # do_bench_cudagraph's side stream does not wait for this one: inputs still being written
    # here would be read half-made
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median") * 1e3


def timed_us(fn, rep=60):
    """``(median µs, how)``: CUDA-graph replays of ``fn`` ("graph"); if ``fn`` cannot be
    captured, ``do_bench`` (CUDA events, the L2 flushed between calls: "eager")."""
    import torch
    import triton

    try:
        return graph_us(fn, rep), "graph"
    except Exception as error:  # noqa: BLE001
        print(f"  not capturable ({type(error).__name__}: {str(error)[:120]}); eager timing")
        torch.cuda.synchronize()
        return triton.testing.do_bench(fn, rep=rep, return_mode="median") * 1e3, "eager"


def host_us(fn, repeats=30):
    """Median µs of ``fn`` on the host clock (host-side work, e.g. a planner)."""
    import torch

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def call_stats(durations_us):
    """Calls, the 10th / 90th percentiles (nearest rank), median and largest duration (µs)."""
    ordered = sorted(durations_us)

    def at(q):  # the smallest value with at least q of the calls at or below it
        return round(ordered[max(0, math.ceil(q * len(ordered)) - 1)], 2)
    return dict(calls=len(ordered), p10_us=at(0.1),
                median_us=round(statistics.median(ordered), 2), p90_us=at(0.9),
                max_us=round(ordered[-1], 2))


# kernel class by a substring of a profiled kernel's name, first match wins
KERNEL_CLASSES = [("Attend", ("_attend_kernel", "_attend_balanced_kernel", "moira_attend_")),
                  ("Estimate", ("_estimate_kernel", "moira_estimate_")),
                  ("Select", ("_select_kernel", "moira_select_")),
                  ("Merge", ("_merge_kernel", "_merge_balanced_kernel")),
                  ("Summarize", ("_summarize",)),
                  ("FA3", ("flash_fwd", "FlashAttn", "flash::")),
                  # cuBLAS picks gemv kernels (and split-K reductions) for small-M GEMMs
                  ("GEMM", ("gemm", "Gemm", "GEMM", "cutlass", "xmma", "nvjet", "sm90_", "gemv",
                            "splitKreduce"))]


def kernel_class(name):
    """The ``KERNEL_CLASSES`` label of a kernel's name ("other" if none)."""
    for label, needles in KERNEL_CLASSES:
        if any(needle in name for needle in needles):
            return label
    return "other"


# --------------------------------------------------------------------------------------------
# Kernel options
# --------------------------------------------------------------------------------------------


def add_kernel_options(parser):
    """``--kernels`` (read with ``kernel_options``)."""
    parser.add_argument("--kernels", action="append", default=[], metavar="OPTIONS",
                        help="moira.KernelOptions in their text form, e.g. "
                             "'attend=cuda,attend.cuda_stages=3' or "
                             "'estimate=triton,estimate.num_warps=8' (repeatable: joined with "
                             "commas); a backend's tuning constant needs that stage's backend "
                             "named (names: moira/kernels/tuning.py)")


def kernel_options(parser, args):
    """``args.kernels`` as a ``moira.KernelOptions``, or a usage error."""
    from moira.config import KernelOptions

    text = ",".join(args.kernels or [])
    try:
        return KernelOptions.parse(text)
    except ValueError as error:
        parser.error(f"--kernels {text!r}: {error}")


def options_mapping(options):
    """A ``KernelOptions`` as the JSON mapping the vLLM plugin's ``kernels`` setting takes
    (``KernelOptions.from_mapping``), only what differs from the defaults; ``{}`` for the
    defaults."""
    from moira.config import KernelOptions

    default = KernelOptions()
    mapping = {stage: getattr(options, stage) for stage in ("estimate", "select", "attend",
                                                            "fused")
               if getattr(options, stage) != getattr(default, stage)}
    if options.tuning:
        mapping["tuning"] = dict(options.tuning)
    return mapping


def with_kernels(base, fields):
    """``base`` (a ``KernelOptions``) with ``fields`` on top: stage choices replaced, tuning
    merged (``{"attend": "cuda", "tuning": {"attend.cuda_stages": 3}}``)."""
    import dataclasses

    if not fields:
        return base
    tuning = {**dict(base.tuning), **fields.get("tuning", {})}
    return dataclasses.replace(base, **{k: v for k, v in fields.items() if k != "tuning"},
                               tuning=tuning)


def estimate(workspace, query, key_cache, summaries, block_table, seq_lens, scale, log_masses,
             new_kv=None, dense_below_pages=0, parts="all"):
    """One Estimate launch as ``sparse_decode`` runs it on ``workspace`` (its options pick the
    backend; never fused with Select). ``parts``: the CUDA kernel's exact or mvar programs
    alone ("exact", "mvar"; a measurement, not a step)."""
    from moira.config import ESTIMATOR_BITS
    from moira.kernels import backends
    from moira.kernels.cuda import estimate as cuda_estimate
    from moira.kernels.triton import estimate as triton_estimate

    options = workspace.config.kernels
    if backends.estimate(workspace, query, key_cache, summaries, block_table, seq_lens, new_kv,
                         log_masses) == "cuda":
        cuda_estimate.estimate(query, key_cache, summaries, block_table, seq_lens, scale,
                               log_masses, options=options, dense_below_pages=dense_below_pages,
                               new_kv=new_kv, parts=parts)
    elif parts != "all":
        raise ValueError(f"parts={parts!r} is a CUDA Estimate measurement; its options run "
                         f"the Triton one ({options.describe()})")
    else:
        triton_estimate.estimate(query, key_cache, summaries, block_table, seq_lens, scale,
                                 log_masses, options, dense_below_pages=dense_below_pages,
                                 programmatic_launch=workspace.config.programmatic_launch,
                                 new_kv=new_kv,
                                 bits=ESTIMATOR_BITS[workspace.config.estimator])


def select(workspace, log_masses, seq_lens, page_lists, page_counts, *, max_pages, gamma=0.98,
           top_k=None, ways=None, keep_fractions=None, gammas=None, dense_below_pages=0):
    """One Select launch as ``sparse_decode`` runs it on ``workspace`` (its options pick the
    backend); ``ways``: K_B (default: the workspace config's for ``max_pages``)."""
    from moira.kernels import backends
    from moira.kernels.cuda import select as cuda_select
    from moira.kernels.triton import select as triton_select

    ways = ways or workspace.config.bisection_ways_for(max_pages)
    num_kv_heads = workspace.num_kv_heads
    row_values, fractions, row_gammas = triton_select.row_values_of(keep_fractions, gammas,
                                                                    page_counts)
    if backends.select(workspace, log_masses, seq_lens, page_lists, page_counts, max_pages, ways,
                       row_values) == "cuda":
        cuda_select.select(log_masses, seq_lens, page_lists, page_counts,
                           num_kv_heads=num_kv_heads, max_pages=max_pages, gamma=gamma,
                           top_k=top_k, ways=ways, row_values=row_values, fractions=fractions,
                           row_gammas=row_gammas, dense_below_pages=dense_below_pages)
    else:
        triton_select.select(log_masses, seq_lens, page_lists, page_counts,
                             num_kv_heads=num_kv_heads, max_pages=max_pages, gamma=gamma,
                             top_k=top_k, ways=ways, options=workspace.config.kernels,
                             keep_fractions=keep_fractions, gammas=gammas,
                             dense_below_pages=dense_below_pages,
                             programmatic_launch=workspace.config.programmatic_launch)


# --------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------


def git_state(repo=None):
    """``(commit, dirty, diff_sha256)`` of the repository at ``repo`` (default: this one):
    tracked files changed make it dirty, and then ``diff_sha256`` is the SHA-256 of their
    changes (``git diff HEAD --binary | sha256sum``: a result file names the exact code that
    made it, given the diff); None when clean. ``(None, None, None)`` outside a git checkout."""
    repo = repo or REPO

    def git(*args, text=True):
        return subprocess.run(["git", *args], capture_output=True, text=text, cwd=repo,
                              timeout=30).stdout

    try:
        commit = git("rev-parse", "HEAD").strip()
        status = git("status", "--porcelain", "--untracked-files=no")
        dirty = bool(status.strip()) if commit else None
        diff = git("diff", "HEAD", "--binary", text=False) if dirty else None
    except (OSError, subprocess.SubprocessError):
        return None, None, None
    return (commit or None), dirty, (hashlib.sha256(diff).hexdigest() if dirty else None)


def versions(*packages):
    """Installed versions of torch, triton and ``packages`` (absent ones: "unavailable")."""
    import importlib.metadata

    found = {}
    for package in ("torch", "triton", *packages):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = "unavailable"
    return found


def gpu_name():
    """The GPU this process sees (torch's name; nvidia-smi's without a CUDA torch)."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name()
    except ImportError:
        pass
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10
                              ).stdout.splitlines()[0].strip()
    except (OSError, IndexError, subprocess.SubprocessError):
        return None


def run_info(*packages):
    """What every result file states: the command, GPU, versions, date (UTC), commit, whether
    the tree was dirty and, if it was, the SHA-256 of its diff against the commit."""
    commit, dirty, diff_sha256 = git_state()
    return dict(command="python3 " + " ".join(sys.argv), gpu=gpu_name(),
                versions=versions(*packages),
                date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
                commit=commit, dirty=dirty, diff_sha256=diff_sha256)


def write_json(path, data, compact=False):
    """``data`` to ``path`` (its folder made), indented unless ``compact``."""
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, **(dict(separators=(",", ":")) if compact else dict(indent=1)),
                  default=float)


def out_path(name):
    """``$OUT/name`` (the current folder without ``$OUT``)."""
    return os.path.join(os.environ.get("OUT", "."), name)


def repo_path(path):
    """``path`` as the generated notes cite it: from the repository root, wherever the file
    is."""
    return os.path.relpath(os.path.abspath(path), REPO)


def write_section(readme_path, name, text):
    """Replace the text between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->`` of a
    markdown file with ``text``."""
    with open(readme_path) as f:
        readme = f.read()
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if not pattern.search(readme):
        raise SystemExit(f"{readme_path} has no <!-- {name}:begin/end --> markers")
    readme = pattern.sub(lambda _: f"{begin}\n{text}\n{end}", readme)
    with open(readme_path, "w") as f:
        f.write(readme)


def pyplot():
    """matplotlib's pyplot on the Agg backend (no display on the GPU host)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def positive_ints(text):
    """An argparse type: comma-separated positive ints, e.g. ``261,2048``."""
    try:
        values = [int(value) for value in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive ints, e.g. 2048 or 261,2048; got "
                                         f"{text!r}")
    return values


# --------------------------------------------------------------------------------------------
# vLLM engines
# --------------------------------------------------------------------------------------------


def vllm_in_process():
    """The environment of an engine in this process, set before vLLM is imported: the engine
    core here (its kernels and the plugin's counters in this process), the PyTorch sampler,
    no hub access."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def model_dir(name, layers=0):
    """A folder holding ``benchmarks/models/<name>/config.json`` (``layers`` > 0: cut to that
    depth) for an engine with ``load_format="dummy"``."""
    import tempfile

    with open(os.path.join(MODELS, name, "config.json")) as f:
        config = json.load(f)
    if layers:
        config["num_hidden_layers"] = layers
    path = tempfile.mkdtemp(prefix=f"{name}-{layers or 'all'}-")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


# (context, batch) of the engine shapes
ENGINE_SHAPES = {"8k32": (8192, 32), "16k32": (16384, 32), "32k16": (32768, 16),
                 "64k8": (65536, 8), "130k4": (130000, 4),
                 # a single request: where Moira's fixed per-step cost can lose
                 "2k1": (2048, 1), "8k1": (8192, 1), "16k1": (16384, 1), "32k1": (32768, 1),
                 "64k1": (65536, 1),
                 # a few short requests: rows read in full up to dense_below_tokens / batch
                 "2k2": (2048, 2), "8k2": (8192, 2), "2k4": (2048, 4), "8k4": (8192, 4),
                 "16k4": (16384, 4)}
# mean fraction of pages read by context, from the paper (Table 3: gamma 0.98; Table 7: gamma
# 0.99) at 8k / 16k / 32k / 64k / 130k; other contexts interpolate in log length, clamped at
# the ends (so a 2k request reads the 8k fraction), as the plugin does per request
PAPER_CONTEXTS = [8192, 16384, 32768, 65536, 130000]
PAPER_READS = {
    ("llama-3.1-8b", 0.98): [0.42, 0.37, 0.31, 0.16, 0.15],
    ("llama-3.1-8b", 0.99): [0.55, 0.49, 0.43, 0.24, 0.22],
    ("qwen3-4b", 0.98): [0.49, 0.43, 0.39, 0.25, 0.21],
    ("qwen3-4b", 0.99): [0.60, 0.54, 0.50, 0.34, 0.28],
}


def paper_knots(model, gamma):
    """``imposed_fraction`` knots ``{context: mean fraction}`` for the plugin."""
    return {str(context): fraction
            for context, fraction in zip(PAPER_CONTEXTS, PAPER_READS[(model, gamma)])}


def imposed_mean(knots, context):
    """The mean fraction the plugin imposes at ``context`` (log-length interpolation)."""
    import numpy as np

    points = sorted((int(c), f) for c, f in knots.items())
    return float(np.interp(np.log(context), [np.log(c) for c, _ in points],
                           [f for _, f in points]))


def cached_prompts(llm, rng, context, batch):
    """``batch`` prompts of ``context`` random token ids, run once with one output token: with
    prefix caching on, a later run of them recomputes only the tokens past the last whole page
    cached (vLLM caps a hit at ``context - 1`` tokens), then decodes."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(100, 30000) for _ in range(context)])
               for _ in range(batch)]
    llm.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False),
                 use_tqdm=False)
    return prompts


def tpot_ms(first, last, tokens):
    """Time per output token after the first, in ms, from the first and last tokens' times in
    seconds (vLLM's definition)."""
    return (last - first) / (tokens - 1) * 1e3
