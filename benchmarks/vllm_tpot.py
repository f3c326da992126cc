"""Time per output token in vLLM (issue 5, paper Tables 3 and 7): dense FA3 against Moira, one
engine per invocation, random weights, every shape of the list in turn.

    PYTHONPATH=/tmp/site:. python3 benchmarks/vllm_tpot.py --backend moira \
        [--model llama-3.1-8b] [--gamma 0.98] [--shapes 8k32,16k32,32k16,64k8,130k4] \
        [--tokens 256] [--repeats 2] [--schedule rows|balanced] [--out $OUT/tpot.json]

Random weights make attention nearly uniform, so the coverage rule would keep every page. Moira
therefore runs with *imposed* read fractions (``imposed_fraction``): per (layer, KV head),
fractions with the paper's spread around the mean the paper measured for the model, gamma and
context (its Tables 3 and 7), through the same Estimate -> Select (fixed count per row) ->
Attend -> Merge kernels, so the selection cost is paid. The fractions are imposed, not chosen by
the rule; the JSON says so.

Protocol per shape: the prompts (random token ids) are first run with one output token, which
fills the KV cache and, with prefix caching on, leaves every prompt cached; the timed run then
starts all requests in the same step (a one-token prefill each) and decodes ``--tokens`` tokens
in pure decode steps. TPOT per request = (last token time - first token time) / (tokens - 1)
from vLLM's request metrics; the shape's figure is the median over requests, per repeat.
"""

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from serve_bench import tpot_ms  # noqa: E402
from vllm_checks import model_dir  # noqa: E402

SHAPES = {"8k32": (8192, 32), "16k32": (16384, 32), "32k16": (32768, 16), "64k8": (65536, 8),
          "130k4": (130000, 4),
          # a single request (issue 5, item 4): where Moira's fixed per-step cost can lose
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


# the kernels' tuning constants an engine of this script may be given (--kernel-setting)
KERNEL_SETTINGS = {"estimate": ("QUERY_HEAD_AHEAD", "TARGET_PROGRAMS", "PAGES_PER_PROGRAM",
                                "NUM_WARPS", "MAX_REGISTERS", "IMPLEMENTATION",
                                "CUDA_FROM_PAGES"),
                   "estimate_cuda": ("TARGET_PROGRAMS", "MIN_BLOCKS_PER_SM"),
                   "estimate_select_cuda": ("FUSED", "MIN_ROWS"),
                   "select": ("IMPLEMENTATION", "CUDA_FROM_PAGES", "EIGHT_WARPS_FROM"),
                   "attend": ("PAGE_IDS_AHEAD", "PAGES_PER_ITER", "NUM_STAGES", "NUM_WARPS",
                              "MAX_REGISTERS", "IMPLEMENTATION", "CUDA_STAGES")}
# the constants that only a module's Triton kernel reads (Attend's and, from 256-page tables,
# Estimate's "auto" default runs the CUDA one)
TRITON_ONLY_SETTINGS = ("attend.PAGES_PER_ITER", "attend.NUM_STAGES", "attend.NUM_WARPS",
                        "attend.MAX_REGISTERS", "estimate.QUERY_HEAD_AHEAD",
                        "estimate.TARGET_PROGRAMS", "estimate.PAGES_PER_PROGRAM",
                        "estimate.NUM_WARPS", "estimate.MAX_REGISTERS")
# the settings that take a word, not an int
WORD_SETTINGS = {"attend.IMPLEMENTATION": ("auto", "triton", "cuda"),
                 "estimate.IMPLEMENTATION": ("auto", "triton", "cuda"),
                 "select.IMPLEMENTATION": ("auto", "triton", "cuda"),
                 "estimate_select_cuda.FUSED": ("auto", "on", "off")}


def add_kernel_settings(parser):
    """The ``--kernel-setting`` option (read with ``parse_kernel_settings``)."""
    parser.add_argument("--kernel-setting", action="append", default=[],
                        metavar="MODULE.NAME=INT",
                        help="a tuning constant of moira/kernels/<MODULE>.py, e.g. "
                             "estimate_cuda.MIN_BLOCKS_PER_SM=4 or attend.IMPLEMENTATION=cuda "
                             "(repeatable), to try a candidate before it becomes the default "
                             "(an engine runs in this process, so the kernels see it)")


def parse_kernel_settings(parser, items):
    """``["module.NAME=INT", ...]`` -> ``{"module.NAME": int}`` (the ``*_AHEAD`` options as
    bools, ``WORD_SETTINGS`` as their words), or a usage error."""
    settings = {}
    for item in items:
        key, _, value = item.partition("=")
        module, _, name = key.partition(".")
        words = WORD_SETTINGS.get(key)
        if name not in KERNEL_SETTINGS.get(module, ()) or not (
                value in words if words else value.lstrip("-").isdigit()):
            known = ", ".join(f"{m}.{n}" for m, names in KERNEL_SETTINGS.items() for n in names)
            parser.error(f"--kernel-setting {item!r}: use MODULE.NAME=INT, one of {known} "
                         f"({', '.join(f'{k}: {v}' for k, v in WORD_SETTINGS.items())})")
        settings[key] = value if words else (bool(int(value)) if name.endswith("_AHEAD")
                                             else int(value))
    # a Triton kernel's knobs do nothing to the CUDA kernel that "auto" may run (Attend from
    # session 36, Estimate from 38): a candidate for them must say which kernel it tunes
    for module in ("attend", "estimate"):
        triton_knobs = [key for key in settings
                        if key in TRITON_ONLY_SETTINGS and key.startswith(module + ".")]
        if triton_knobs and f"{module}.IMPLEMENTATION" not in settings:
            parser.error(f"--kernel-setting {', '.join(triton_knobs)}: the Triton {module} "
                         f"kernel's; add {module}.IMPLEMENTATION=triton (the default, 'auto', "
                         f"may run the CUDA one)")
    return settings


def apply_kernel_settings(settings):
    """Set ``parse_kernel_settings``' result on the kernel modules (read at each launch)."""
    import importlib

    for key, value in settings.items():
        module, name = key.split(".")
        setattr(importlib.import_module(f"moira.kernels.{module}"), name, value)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", choices=["dense", "moira"], required=True)
    parser.add_argument("--model", default="llama-3.1-8b", choices=["llama-3.1-8b", "qwen3-4b"])
    parser.add_argument("--gamma", type=float, default=0.98, choices=[0.98, 0.99])
    parser.add_argument("--shapes", default="8k32,16k32,32k16,64k8,130k4",
                        help=f"comma-separated, of {','.join(SHAPES)}")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--schedule", default="rows", choices=["rows", "balanced"],
                        help="moira: how Attend splits its work (MoiraConfig.schedule)")
    parser.add_argument("--dense-below-tokens", type=int, default=None,
                        help="moira: a step of B requests reads rows of at most this / B "
                             "tokens in full (0: off; default: the plugin's)")
    parser.add_argument("--programmatic-launch", action="store_true",
                        help="moira: the decode kernels chained by programmatic dependent "
                             "launch (MoiraConfig.programmatic_launch)")
    parser.add_argument("--fused-cache-write", action=argparse.BooleanOptionalAction,
                        default=None,
                        help="moira: pure decode steps write K/V inside Estimate's launch, "
                             "or not (plugin setting fused_cache_write; default: the "
                             "plugin's, on since session 23)")
    parser.add_argument("--floor-rows", type=int, default=None,
                        help="moira: Attend's split, MoiraConfig.floor_rows (default: its own)")
    parser.add_argument("--min-programs", type=int, default=None,
                        help="moira: Attend's split, MoiraConfig.min_programs (default: its own)")
    parser.add_argument("--min-chunks-per-row", type=int, default=None,
                        help="moira: Attend's split, MoiraConfig.min_chunks_per_row (N_J; "
                             "default: its own)")
    parser.add_argument("--max-chunks-per-row", type=int, default=None,
                        help="moira: Attend's split, MoiraConfig.max_chunks_per_row (default: "
                             "its own; 4096: J from Eq. 4 alone, as before session 20)")
    parser.add_argument("--step-programs", type=int, default=None,
                        help="moira: Attend's split, MoiraConfig.step_programs (default: its "
                             "own; 0: Eq. 4's floor C alone)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="the engine's max_model_len (default: the longest shape + the "
                             "tokens + 64; 131072 sizes the block table as serve_bench.sh's "
                             "server, 2,048 pages per row)")
    add_kernel_settings(parser)
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "tpot.json"))
    args = parser.parse_args()
    kernel_settings = parse_kernel_settings(parser, args.kernel_setting)

    import torch
    import triton
    import vllm
    from vllm import LLM, SamplingParams

    import moira.integrations.vllm as plugin
    from moira.integrations.vllm.settings import SPLIT_SETTINGS, MoiraSettings

    plugin.register()
    apply_kernel_settings(kernel_settings)
    shapes = [(name, *SHAPES[name]) for name in args.shapes.split(",")]
    knots = paper_knots(args.model, args.gamma)
    extra = {}
    if args.backend == "moira":
        extra = dict(attention_backend="CUSTOM",
                     additional_config={"moira": {"imposed_fraction": knots,
                                                  "stats_interval": 0,
                                                  "schedule": args.schedule,
                                                  "programmatic_launch":
                                                      args.programmatic_launch}})
        if args.fused_cache_write is not None:
            extra["additional_config"]["moira"]["fused_cache_write"] = args.fused_cache_write
        for key in ("dense_below_tokens", *SPLIT_SETTINGS):
            if getattr(args, key) is not None:
                extra["additional_config"]["moira"][key] = getattr(args, key)
    else:
        extra = dict(attention_backend="FLASH_ATTN")
    settings = (MoiraSettings.from_sources(extra["additional_config"], os.environ)
                if args.backend == "moira" else None)  # what the plugin runs with
    longest = max(context for _, context, _ in shapes)
    max_model_len = max(args.max_model_len or 0, longest + args.tokens + 64)
    max_num_seqs = max(b for _, _, b in shapes)
    start = time.time()
    # vLLM's warm-up runs one request of max_num_batched_tokens tokens; beyond max_model_len
    # it writes past the request's block table and FA3 faults (2k1,8k1 alone did, session 12)
    llm = LLM(model=model_dir(args.model, 0), load_format="dummy", skip_tokenizer_init=True,
              block_size=64, max_model_len=max_model_len,
              enable_prefix_caching=True, max_num_seqs=max_num_seqs,
              max_num_batched_tokens=min(16384, max_model_len * max_num_seqs),
              gpu_memory_utilization=0.88, seed=0,
              disable_log_stats=False, **extra)
    startup = time.time() - start
    rng = random.Random(0)
    results = []
    for name, context, batch in shapes:
        t0 = time.time()
        prompts = cached_prompts(llm, rng, context, batch)
        fill = time.time() - t0
        for repeat in range(args.repeats):
            t0 = time.time()
            outputs = llm.generate(prompts, SamplingParams(max_tokens=args.tokens,
                                                           ignore_eos=True, detokenize=False),
                                   use_tqdm=False)
            wall = time.time() - t0
            tpots = []
            for out in outputs:
                m = out.metrics
                tokens = len(out.outputs[0].token_ids)
                tpots.append(tpot_ms(m.first_token_ts, m.last_token_ts, tokens))
            row = dict(shape=name, context=context, batch=batch, repeat=repeat,
                       tpot_ms=statistics.median(tpots), tpot_ms_min=min(tpots),
                       tpot_ms_max=max(tpots), generate_s=round(wall, 2),
                       fill_s=round(fill, 1),
                       all_finished=all(o.finished for o in outputs),
                       imposed_read_fraction=imposed_mean(knots, context)
                       if args.backend == "moira" else None)
            results.append(row)
            print(json.dumps(row), flush=True)
        with open(args.out, "w") as f:
            json.dump(dict(backend=args.backend, model=args.model, gamma=args.gamma,
                           max_model_len=max_model_len,
                           schedule=args.schedule if args.backend == "moira" else None,
                           programmatic_launch=args.programmatic_launch
                           if args.backend == "moira" else None,
                           dense_below_tokens=settings.dense_below_tokens if settings else None,
                           fused_cache_write=settings.fused_cache_write if settings else None,
                           # what the report compares variants with (older files: all off)
                           plugin_defaults=dict(fused_cache_write=MoiraSettings()
                                                .fused_cache_write) if settings else None,
                           exact_prefill=settings.exact_prefill if settings else None,
                           floor_rows=settings.floor_rows if settings else None,
                           min_programs=settings.min_programs if settings else None,
                           step_programs=settings.step_programs if settings else None,
                           # vLLM's cache layout when set (HND: a page-head's K|V contiguous)
                           kv_cache_layout=os.environ.get("VLLM_KV_CACHE_LAYOUT") or None,
                           min_chunks_per_row=settings.min_chunks_per_row if settings else None,
                           max_chunks_per_row=settings.max_chunks_per_row if settings else None,
                           # what Attend ran with, set or default (None: the setting unset)
                           attend_split={key: getattr(settings.config, key) for key in
                                         ("chunk_pages", *SPLIT_SETTINGS)} if settings else None,
                           kernel_settings=kernel_settings or None,
                           commit=subprocess.run(["git", "rev-parse", "HEAD"],
                                                 capture_output=True, text=True).stdout.strip(),
                           fractions="imposed (paper's measured reads), not the coverage rule"
                           if args.backend == "moira" else None,
                           startup_s=round(startup, 1), gpu=torch.cuda.get_device_name(),
                           versions=dict(torch=torch.__version__, vllm=vllm.__version__,
                                         triton=triton.__version__),
                           command="python3 " + " ".join(sys.argv),
                           date=time.strftime("%Y-%m-%d %H:%M:%S"), results=results), f,
                      indent=1)


if __name__ == "__main__":
    main()
