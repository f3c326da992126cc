"""Time per output token in vLLM: dense FA3 against Moira (paper Tables 3 and 7), random
weights, every shape of the list in turn; one engine per process.

    PYTHONPATH=. python3 benchmarks/vllm_tpot.py --backend moira [--model llama-3.1-8b] \\
        [--gamma 0.98] [--shapes 8k32,16k32,32k16,64k8,130k4] [--tokens 256] [--repeats 2] \\
        [--kernels attend=cuda,...] [--out $OUT/tpot.json]
    PYTHONPATH=. python3 benchmarks/vllm_tpot.py --pairs 2 [--arms dense,moira,pdl] \\
        [--shapes ...] [--engine-args "--max-model-len 131072"]

Random weights make attention nearly uniform, so the coverage rule would keep every page. Moira
therefore runs with *imposed* read fractions (the plugin's ``imposed_fraction``): per (layer,
KV head), fractions with the paper's spread around the mean the paper measured for the model,
gamma and context, through the same Estimate -> Select (fixed count per row) -> Attend ->
Merge kernels, so the selection cost is paid. The JSON says so.

Per shape the prompts (random token ids) first run with one output token, which fills the KV
cache and, with prefix caching on, leaves every prompt cached; the timed run then starts all
requests in the same step and decodes ``--tokens`` tokens in pure decode steps. TPOT per
request = (last token time - first token time) / (tokens - 1) from vLLM's request metrics;
the shape's figure is the median over requests, per repeat.

``--pairs N`` runs the paper's protocol instead: interleaved engines (``--arms``, default
dense then moira; each its own process) one after another on one GPU, N times, each timing
every shape once, to ``$OUT/pair<i>/<model>-<arm>.json``; ``report.py tpot --pairs`` gives
each pair's speedup and their mean. Arms beyond dense and moira change one thing of Moira's
engine: ``PAIR_ARMS``.
"""

import argparse
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
from common import ENGINE_SHAPES as SHAPES  # noqa: E402

# --pairs arms: (vllm_tpot.py arguments, file-name suffix after "<model>-", environment)
PAIR_ARMS = {
    "dense": (["--backend", "dense"], "dense", {}),
    "moira": (["--backend", "moira"], "moira-g098", {}),
    "g099": (["--backend", "moira", "--gamma", "0.99"], "moira-g099", {}),  # Table 7's reads
    # programmatic dependent launch
    "pdl": (["--backend", "moira", "--programmatic-launch"], "moira-g098-pdl", {}),
    # Attend's split at batch 1: chunk floor 2 pages, 32 chunks per row
    "split": (["--backend", "moira", "--floor-rows", "96", "--min-programs", "1"],
              "moira-g098-split", {}),
    # Eq. 4 alone (no short-row floor), and T = 128; J uncapped
    "eq4": (["--backend", "moira", "--step-programs", "0", "--max-chunks-per-row", "4096"],
            "moira-g098-eq4", {}),
    "t128": (["--backend", "moira", "--step-programs", "128", "--max-chunks-per-row", "4096"],
             "moira-g098-t128", {}),
    "jmin": (["--backend", "moira", "--min-programs", "1"], "moira-g098-jmin", {}),  # J = 32
    "n1024": (["--backend", "moira", "--min-programs", "1024"], "moira-g098-n1024", {}),
    # J from Eq. 4 alone (342 at batch 1 in a 2,048-page table)
    "jnocap": (["--backend", "moira", "--max-chunks-per-row", "4096"], "moira-g098-jnocap", {}),
    "nj16": (["--backend", "moira", "--min-chunks-per-row", "16"], "moira-g098-nj16", {}),
    # the new tokens' K/V written by vLLM's own kernel instead of in Estimate's launch
    "nofcw": (["--backend", "moira", "--no-fused-cache-write"], "moira-g098-nofcw", {}),
    # vLLM's head-major cache: each page-head's K|V rows in one 32 KiB run
    "hnd": (["--backend", "moira"], "moira-g098-hnd", {"VLLM_KV_CACHE_LAYOUT": "HND"}),
    # the kernel options of --kernels (the other arms run the defaults)
    "kern": (["--backend", "moira"], "moira-g098-kern", {}),
}


def pairs(parser, args):
    """Interleaved engines, one process each; only their result lines printed."""
    arms = args.arms.split(",")
    unknown = [arm for arm in arms if arm not in PAIR_ARMS]
    if unknown:
        parser.error(f"--arms: unknown {unknown}; known: {', '.join(PAIR_ARMS)}")
    if "kern" in arms and not args.kernels:
        parser.error("the kern arm runs the options of --kernels: give them")
    out = os.environ.get("OUT", ".")
    for pair in range(1, args.pairs + 1):
        os.makedirs(os.path.join(out, f"pair{pair}"), exist_ok=True)
        for arm in arms:
            arm_args, suffix, environment = PAIR_ARMS[arm]
            command = [sys.executable, os.path.abspath(__file__), "--model", args.model,
                       "--shapes", args.shapes, "--tokens", str(args.tokens), "--repeats", "1",
                       *arm_args, *shlex.split(args.engine_args),
                       "--out", os.path.join(out, f"pair{pair}", f"{args.model}-{suffix}.json")]
            if arm == "kern":
                command += [f"--kernels={text}" for text in args.kernels]
            print(f"pair {pair} {arm}: {shlex.join(command[1:])}", flush=True)
            with subprocess.Popen(command, env={**os.environ, **environment}, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as engine:
                for line in engine.stdout:
                    if "tpot_ms" in line or "Error" in line or "Traceback" in line:
                        print(line.rstrip()[:120], flush=True)
            if engine.returncode:
                print(f"pair {pair} {arm}: exit {engine.returncode}", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["dense", "moira"])
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
                             "plugin's)")
    parser.add_argument("--floor-rows", type=int, default=None,
                        help="moira: Attend's split, MoiraConfig.floor_rows (default: its own)")
    parser.add_argument("--min-programs", type=int, default=None,
                        help="moira: Attend's split, MoiraConfig.min_programs (default: its own)")
    parser.add_argument("--min-chunks-per-row", type=int, default=None,
                        help="moira: Attend's split, MoiraConfig.min_chunks_per_row (N_J; "
                             "default: its own)")
    parser.add_argument("--max-chunks-per-row", type=int, default=None,
                        help="moira: Attend's split, MoiraConfig.max_chunks_per_row (default: "
                             "its own; 4096: J from Eq. 4 alone)")
    parser.add_argument("--step-programs", type=int, default=None,
                        help="moira: Attend's split, MoiraConfig.step_programs (default: its "
                             "own; 0: Eq. 4's floor C alone)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="the engine's max_model_len (default: the longest shape + the "
                             "tokens + 64; 131072 sizes the block table as vllm_serve.py's "
                             "server, 2,048 pages per row)")
    common.add_kernel_options(parser)
    parser.add_argument("--out", default=common.out_path("tpot.json"))
    parser.add_argument("--pairs", type=int, default=0, metavar="N",
                        help="N interleaved rounds of --arms' engines, one process each")
    parser.add_argument("--arms", default="dense,moira",
                        help=f"--pairs: comma-separated, of {','.join(PAIR_ARMS)}")
    parser.add_argument("--engine-args", default="",
                        help="--pairs: more arguments for every engine, e.g. "
                             "'--max-model-len 131072'")
    args = parser.parse_args(argv)
    unknown = [name for name in args.shapes.split(",") if name not in SHAPES]
    if unknown:
        parser.error(f"--shapes: unknown {unknown}; known: {', '.join(SHAPES)}")
    options = common.kernel_options(parser, args)
    if args.pairs:
        return pairs(parser, args)
    if args.backend is None:
        parser.error("give --backend (one engine) or --pairs N")
    if args.backend == "dense" and args.kernels:
        parser.error("--kernels are Moira's: the dense engine runs FA3")
    common.vllm_in_process()

    import torch
    import vllm
    from vllm import LLM, SamplingParams

    import moira.integrations.vllm as plugin
    from moira.integrations.vllm.settings import SPLIT_SETTINGS, MoiraSettings

    plugin.register()
    shapes = [(name, *SHAPES[name]) for name in args.shapes.split(",")]
    knots = common.paper_knots(args.model, args.gamma)
    kernels = common.options_mapping(options)
    if args.backend == "moira":
        moira_config = {"imposed_fraction": knots, "stats_interval": 0,
                        "schedule": args.schedule,
                        "programmatic_launch": args.programmatic_launch}
        if kernels:
            moira_config["kernels"] = kernels
        if args.fused_cache_write is not None:
            moira_config["fused_cache_write"] = args.fused_cache_write
        for key in ("dense_below_tokens", *SPLIT_SETTINGS):
            if getattr(args, key) is not None:
                moira_config[key] = getattr(args, key)
        extra = dict(attention_backend="CUSTOM", additional_config={"moira": moira_config})
    else:
        extra = dict(attention_backend="FLASH_ATTN")
    settings = (MoiraSettings.from_sources(extra["additional_config"], os.environ)
                if args.backend == "moira" else None)  # what the plugin runs with
    longest = max(context for _, context, _ in shapes)
    max_model_len = max(args.max_model_len or 0, longest + args.tokens + 64)
    max_num_seqs = max(b for _, _, b in shapes)
    start = time.time()
    # vLLM's warm-up runs one request of max_num_batched_tokens tokens; beyond max_model_len
    # it writes past the request's block table and FA3 faults
    llm = LLM(model=common.model_dir(args.model), load_format="dummy", skip_tokenizer_init=True,
              block_size=64, max_model_len=max_model_len,
              enable_prefix_caching=True, max_num_seqs=max_num_seqs,
              max_num_batched_tokens=min(16384, max_model_len * max_num_seqs),
              gpu_memory_utilization=0.88, seed=0,
              disable_log_stats=False, **extra)
    startup = time.time() - start
    rng = random.Random(0)
    results = []
    info = common.run_info("vllm")
    for name, context, batch in shapes:
        t0 = time.time()
        prompts = common.cached_prompts(llm, rng, context, batch)
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
                tpots.append(common.tpot_ms(m.first_token_ts, m.last_token_ts, tokens))
            row = dict(shape=name, context=context, batch=batch, repeat=repeat,
                       tpot_ms=statistics.median(tpots), tpot_ms_min=min(tpots),
                       tpot_ms_max=max(tpots), generate_s=round(wall, 2),
                       fill_s=round(fill, 1),
                       all_finished=all(o.finished for o in outputs),
                       imposed_read_fraction=common.imposed_mean(knots, context)
                       if args.backend == "moira" else None)
            results.append(row)
            print(json.dumps(row), flush=True)
        common.write_json(args.out, dict(
            backend=args.backend, model=args.model, gamma=args.gamma,
            max_model_len=max_model_len,
            schedule=args.schedule if settings else None,
            programmatic_launch=args.programmatic_launch if settings else None,
            dense_below_tokens=settings.dense_below_tokens if settings else None,
            fused_cache_write=settings.fused_cache_write if settings else None,
            # what the report compares variants with
            plugin_defaults=dict(fused_cache_write=MoiraSettings().fused_cache_write)
            if settings else None,
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
            # the kernel options the plugin ran with, --kernels' or MOIRA_KERNELS' (None: the
            # defaults)
            kernels=(common.options_mapping(settings.kernels) or None) if settings else None,
            fractions="imposed (paper's measured reads), not the coverage rule"
            if settings else None,
            startup_s=round(startup, 1), gpu=torch.cuda.get_device_name(),
            versions=dict(info["versions"], vllm=vllm.__version__),
            command=info["command"], date=info["date"], commit=info["commit"],
            dirty=info["dirty"], results=results))


if __name__ == "__main__":
    main()
