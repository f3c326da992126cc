"""Checks of the vLLM plugin on the GPU (issue 4), one engine per invocation, random weights.

    PYTHONPATH=/tmp/site:. python3 benchmarks/vllm_checks.py MODE [--layers 4] [--out F.json]

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
  ``reset_prefix_cache()`` (the first run's pages recomputed; within that run the prompts
  may again share the prefix's pages). The two full runs are compared; run it
  with ``--backend FLASH_ATTN`` too for the yardstick (recomputation changes batch shapes).
- ``preempt``: the same prompts with a KV cache of ``--blocks`` pages (default: the prompts'
  pages and one spare per request), too small for what they generate, so vLLM preempts and
  recomputes requests (``preemptions`` in the JSON counts them);
  compare its tokens with a ``moira`` / ``dense`` run of the same backend (``vllm_compare.py``).

Prompts are random token ids of mixed lengths (partial last pages); ``--max-batched-tokens``
keeps prefills chunked, so decode rows and prefill rows share steps (mixed steps). Writes the
tokens, their log-probabilities, the top-2 log-prob gap of every step and the counters to
``--out``.

``--weights normal`` (default) redraws vLLM's dummy weights after loading: vLLM fills every
parameter from U(-1e-3, 1e-3), which makes every logit nearly equal (log-probs all
-log(vocab), greedy tokens alternating between two ids), so token comparisons would say nothing.
Here matrices get N(0, 1/fan_in), embeddings N(0, 1), norms 1: attention is far from uniform
and the next token depends on it.
"""

import argparse
import json
import os
import random
import sys
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in this process
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

MODELS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "models")


def model_dir(name, layers):
    with open(os.path.join(MODELS, name, "config.json")) as f:
        config = json.load(f)
    if layers:
        config["num_hidden_layers"] = layers
    path = tempfile.mkdtemp(prefix=f"{name}-{layers or 'all'}-")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


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


def main():
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
                             "mode into NONE without torch.compile: the compile-mode-0 runs "
                             "of sessions 9-11 that kept the old default FULL_AND_PIECEWISE "
                             "ran eager that way). The JSON records the mode the engine ran")
    parser.add_argument("--fa3-normalizer", action="store_true",
                        help="Attend sums the float32 softmax weights, as FA3 does, instead of "
                             "the rounded ones (attend.SUM_ROUNDED_WEIGHTS = False): does "
                             "Moira then differ from FA3 only as much as FA3 from itself?")
    parser.add_argument("--fa3-arithmetic", action="store_true",
                        help="FA3's normalizer and FA3's loop order and rounding "
                             "(attend.FA3_TILE_ORDER): session 8's normalizer alone left the "
                             "1-ulp count where it was")
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
                             "same engine without it from the prefill on, and from each other "
                             "(session 24), so never compare its tokens")
    parser.add_argument("--gpu-memory", type=float, default=0.85,
                        help="vLLM's gpu_memory_utilization (lower it to share the GPU)")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "check.json"))
    # vllm_tpot imports this file: its helpers are imported here, not at the top
    from vllm_tpot import add_kernel_settings, apply_kernel_settings, parse_kernel_settings

    add_kernel_settings(parser)
    args = parser.parse_args()
    kernel_settings = parse_kernel_settings(parser, args.kernel_setting)
    if args.prefill_rows_alone and (args.mode == "dense" or args.backend == "FLASH_ATTN"):
        parser.error("--prefill-rows-alone is a setting of Moira's backend; dense runs ignore it")
    if args.hf_model and (args.layers or not args.text):
        parser.error("--hf-model takes the model as it is (no --layers) and needs --text")
    try:
        args.graph_mode = graph_mode(args.compile_mode, args.graph_mode, args.fa3_max_splits)
    except ValueError as error:
        parser.error(str(error))

    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import moira.integrations.vllm as plugin

    plugin.register()  # the entry point does this in every process; in-process it is enough
    apply_kernel_settings(kernel_settings)
    if args.fa3_normalizer or args.fa3_arithmetic:  # the engine runs in this process
        from moira.kernels import attend as attend_module

        attend_module.SUM_ROUNDED_WEIGHTS = False
        attend_module.FA3_TILE_ORDER = args.fa3_arithmetic
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
        extra["additional_config"] = {"moira": settings}
    start = time.time()
    if args.mode == "preempt":
        # every prompt fits, with one spare page per request, but not what the requests then
        # generate (--tokens 128: two or three pages each), so running requests run out of
        # pages and vLLM preempts and later recomputes some. (Session 8's cache, a third of
        # prompts plus outputs, only delayed admissions: vLLM's preemption counter read 0.)
        prompt_pages = sum(-(-len(p["prompt_token_ids"]) // 64) for p in prompts)
        extra["num_gpu_blocks_override"] = args.blocks or prompt_pages + len(prompts) + 1
    if args.jit_verbose:
        extra["jit_monitor_verbose"] = True
    if args.fa3_max_splits is not None:
        extra["attention_config"] = {"flash_attn_max_num_splits_for_cuda_graph":
                                     args.fa3_max_splits}
    llm = LLM(model=args.hf_model or model_dir(args.model, args.layers),
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
                  cudagraph_mode=ran_mode,
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
    # fed (session 8's preempt run reported 0): generation_tokens_total must then be > 0
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


if __name__ == "__main__":
    main()
