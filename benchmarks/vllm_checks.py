"""Checks of the vLLM plugin on the GPU, one engine per invocation, random weights; and the
comparison of their results.

    PYTHONPATH=. python3 benchmarks/vllm_checks.py MODE [--layers 4] [--kernels ...] \
        [--out F.json]
    python3 benchmarks/vllm_checks.py compare FOLDER [MORE_FOLDERS]

Modes (Llama-3.1-8B geometry from ``benchmarks/models``, ``--layers`` to cut the depth):

- ``dense``: FA3 backend, greedy decoding of the same prompts at batch P and as two batches of
  P/2 (how much two dense runs differ by batch size alone: the bar for the next mode).
  ``--backend FLASHINFER`` runs the same with vLLM's FlashInfer backend (name the file
  ``dense_flashinfer.json``): how early another exact dense kernel parts from FA3.
- ``moira``: Moira backend with ``check_dense`` on, so every step also runs dense FA3 on the
  same batch and counts where Moira differs (decode rows in bf16 ulps, other rows bitwise).
  ``--graph-mode NONE`` runs the same compiled model without CUDA graphs (eager steps);
  ``--compile-mode 0`` runs it without torch.compile (graph mode then FULL_DECODE_ONLY:
  vLLM would run a piecewise mode eager). With the dense check on, the backend allows no full
  graphs, so those engines run eager whatever the mode (the JSON's ``cudagraph_mode``).
- ``e2e``: a long run (``--context``, ``--batch``) with page-read statistics.
- ``prefix``: prefix caching on; the prompts share a ``--prefix``-token prefix. The first
  prompt runs alone, then all of them (the others' prefix pages come from the cache, so
  Moira must find their summaries written by the first run), then all again after
  ``reset_prefix_cache()`` (the first run's pages recomputed). The two full runs are compared;
  run it with ``--backend FLASH_ATTN`` too for the yardstick (recomputation changes batch
  shapes).
- ``preempt``: the same prompts with a KV cache of ``--blocks`` pages (default: the prompts'
  pages and one spare per request), too small for what they generate, so vLLM preempts and
  recomputes requests (``preemptions`` in the JSON counts them); compare its tokens with a
  ``moira`` / ``dense`` run of the same backend.

Prompts are random token ids of mixed lengths (partial last pages); ``--max-batched-tokens``
keeps prefills chunked, so decode rows and prefill rows share steps (mixed steps). Writes the
tokens, their log-probabilities, the top-2 log-prob gap of every step and the counters to
``--out``.

``--weights normal`` (default) redraws vLLM's dummy weights after loading: vLLM fills every
parameter from U(-1e-3, 1e-3), which makes every logit nearly equal (log-probs all
-log(vocab), greedy tokens alternating between two ids), so token comparisons would say nothing.
Here matrices get N(0, 1/fan_in), embeddings N(0, 1), norms 1: attention is far from uniform
and the next token depends on it.

``compare`` reads the runs of one or more folders (``NAME.json`` or ``NAME.json.gz``; names
must differ across folders) and prints greedy-token agreement and log-probability differences
between known pairs of runs (``PAIRS``), the first-difference yardstick (dense against Moira at
gamma 1, against dense at another batch size), Moira's dense-check counters and pages read.
"""

import argparse
import gzip
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402


def redraw_weights(model):
    import torch

    generator = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():  # in place: CUDA graphs captured at startup keep the addresses
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            elif param.dim() == 2:
                std = 1.0 if "embed" in name else param.shape[1] ** -0.5
                param.normal_(0.0, std, generator=generator)
    return True


def token_ids(rng, count, text_ids=None):
    """``count`` prompt token ids: random ids (random weights), or a slice of ``text_ids`` at a
    random offset (trained weights, real text)."""
    if text_ids is None:
        return [rng.randrange(100, 120000) for _ in range(count)]
    if count > len(text_ids):
        raise ValueError(f"the text has {len(text_ids)} tokens, fewer than a prompt's {count}")
    start = rng.randrange(len(text_ids) - count + 1)
    return list(text_ids[start:start + count])


def top2_gap(step):
    """Log-prob of the most likely token minus the second's (= their logit gap) at one step,
    from vLLM's ``{token: Logprob}`` (the sampled token and the top 2)."""
    best = sorted((entry.logprob for entry in step.values()), reverse=True)
    return best[0] - best[1] if len(best) > 1 else None


def graph_mode(compile_mode, asked, fa3_max_splits=None):
    """The cudagraph_mode to ask vLLM for. Without torch.compile vLLM turns a piecewise mode
    into NONE (eager) on its own, so that is refused rather than run as something else."""
    mode = asked or ("FULL_AND_PIECEWISE" if compile_mode else "FULL_DECODE_ONLY")
    mode = mode.upper()  # as vLLM reads it
    if compile_mode == 0 and "PIECEWISE" in mode:
        raise ValueError(f"--graph-mode {mode} needs torch.compile (vLLM would run the engine "
                         "eager); with --compile-mode 0 use FULL_DECODE_ONLY or NONE")
    if fa3_max_splits is not None and mode == "NONE":
        raise ValueError("--fa3-max-splits caps FA3 in full CUDA graphs only; drop "
                         "--graph-mode NONE")
    return mode


def engine_kernels(parser, args):
    """The engine's ``KernelOptions``: ``--kernels``, with the Triton Attend under FA3's
    normalizer (``--fa3-normalizer``) and loop order (``--fa3-arithmetic``) on top."""
    options = common.kernel_options(parser, args)
    if args.fa3_normalizer or args.fa3_arithmetic:
        tuning = {"attend.sum_rounded_weights": False}
        if args.fa3_arithmetic:
            tuning["attend.fa3_tile_order"] = True
        try:
            options = common.with_kernels(options, dict(attend="triton", tuning=tuning))
        except ValueError as error:
            parser.error(f"--fa3-normalizer / --fa3-arithmetic run the Triton Attend: {error}")
    if options != type(options)() and (args.mode == "dense" or args.backend == "FLASH_ATTN"):
        parser.error("--kernels and the FA3 options are Moira's; dense runs ignore them")
    return options


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["compare"]:
        return compare(argv[1:])
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["dense", "moira", "e2e", "prefix", "preempt"])
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--layers", type=int, default=0, help="0: the model's own depth")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--min-len", type=int, default=700)
    parser.add_argument("--max-len", type=int, default=5000)
    parser.add_argument("--context", type=int, default=0, help="e2e: every prompt this long")
    parser.add_argument("--batch", type=int, default=0, help="e2e: prompts")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--gamma", type=float, default=1.0)
    parser.add_argument("--backend", default=None,
                        help="override: FLASH_ATTN, FLASHINFER (dense mode) or CUSTOM")
    parser.add_argument("--graph-mode", default=None,
                        help="vLLM cudagraph_mode; default FULL_AND_PIECEWISE, or "
                             "FULL_DECODE_ONLY with --compile-mode 0 (vLLM turns a piecewise "
                             "mode into NONE without torch.compile). The JSON records the "
                             "mode the engine ran")
    parser.add_argument("--fa3-normalizer", action="store_true",
                        help="Attend sums the float32 softmax weights, as FA3 does, instead of "
                             "the rounded ones (the Triton Attend with "
                             "attend.sum_rounded_weights=false): does Moira then differ from "
                             "FA3 only as much as FA3 from itself?")
    parser.add_argument("--fa3-arithmetic", action="store_true",
                        help="FA3's normalizer and FA3's loop order and rounding (the Triton "
                             "Attend with attend.fa3_tile_order=true too)")
    parser.add_argument("--compile-mode", type=int, default=3, choices=[0, 3],
                        help="vLLM CompilationMode: 3 (default) torch.compile with vLLM's "
                             "Inductor passes; 0 plain eager PyTorch (with --graph-mode NONE: "
                             "no compiled artifact differs between two engines)")
    parser.add_argument("--capture-sizes", type=int, default=0,
                        help="N > 0: capture a graph for every batch size 1..N, so a replayed "
                             "step is never padded to a larger batch (padding changes the GEMMs' "
                             "shapes, hence their rounding, between graph and eager steps); 0: "
                             "vLLM's default sizes")
    parser.add_argument("--fa3-max-splits", type=int, default=None,
                        help="cap FA3's split count in full CUDA graphs (vLLM's "
                             "attention_config flash_attn_max_num_splits_for_cuda_graph, "
                             "default 32; eager steps use FA3's own heuristic). With 1, a "
                             "`dense` run reduces each row in one pass: the same engine and "
                             "batches, only attention's rounding changed (the yardstick for "
                             "Moira at gamma 1; save it as dense_splits1.json)")
    parser.add_argument("--no-check", action="store_true", help="moira: skip the dense check")
    parser.add_argument("--prefill-rows-alone", action="store_true",
                        help="the plugin's exact_prefill off: FA3 runs mixed steps' prefill "
                             "rows without the decode rows (the dense check counts where they "
                             "then differ from FA3 over the whole batch)")
    parser.add_argument("--weights", choices=["normal", "dummy"], default="normal")
    parser.add_argument("--hf-model", default=None,
                        help="a Hugging Face folder of trained weights (e.g. SmolLM2-135M as "
                             "../shared/data/get-model --hf writes it) instead of --model's "
                             "random ones; prompts are then slices of --text")
    parser.add_argument("--text", default=None,
                        help="with --hf-model: a .txt or {'text': ...} .json file")
    parser.add_argument("--max-batched-tokens", type=int, default=2048)
    parser.add_argument("--prefix", type=int, default=3000, help="prefix: shared tokens")
    parser.add_argument("--blocks", type=int, default=0,
                        help="preempt: KV cache pages (0: the prompts' pages and one spare "
                             "per request)")
    parser.add_argument("--dense-below-tokens", type=int, default=None,
                        help="the plugin's dense_below_tokens (default: the plugin's); 0 makes "
                             "every row select, so prefix/preempt exercise the summaries")
    parser.add_argument("--jit-verbose", action="store_true",
                        help="vLLM's jit_monitor_verbose: log every kernel compiled after "
                             "warm-up with its specialization (which launch missed warm-up). "
                             "For finding compilations only: engines with it part from the "
                             "same engine without it from the prefill on, and from each "
                             "other, so never compare its tokens")
    parser.add_argument("--gpu-memory", type=float, default=0.85,
                        help="vLLM's gpu_memory_utilization (lower it to share the GPU)")
    parser.add_argument("--out", default=common.out_path("check.json"))
    common.add_kernel_options(parser)
    args = parser.parse_args(argv)
    options = engine_kernels(parser, args)
    if args.prefill_rows_alone and (args.mode == "dense" or args.backend == "FLASH_ATTN"):
        parser.error("--prefill-rows-alone is a setting of Moira's backend; dense runs ignore it")
    if args.hf_model and (args.layers or not args.text):
        parser.error("--hf-model takes the model as it is (no --layers) and needs --text")
    try:
        args.graph_mode = graph_mode(args.compile_mode, args.graph_mode, args.fa3_max_splits)
    except ValueError as error:
        parser.error(str(error))

    common.vllm_in_process()
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import moira.integrations.vllm as plugin

    plugin.register()  # the entry point does this in every process; in-process it is enough
    from moira.integrations.vllm.state import DenseCheck, PageStatsLog

    rng = random.Random(0)
    if args.mode == "e2e":
        lengths = [args.context] * args.batch
    else:
        lengths = [rng.randint(args.min_len, args.max_len) for _ in range(args.prompts)]
    text_ids = None
    if args.hf_model:
        from transformers import AutoTokenizer

        from moira.evaluation.tasks import read_text

        text_ids = AutoTokenizer.from_pretrained(args.hf_model)(
            read_text(args.text), add_special_tokens=False)["input_ids"]
    shared = token_ids(rng, args.prefix if args.mode == "prefix" else 0, text_ids)
    prompts = [TokensPrompt(prompt_token_ids=shared + token_ids(rng, n, text_ids))
               for n in lengths]
    moira_backend = args.mode != "dense"
    backend = args.backend or ("CUSTOM" if moira_backend else "FLASH_ATTN")
    extra = {}
    if backend == "CUSTOM":
        check = args.mode == "moira" and not args.no_check
        if args.mode in ("prefix", "preempt") and args.gamma == 1.0:
            print("note: at gamma 1 every page is read and summaries do not matter; "
                  "use --gamma 0.9 to test them")
        settings = {"gamma": args.gamma, "check_dense": check, "stats_interval": 5.0}
        if args.dense_below_tokens is not None:
            settings["dense_below_tokens"] = args.dense_below_tokens
        if args.prefill_rows_alone:
            settings["exact_prefill"] = False
        if common.options_mapping(options):
            settings["kernels"] = common.options_mapping(options)
        extra["additional_config"] = {"moira": settings}
    start = time.time()
    if args.mode == "preempt":
        # every prompt fits, with one spare page per request, but not what the requests then
        # generate (--tokens 128: two or three pages each), so running requests run out of
        # pages and vLLM preempts and later recomputes some (a cache of a third of prompts
        # plus outputs only delays admissions: vLLM's preemption counter reads 0)
        prompt_pages = sum(-(-len(p["prompt_token_ids"]) // 64) for p in prompts)
        extra["num_gpu_blocks_override"] = args.blocks or prompt_pages + len(prompts) + 1
    if args.jit_verbose:
        extra["jit_monitor_verbose"] = True
    if args.fa3_max_splits is not None:
        extra["attention_config"] = {"flash_attn_max_num_splits_for_cuda_graph":
                                     args.fa3_max_splits}
    llm = LLM(model=args.hf_model or common.model_dir(args.model, args.layers),
              load_format="auto" if args.hf_model else "dummy", dtype="bfloat16",
              skip_tokenizer_init=True, block_size=64, attention_backend=backend,
              max_model_len=len(shared) + max(lengths) + args.tokens + 64,
              enable_prefix_caching=args.mode == "prefix",
              max_num_seqs=max(len(prompts), 8), max_num_batched_tokens=max(
                  args.max_batched_tokens, args.tokens), gpu_memory_utilization=args.gpu_memory,
              compilation_config={
                  "mode": args.compile_mode, "cudagraph_mode": args.graph_mode,
                  # no benchmarked kernel choices: engines compiled apart must compute alike
                  "inductor_compile_config": {"combo_kernels": False,
                                              "benchmark_combo_kernel": False},
                  **({"cudagraph_capture_sizes": list(range(1, args.capture_sizes + 1))}
                     if args.capture_sizes else {})}, seed=0,
              disable_log_stats=False, **extra)
    startup = time.time() - start
    if args.weights == "normal" and not args.hf_model:
        llm.apply_model(redraw_weights)
    # the two most likely tokens' log-probs at every step: their gap (the logit gap) at a
    # sequence's first difference says whether rounding alone could flip the choice (the
    # paper's Appendix B: every first divergence on a top-2 gap of 0-0.25)
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True,
                            detokenize=False, logprobs=2)

    def run(batch):
        t0 = time.time()
        outputs = llm.generate(batch, params, use_tqdm=False)
        seconds = time.time() - t0
        rows = []
        for out in outputs:
            completion = out.outputs[0]
            tokens = list(completion.token_ids)
            rows.append(dict(tokens=tokens,
                             logprobs=[step[token].logprob
                                       for token, step in zip(tokens, completion.logprobs)],
                             top2_gap=[top2_gap(step) for step in completion.logprobs],
                             finished=out.finished))
        return rows, seconds

    # the mode vLLM settled on (it may override the one asked for)
    ran_mode = llm.llm_engine.vllm_config.compilation_config.cudagraph_mode.name
    result = dict(mode=args.mode, backend=backend, args=vars(args), lengths=lengths,
                  cudagraph_mode=ran_mode, kernels=options.describe(),
                  commit=common.git_state()[0],
                  startup_s=round(startup, 1), gpu=torch.cuda.get_device_name(),
                  command="python3 " + " ".join(sys.argv))
    DenseCheck.layers.clear()
    if args.mode == "prefix":
        result["first"], _ = run(prompts[:1])  # writes the shared pages and their summaries
    result["full"], result["full_s"] = run(prompts)
    if args.mode == "prefix":
        llm.reset_prefix_cache()
        result["recomputed"], _ = run(prompts)
    if args.mode == "dense":
        half = len(prompts) // 2
        first, _ = run(prompts[:half])
        second, _ = run(prompts[half:])
        result["halves"] = first + second
    if moira_backend:
        result["dense_check"] = DenseCheck.read()
        totals = PageStatsLog(0).read()
        read = sum(r for r, _ in totals.values())
        present = sum(p for _, p in totals.values())
        result["pages"] = dict(read=read, present=present,
                               fraction=read / present if present else None,
                               per_layer={k: r / p for k, (r, p) in totals.items() if p})
    result["all_finished"] = all(row["finished"] for row in result["full"])
    # how many times the scheduler preempted a request over the engine's runs (vLLM's counter;
    # the preempt mode should show some, the others none)
    metrics = llm.get_metrics()
    result["preemptions"] = sum(metric.value for metric in metrics
                                if metric.name.startswith("vllm:num_preemptions"))
    # every counter and gauge as read, so a zero above can be told from a counter that is not
    # fed: generation_tokens_total must then be > 0
    result["metrics"] = {metric.name: metric.value for metric in metrics
                         if isinstance(getattr(metric, "value", None), (int, float))}
    with open(args.out, "w") as f:
        json.dump(result, f)
    summary = {k: v for k, v in result.items() if k not in ("full", "halves", "dense_check")}
    if "pages" in summary:
        summary["pages"] = {k: v for k, v in summary["pages"].items() if k != "per_layer"}
    print(json.dumps(summary, indent=1))
    if result.get("dense_check"):
        layers = list(result["dense_check"].values())
        print("dense check, summed over layers:",
              {k: sum(layer[k] for layer in layers) for k in layers[0]})



# --------------------------------------------------------------------------------------------
# compare: the runs' results side by side (CPU)
# --------------------------------------------------------------------------------------------


def agreement(a, b):
    """(prompts with identical tokens, first differing step or None per prompt, max |dlogprob|
    over the common prefix, bit-identical log-probs)."""
    same, first_diff, worst, bitwise = 0, [], 0.0, True
    for x, y in zip(a, b):
        same += x["tokens"] == y["tokens"]
        diff = next((i for i, (s, t) in enumerate(zip(x["tokens"], y["tokens"])) if s != t),
                    None)
        first_diff.append(diff)
        prefix = len(x["tokens"]) if diff is None else diff
        deltas = [abs(p - q) for p, q in zip(x["logprobs"][:prefix], y["logprobs"][:prefix])]
        worst = max([worst] + deltas)
        bitwise &= x["logprobs"] == y["logprobs"]
    return same, first_diff, worst, bitwise


def gaps_at_first_difference(a, b):
    """The top-2 log-prob gap (logit gap) of run ``a`` at each prompt's first differing step,
    for prompts that differ; None where ``a`` has no gaps recorded (older runs)."""
    gaps = []
    for x, diff in zip(a, agreement(a, b)[1]):
        if diff is not None:
            if x.get("top2_gap") is None:
                return None
            gaps.append(x["top2_gap"][diff])
    return gaps


# the runs compared with dense FA3 at the same batch, each a perturbation of attention alone:
# Moira at gamma 1, FA3 capped at one split, and FlashInfer's decode kernel (another exact
# dense kernel: how early a kernel that is not FA3 parts from it without any selection)
YARDSTICKS = {"moira_graph": "dense vs Moira gamma=1",
              "dense_splits1": "dense vs dense with FA3 at one split",
              "dense_flashinfer": "dense FA3 vs dense FlashInfer"}


def first_difference_gap(runs):
    """The yardstick on greedy tokens: the first differing step per prompt (a sequence
    that never differs counts as its length) of dense FA3 against Moira at gamma 1, and of
    dense against itself at another batch size; the mean of each and the 95% paired bootstrap
    interval of (Moira pair - dense pair). Where a ``dense_splits1`` run (dense FA3 capped at
    one split, same batch: attention's rounding alone changed) or a ``dense_flashinfer`` run
    (FlashInfer's kernel in FA3's place) is present, the same for it, and Moira's pair against
    it (``moira_minus_<run>``). None without the runs."""
    from moira.evaluation.experiments import paired_bootstrap

    if not ("dense" in runs and "halves" in runs["dense"]
            and any(name in runs for name in YARDSTICKS)):
        return None

    def steps(a, b):
        return [len(x["tokens"]) if d is None else d for x, d in zip(a, agreement(a, b)[1])]

    dense_pair = steps(runs["dense"]["full"], runs["dense"]["halves"])
    result = dict(prompts=len(dense_pair), dense=sum(dense_pair) / len(dense_pair))
    pairs = {name: steps(runs["dense"]["full"], runs[name]["full"])
             for name in YARDSTICKS if name in runs}
    for name, pair in pairs.items():
        key = "moira" if name == "moira_graph" else name
        result[key] = sum(pair) / len(pair)
        result[f"{key}_minus_dense"] = paired_bootstrap(dense_pair, pair)
    for name, pair in pairs.items():
        if name != "moira_graph" and "moira_graph" in pairs:
            result[f"moira_minus_{name}"] = paired_bootstrap(pair, pairs["moira_graph"])
    return result


def load_runs(folder):
    """``vllm_checks.py`` results by run name: ``NAME.json`` as written on the GPU host, or
    ``NAME.json.gz`` as committed (token ids and log-probs compress about fivefold)."""
    runs = {}
    for name in sorted(os.listdir(folder)):
        for suffix, opener in ((".json", open), (".json.gz", gzip.open)):
            if name.endswith(suffix):
                with opener(os.path.join(folder, name), "rt") as f:
                    runs[name[:-len(suffix)]] = json.load(f)
    return runs


def compare(folders):
    """Print the comparisons of the runs in ``folders`` (see the module's docstring)."""
    runs = {}
    for folder in folders:
        for name, run in load_runs(folder).items():
            if name in runs:
                sys.exit(f"run {name!r} is in two of the folders: compare them apart")
            runs[name] = run
    prompts = len(runs["dense"]["full"]) if "dense" in runs else 0
    # older runs did not record it (their args say what was asked for)
    moira_graphs = runs.get("moira_graph", {}).get("cudagraph_mode", "graph mode not recorded")
    pairs = [("dense", "full", "dense", "halves",
              f"dense batch {prompts} vs two batches of {prompts // 2}"),
             ("dense", "full", "moira_graph", "full",
              f"dense FA3 vs Moira gamma=1 ({moira_graphs})"),
             ("dense", "full", "dense_splits1", "full",
              "dense FA3 vs dense FA3 at one split (same batch: attention's rounding alone)"),
             ("dense", "full", "dense_flashinfer", "full",
              "dense FA3 vs dense FlashInfer (same batch: another exact kernel)"),
             ("dense_flashinfer", "full", "dense_flashinfer", "halves",
              f"dense FlashInfer batch {prompts} vs two batches of {prompts // 2}"),
             ("dense", "full", "dense_eager", "full",
              "dense FULL graphs vs dense eager (graph mode NONE): the control"),
             ("moira_graph", "full", "moira_eager", "full",
              "Moira FULL graphs vs Moira eager (graph mode NONE)"),
             ("moira_graph", "full", "moira_check", "full",
              "Moira FULL graphs vs Moira eager attention (+dense check)"),
             ("dense", "full", "preempt_dense", "full", "dense vs dense with preemption"),
             ("moira_graph", "full", "preempt_moira", "full", "Moira vs Moira with preemption"),
             # older names: Moira at gamma 0.9 (summaries matter)
             ("dense", "full", "preempt-dense", "full", "dense vs dense with preemption"),
             ("moira-g09", "full", "preempt-moira", "full",
              "Moira gamma=0.9 vs the same with preemption"),
             # MOIRA_FUSED_CACHE_WRITE=0 / 1 (vLLM's write kernel / Estimate's)
             ("fcw0", "full", "fcw1", "full",
              "Moira with vLLM's cache write vs the write in Estimate's launch"),
             # the default engine (the write in Estimate) on another host and commit, and with
             # vLLM's jit_monitor_verbose (--jit-verbose) on two hosts
             ("fcw1", "full", "plain", "full",
              "fcw1 vs the same command on another host and commit"),
             ("plain", "full", "verbose_host2", "full",
              "without vs with --jit-verbose, one host"),
             ("verbose_host1", "full", "verbose_host2", "full",
              "--jit-verbose on two hosts")]
    # prefix mode: prefix-cache hits against the same prompts recomputed, in one engine
    pairs += [(name, "full", name, "recomputed", f"{name}: prefix-cache hits vs recomputed")
              for name, run in runs.items() if "recomputed" in run]
    # the first token's log-probability comes from the prefill step (FA3 on both sides): where
    # it differs, the two engines parted before any decode step
    print("| comparison | prompts with identical tokens | first differing step per prompt | "
          "max abs logprob diff before it | bit-identical logprobs | first token's logprob "
          "bit-identical | top-2 logit gap at the first difference |\n"
          "|---|---|---|---|---|---|---|")
    for a, ka, b, kb, label in pairs:
        if a in runs and b in runs and ka in runs[a] and kb in runs[b]:
            same, first_diff, worst, bitwise = agreement(runs[a][ka], runs[b][kb])
            steps = " ".join("-" if d is None else str(d) for d in first_diff)
            first_same = sum(x["logprobs"][:1] == y["logprobs"][:1]
                             for x, y in zip(runs[a][ka], runs[b][kb]))
            gaps = [gap for gap in gaps_at_first_difference(runs[a][ka], runs[b][kb]) or []
                    if gap is not None]  # None: a step with one candidate token
            # and how common such near-ties are at all in the reference run: with random
            # weights the logits are flat, so a share of every run's steps are near-ties
            every_gap = [g for x in runs[a][ka] for g in x.get("top2_gap") or [] if g is not None]
            near_ties = ("–" if not gaps else
                         f"max {max(gaps):.3g}, {sum(g <= 0.25 for g in gaps)}/{len(gaps)} "
                         f"≤ 0.25 (of all steps: "
                         f"{sum(g <= 0.25 for g in every_gap) / len(every_gap):.1%})")
            print(f"| {label} | {same}/{len(runs[a][ka])} | {steps} | {worst:.3g} | "
                  f"{bitwise} | {first_same}/{len(runs[a][ka])} | {near_ties} |")
    gap = first_difference_gap(runs)
    if gap:
        print(f"\nfirst differing step, mean over {gap['prompts']} prompts: dense vs dense at "
              f"another batch size {gap['dense']:.1f}")

        def interval(diff):
            return f"{diff['mean']:+.1f} [{diff['low']:+.1f}, {diff['high']:+.1f}]"

        for name, label in YARDSTICKS.items():
            key = "moira" if name == "moira_graph" else name
            if key in gap:
                print(f"{label}: {gap[key]:.1f}; minus the dense pair "
                      f"{interval(gap[key + '_minus_dense'])} (95% paired bootstrap)")
        for name in YARDSTICKS:
            if f"moira_minus_{name}" in gap:
                print(f"Moira pair minus the {YARDSTICKS[name]} pair "
                      f"{interval(gap[f'moira_minus_{name}'])}")
    modes = {name: run.get("cudagraph_mode", "not recorded") for name, run in runs.items()}
    print("\nCUDA graph mode each engine ran: "
          + ", ".join(f"{name} {mode}" for name, mode in modes.items()))
    for name, run in runs.items():
        check = run.get("dense_check")
        if check:
            layers = list(check.values())
            if isinstance(layers[0], dict):
                total = {k: sum(layer[k] for layer in layers) for k in layers[0]}
                worst = {k: max(layer[k] for layer in layers) for k in layers[0]}
                n = max(total["decode_elements"], 1)
                print(f"\n{name}: decode rows, Moira vs FA3: max {worst['moira_max_ulps']:g} "
                      f"bf16 ulps, {total['moira_over_1_ulp'] / n:.2e} of elements > 1 ulp, "
                      f"{total['moira_over_4_ulps'] / n:.2e} > 4 ulps; FA3 one split vs FA3: "
                      f"max {worst['fa3_split_max_ulps']:g}, "
                      f"{total['fa3_split_over_1_ulp'] / n:.2e} > 1 ulp, "
                      f"{total['fa3_split_over_4_ulps'] / n:.2e} > 4 ulps; other rows: "
                      f"{int(total['other_rows_differing'])} of "
                      f"{int(total['other_elements'])} elements not bit-identical")
                if "other_rows_differing_one_split" in total:  # newer runs
                    print(f"{name}: other rows in one split, the engine's FA3 call (the batch "
                          f"without its decode rows) vs FA3 over the whole batch: "
                          f"{int(total['other_rows_differing_one_split'])} elements differ")
                if "other_rows_split_in_whole_batch" in total and total["other_elements"]:
                    print(f"{name}: other rows, FA3 over the whole batch vs itself in one "
                          f"split: {int(total['other_rows_split_in_whole_batch'])} elements "
                          f"differ")
                if "moira_max_abs" in total:  # newer runs: the paper's measure too
                    print(f"{name}: at the scale of each head's output (the paper's 1-ulp "
                          f"bound): Moira vs FA3 max |diff| {worst['moira_max_abs']:.3g}, "
                          f"{total['moira_over_1_head_ulp'] / n:.2e} of elements > 1 ulp; FA3 "
                          f"one split vs FA3 max |diff| {worst['fa3_split_max_abs']:.3g}, "
                          f"{total['fa3_split_over_1_head_ulp'] / n:.2e} > 1 ulp")
                if total.get("moira_exact_abs_sum"):  # newer runs: against float32
                    print(f"{name}: against exact float32 attention over every page, mean "
                          f"|error| Moira {total['moira_exact_abs_sum'] / n:.3e}, FA3 "
                          f"{total['fa3_exact_abs_sum'] / n:.3e}, FA3 one split "
                          f"{total['fa3_split_exact_abs_sum'] / n:.3e}; largest "
                          f"{worst['moira_exact_max_abs']:.3g} / {worst['fa3_exact_max_abs']:.3g}"
                          f" / {worst['fa3_split_exact_max_abs']:.3g}")
                if "moira_exact_outward_sum" in total:  # newer runs: a lean, if any
                    print(f"{name}: mean error along the exact value's sign (> 0: away from "
                          f"zero) Moira {total['moira_exact_outward_sum'] / n:+.3e}, FA3 "
                          f"{total['fa3_exact_outward_sum'] / n:+.3e}, FA3 one split "
                          f"{total['fa3_split_exact_outward_sum'] / n:+.3e}")
            else:  # the first format: (max ulps, > 1 ulp, compared, other differing, compared)
                totals = [sum(v[i] for v in layers) for i in range(5)]
                worst = max(v[0] for v in layers)
                print(f"\n{name}: decode rows vs dense FA3: max {worst:g} bf16 ulps, "
                      f"{int(totals[1])} of {int(totals[2])} elements beyond 1 ulp "
                      f"({totals[1] / max(totals[2], 1):.2e}); other rows: {int(totals[3])} of "
                      f"{int(totals[4])} elements not bit-identical")
        if run.get("pages") and run["pages"]["fraction"] is not None:
            print(f"{name}: pages read {run['pages']['fraction']:.3f} of present, "
                  f"all finished: {run['all_finished']}, prompts {len(run['lengths'])} x "
                  f"{run['lengths'][0]}.., startup {run['startup_s']} s, generate "
                  f"{run['full_s']:.1f} s"
                  + (f", preemptions {run['preemptions']:g}" if "preemptions" in run else ""))


if __name__ == "__main__":
    main()
