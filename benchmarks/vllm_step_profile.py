"""One decode step in vLLM broken into kernels (paper Table 4): dense FA3 or Moira at the
paper's read fractions, Llama-3.1-8B geometry, random weights, FULL CUDA graphs.

    PYTHONPATH=. python3 benchmarks/vllm_step_profile.py --backend moira \
        [--shapes 8k32,32k16,130k4] [--steps 32] [--max-model-len 131072] \
        [--kernels attend=cuda,...] [--out $OUT/step-moira.json]

Per shape: the prompts fill the cache (one output token, prefix caching on), then a second run
of ``--steps`` tokens is traced with the PyTorch profiler (CUPTI reports the kernels inside
replayed CUDA graphs one by one). GPU time per decode step is summed by kernel class (Attend,
Estimate, Select, Merge, Summarize, FA3, GEMM, other) and divided by the number of decode
steps; beside it, the traced span and the GPU's idle time in it (waiting on the host), the wall
time per step, the waits before each of Moira's kernels and the per-call spread of the top
kernels. Prompts are the shape's context rounded up to whole 64-token pages plus one token, so
the traced run's prefix-cache hit covers every full page and its first step recomputes one
token per request: every traced step has a decode's shape. ``report.py step`` tabulates the
files.
"""

import argparse
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
from common import ENGINE_SHAPES as SHAPES  # noqa: E402
from common import call_stats, kernel_class  # noqa: E402


def edges(kernels):
    """Where a layer's Moira kernels wait, from ``(label, start_us, end_us)`` in start order:
    the GPU time between each kernel's start and the end of the kernel before it (summed by
    the later kernel's class: a launch gap or a drained wave that a fused or programmatic
    launch could hide), and each chain's span from an Estimate's start to the next Merge's end
    (the four kernels of one layer with their edges)."""
    gaps, chains, busy_until, chain_start = {}, [], None, None
    for label, start, end in kernels:
        if busy_until is not None:
            gaps.setdefault(label, []).append(max(0.0, start - busy_until))
        busy_until = end if busy_until is None else max(busy_until, end)
        if label == "Estimate":
            chain_start = start
        elif label == "Merge" and chain_start is not None:
            chains.append(end - chain_start)
            chain_start = None
    return gaps, chains


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", choices=["dense", "moira"], required=True)
    parser.add_argument("--shapes", default="8k32,32k16,130k4")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="the engine's max_model_len (default: the longest shape + the "
                             "steps + 64; 131072 sizes the block table as vllm_serve.py's "
                             "server, 2,048 pages per row)")
    common.add_kernel_options(parser)
    parser.add_argument("--out", default=common.out_path("step-profile.json"))
    args = parser.parse_args(argv)
    options = common.kernel_options(parser, args)
    if args.backend == "dense" and args.kernels:
        parser.error("--kernels are Moira's: the dense engine runs FA3")
    common.vllm_in_process()

    import torch
    import vllm
    from torch.profiler import ProfilerActivity, profile
    from vllm import LLM, SamplingParams

    import moira.integrations.vllm as plugin
    from moira.integrations.vllm.settings import SPLIT_SETTINGS, MoiraSettings

    plugin.register()
    shapes = [(name, *SHAPES[name]) for name in args.shapes.split(",")]
    knots = common.paper_knots("llama-3.1-8b", 0.98)
    extra = dict(attention_backend="FLASH_ATTN")
    if args.backend == "moira":
        extra = dict(attention_backend="CUSTOM", additional_config={
            "moira": {"imposed_fraction": knots, "stats_interval": 0}})
        if common.options_mapping(options):
            extra["additional_config"]["moira"]["kernels"] = common.options_mapping(options)
    # what the plugin runs with, MOIRA_* variables included (they change Attend's split)
    settings = (MoiraSettings.from_sources(extra["additional_config"], os.environ)
                if args.backend == "moira" else None)
    longest = max(context for _, context, _ in shapes)
    max_model_len = max(args.max_model_len or 0, longest + args.steps + 64)
    max_num_seqs = max(b for _, _, b in shapes)
    llm = LLM(model=common.model_dir("llama-3.1-8b"), load_format="dummy",
              skip_tokenizer_init=True,
              block_size=64, max_model_len=max_model_len, enable_prefix_caching=True,
              max_num_seqs=max_num_seqs,
              # vLLM's warm-up request of this many tokens must fit max_model_len
              max_num_batched_tokens=min(16384, max_model_len * max_num_seqs),
              gpu_memory_utilization=0.88, seed=0, **extra)
    rng = random.Random(0)
    results = []
    for name, context, batch in shapes:
        # one token past whole pages: a prefix-cache hit covers every full page (vLLM caps a
        # hit at prompt_len - 1 tokens, in whole pages), so the traced run recomputes just
        # that token per request and its first step is decode-shaped too (130000 is not a
        # multiple of 64: 130001 tokens would recompute 17 per request, through FA3)
        prompt_tokens = -(-context // 64) * 64 + 1
        prompts = common.cached_prompts(llm, rng, prompt_tokens, batch)
        timed = SamplingParams(max_tokens=args.steps, ignore_eos=True, detokenize=False)
        llm.generate(prompts, timed, use_tqdm=False)  # warm: graphs and caches in place
        with profile(activities=[ProfilerActivity.CUDA]) as trace:
            started = time.perf_counter()
            llm.generate(prompts, timed, use_tqdm=False)
            wall_s = time.perf_counter() - started
        activity = sorted((e for e in trace.events() if e.device_type.name == "CUDA"
                           and e.device_time_total > 0), key=lambda e: e.time_range.start)
        kernels = [e for e in activity if "Memcpy" not in e.name and "Memset" not in e.name]
        by_class = {}
        for event in kernels:
            label = kernel_class(event.name)
            by_class[label] = by_class.get(label, 0.0) + event.device_time_total
        # the traced run is `steps` engine steps: the prompts' last token (one query token per
        # request, so it takes the decode path too), then steps - 1 decode steps
        decode_steps = args.steps
        per_step_ms = {k: v / decode_steps / 1e3 for k, v in sorted(by_class.items())}
        # the GPU's idle time between kernels over the traced span: host-bound steps (the GPU
        # waiting for the next graph launch) show here and not in the kernel sums
        busy_until, idle_us = activity[0].time_range.start, 0.0
        for event in activity:  # copies too: they keep the GPU busy
            idle_us += max(0.0, event.time_range.start - busy_until)
            busy_until = max(busy_until, event.time_range.end)
        span_us = busy_until - activity[0].time_range.start
        gaps, chains = edges([(kernel_class(e.name), e.time_range.start, e.time_range.end)
                              for e in kernels])
        top, calls = {}, {}
        for event in kernels:
            top[event.name] = top.get(event.name, 0.0) + event.device_time_total
            calls.setdefault(event.name, []).append(event.device_time_total)
        top_names = sorted(top, key=lambda name: -top[name])[:15]
        row = dict(shape=name, context=context, prompt_tokens=prompt_tokens, batch=batch,
                   steps=args.steps,
                   # hundreds if CUPTI reported the graph replays kernel by kernel, not ~1
                   kernels_per_step=len(kernels) / decode_steps,
                   per_step_ms=per_step_ms, total_ms=sum(per_step_ms.values()),
                   gpu_span_ms_per_step=span_us / decode_steps / 1e3,
                   gpu_idle_ms_per_step=idle_us / decode_steps / 1e3,
                   wall_ms_per_step=wall_s / decode_steps * 1e3,
                   imposed_read_fraction=common.imposed_mean(knots, context)
                   if args.backend == "moira" else None,
                   gap_before_ms_per_step={label: sum(values) / decode_steps / 1e3
                                           for label, values in sorted(gaps.items())},
                   gap_before_calls={label: call_stats(values)
                                     for label, values in sorted(gaps.items())},
                   moira_chain_us=call_stats(chains) if chains else None,
                   top_kernels_ms_per_step={name: top[name] / decode_steps / 1e3
                                            for name in top_names},
                   # per call: whether a class's extra time is every call's or a few slow ones'
                   top_kernels_calls={name: call_stats(calls[name]) for name in top_names})
        results.append(row)
        print(json.dumps({k: row[k] for k in ("shape", "kernels_per_step", "per_step_ms",
                                              "total_ms", "gpu_span_ms_per_step",
                                              "gpu_idle_ms_per_step", "wall_ms_per_step",
                                              "gap_before_ms_per_step", "moira_chain_us")}),
              flush=True)
        info = common.run_info("vllm")
        common.write_json(args.out, dict(
            backend=args.backend, max_model_len=max_model_len, gpu=torch.cuda.get_device_name(),
            versions=dict(info["versions"], vllm=vllm.__version__),
            moira_settings=settings.describe() if settings else None,
            attend_split={key: getattr(settings.config, key) for key in
                          ("chunk_pages", *SPLIT_SETTINGS)} if settings else None,
            command=info["command"], date=info["date"], commit=info["commit"],
            dirty=info["dirty"],
            note="GPU time per step by kernel class, averaged over the traced run's steps (one "
                 "of which is the one-token prefill)",
            results=results))

if __name__ == "__main__":
    main()
