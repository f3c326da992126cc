"""The ``moira`` command: ``demo``, ``eval`` and ``calibrate``.

``moira demo`` runs the whole method on a synthetic long context, on the GPU or the CPU: it
builds a paged KV cache whose heads attend like trained ones (``moira.synthetic``), runs
Summarize -> Estimate -> Select -> Attend -> Merge with Moira's kernels, and prints per KV head
how many pages were kept, the estimated and the exact attention mass they cover, the oracle
coverage set's size, what a mean-only estimate would have covered, and the output error against
dense attention; with matplotlib installed (``pip install moira-attn[demo]``) it also writes a
PNG of the kept pages per head. On a machine without CUDA the kernels run in Triton's CPU
interpreter (slow: keep the context to a few thousand tokens per head).

``moira eval`` measures sparse against dense decoding on a Hugging Face causal LM and
``moira calibrate`` measures per-(layer, KV head) coverage targets for one
(``moira.evaluation``; ``pip install moira-attn[eval]``). Both print a summary and write their
JSON result to ``--out``.

Options are checked before the work starts: a bad value stops the command with one line naming
the option and the fix (exit status 2), mostly before any model or kernel loads (``--context``
against the text once the tokenizer has, a calibration file against the model once it has).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import time

DESCRIPTION = "Moira: sparse long-context decoding that reads only the KV-cache pages a query needs"
EVAL_TASKS = ("kl", "retrieval", "repeat", "budget", "ablation")


# --------------------------------------------------------------------------------------------
# Option values: each parser raises ArgumentTypeError with the fix, which argparse prints as
# "moira <command>: error: argument --<option>: <message>" and exits with status 2
# --------------------------------------------------------------------------------------------


def _whole(minimum, what, maximum=None):
    """A parser of whole numbers in ``[minimum, maximum]``; ``what`` names the quantity."""
    bounds = f">= {minimum}" if maximum is None else f"from {minimum} to {maximum}"

    def parse(text):
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(
                f"give a whole number {bounds} ({what}), got {text!r}")
        return value

    return parse


def _real(text, what):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number ({what}), got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number ({what}), got {text!r}")
    return value


def _share(upper_open):
    """A parser of coverage targets: in (0, 1], or (0, 1) with ``upper_open``."""

    def parse(text):
        value = _real(text, "a coverage target such as 0.98")
        if not (0 < value < 1 if upper_open else 0 < value <= 1):
            interval, fix = (("(0, 1)", "0 < gamma < 1, e.g. 0.98") if upper_open
                             else ("(0, 1]", "0 < gamma <= 1, e.g. 0.98 (1 keeps every page)"))
            raise argparse.ArgumentTypeError(f"{value:g} is not in {interval}: give a share of "
                                             f"the attention mass, {fix}")
        return value

    return parse


def _estimator_list(text):
    """Comma-separated estimators beside mvar: int2, int4 (empty: none)."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [name for name in names if name not in ("int2", "int4")]
    if unknown or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"expected comma-separated estimators among int2, int4, "
                                         f"each once, got {text!r}")
    return names


def _gamma_list(text):
    """Comma-separated coverage targets in (0, 1]."""
    parse = _share(upper_open=False)
    parts = [part.strip() for part in text.split(",")]
    if not all(parts):
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers in (0, 1], such as "
                                         f"0.95,0.98,1.0, got {text!r}")
    gammas = [parse(part) for part in parts]
    if len(set(gammas)) != len(gammas):
        raise argparse.ArgumentTypeError(f"{text!r} names a gamma twice: give each once")
    return gammas


def _task_list(text):
    """Comma-separated task names from ``EVAL_TASKS``."""
    tasks = [part.strip() for part in text.split(",")]
    unknown = [task for task in tasks if task not in EVAL_TASKS]
    if unknown or len(set(tasks)) != len(tasks):
        problem = (f"unknown task {unknown[0]!r}" if unknown
                   else f"{text!r} names a task twice")
        raise argparse.ArgumentTypeError(f"{problem}: give comma-separated names from "
                                         f"{','.join(EVAL_TASKS)}")
    return tasks


def _model_path(text):
    """A Hugging Face model folder (with its config.json) or a .gguf file, on this machine."""
    usage = "give a downloaded Hugging Face model folder (with its config.json) or a .gguf file"
    if text.endswith(".gguf") and os.path.isfile(text):
        return text
    if os.path.isdir(text):
        if not os.path.isfile(os.path.join(text, "config.json")):
            raise argparse.ArgumentTypeError(f"{text!r} has no config.json: {usage}")
        return text
    problem = "is not a .gguf file" if os.path.exists(text) else "does not exist"
    raise argparse.ArgumentTypeError(f"{text!r} {problem}: {usage}")


def _input_file(text):
    if not os.path.isfile(text):
        problem = "is a folder" if os.path.isdir(text) else "does not exist"
        raise argparse.ArgumentTypeError(f"{text!r} {problem}: give the path of a file")
    return text


def _output_file(text):
    """A file to write: its folder must exist and be writable."""
    folder = os.path.dirname(text) or "."
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a folder: give a file name")
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"folder {folder!r} does not exist: create it first or "
                                         f"write elsewhere")
    if not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"folder {folder!r} is not writable: write elsewhere")
    return text


IMAGE_TYPES = (".png", ".pdf", ".svg", ".jpg", ".jpeg")  # what matplotlib's savefig writes


def _image_file(text):
    """A file to write a figure to, named with the image type (``IMAGE_TYPES``)."""
    text = _output_file(text)
    if os.path.splitext(text)[1].lower() not in IMAGE_TYPES:
        raise argparse.ArgumentTypeError(f"{text!r} names no image type: end it in "
                                         f"{', '.join(IMAGE_TYPES)}")
    return text


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every option's default, except where there is none (required options, unset
    files)."""

    def _get_help_string(self, action):
        if action.required or action.default is None:
            return action.help
        return super()._get_help_string(action)


def _device(choice):
    import torch

    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return choice  # "cuda" was checked against torch.cuda.is_available() by _check


class _Progress:
    def __init__(self, steps):
        self.steps, self.step, self.start = steps, 0, time.perf_counter()

    def __call__(self, message):
        self.step += 1
        elapsed = time.perf_counter() - self.start
        count = f"{self.step}/{self.steps}" if self.steps else f"{self.step}"
        print(f"[{count} {elapsed:7.1f}s] {message}", flush=True)


def demo(args):
    device = _device(args.device)
    if device == "cpu":
        # must precede the first import of a kernel module (Triton decides at definition time)
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    import moira
    from moira import reference
    from moira.synthetic import synthetic_context

    plot = importlib.util.find_spec("matplotlib") is not None
    progress = _Progress(6 if plot else 5)
    progress(f"building a synthetic context: {args.context} tokens x {args.batch} requests, "
             f"{args.kv_heads} KV heads, G={args.group}, head_dim={args.head_dim} on {device}"
             + (" (Triton CPU interpreter)" if device == "cpu" else ""))
    ctx = synthetic_context(args.context, batch=args.batch, num_kv_heads=args.kv_heads,
                            group=args.group, head_dim=args.head_dim, device=device,
                            seed=args.seed)
    config = moira.MoiraConfig(gamma=args.gamma)

    progress("Summarize: mean and variance of every full page's keys")
    summaries = moira.summarize(ctx.key_cache, ctx.block_table, ctx.seq_lens)

    progress("Estimate -> Select -> Attend -> Merge (Moira's kernels)")
    workspace = moira.DecodeWorkspace.for_step(ctx.query, ctx.key_cache, ctx.block_table,
                                               config=config)
    out, page_lists, page_counts = moira.sparse_decode(
        ctx.query, ctx.key_cache, ctx.value_cache, summaries, ctx.block_table, ctx.seq_lens,
        workspace=workspace, return_pages=True)
    estimated = workspace.selection_buffers(args.batch, ctx.block_table.shape[1])[0]
    estimated_shares = reference.group_shares(
        estimated.view(args.batch, args.kv_heads, args.group, -1).cpu())

    progress("float32 references: exact page masses, oracle sets, mean-only estimate, dense")
    cpu = {name: getattr(ctx, name).cpu() for name in
           ("query", "key_cache", "value_cache", "block_table", "seq_lens")}
    exact_shares = reference.group_shares(reference.exact_log_masses(
        cpu["query"], cpu["key_cache"], cpu["block_table"], cpu["seq_lens"]))
    _, oracle_counts = reference.oracle_coverage(
        cpu["query"], cpu["key_cache"], cpu["block_table"], cpu["seq_lens"], args.gamma)
    mean_only = summaries.float().cpu().clone()
    mean_only[:, :, 1] = 0.0
    mean_lists, mean_counts = reference.select(
        reference.estimate(cpu["query"], cpu["key_cache"], mean_only, cpu["block_table"],
                           cpu["seq_lens"]), cpu["seq_lens"], gamma=args.gamma)
    dense = reference.dense_attention(cpu["query"], cpu["key_cache"], cpu["value_cache"],
                                      cpu["block_table"], cpu["seq_lens"])

    progress("report")
    page_lists, page_counts = page_lists.cpu(), page_counts.cpu()
    out = out.float().cpu()
    print(f"\ngamma = {args.gamma}; shares are group means over the {args.group} query heads "
          f"of a KV head; 'mean-only' is Select on estimates without the variance term\n")
    header = (f"{'req':>3} {'head':>4} {'profile':<11} {'kept':>10} {'est. mass':>9} "
              f"{'exact mass':>10} {'oracle C*':>9} {'mean-only':>9} {'out err':>8}")
    print(header)
    print("-" * len(header))
    kept_total = pages_total = 0
    masks = []
    for b in range(args.batch):
        pages = reference.num_pages(cpu["seq_lens"][b], ctx.block_table.shape[1])
        for h in range(args.kv_heads):
            kept = page_lists[b, h, : page_counts[b, h]].long()
            mean_kept = mean_lists[b, h, : mean_counts[b, h]].long()
            heads = slice(h * args.group, (h + 1) * args.group)
            error = ((out[b, heads] - dense[b, heads]).norm() / dense[b, heads].norm()).item()
            kept_total += len(kept)
            pages_total += pages
            mask = torch.zeros(pages, dtype=torch.bool)
            mask[kept] = True
            masks.append((f"req {b} head {h} ({ctx.profiles[h]})", mask,
                          exact_shares[b, h, :pages]))
            print(f"{b:>3} {h:>4} {ctx.profiles[h]:<11} {len(kept):>4}/{pages:<5} "
                  f"{estimated_shares[b, h, kept].sum():>9.4f} "
                  f"{exact_shares[b, h, kept].sum():>10.4f} {int(oracle_counts[b, h]):>9} "
                  f"{exact_shares[b, h, mean_kept].sum():>9.4f} {error:>8.2e}")
    print(f"\npages read: {kept_total}/{pages_total} = {kept_total / pages_total:.1%} of dense "
          f"(+ summaries, 1/64 of the KV bytes)")

    if not plot:
        print(f"skipped the plot ({args.out}): matplotlib is not installed "
              f"(pip install 'moira-attn[demo]')")
        return
    progress(f"writing {args.out}")
    _plot(masks, args, args.out)
    print(f"wrote {args.out}")


def _plot(masks, args, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(masks), 1, figsize=(12, 1.1 * len(masks) + 1.2), sharex=True,
                             squeeze=False)
    for ax, (label, mask, shares) in zip(axes[:, 0], masks):
        shares = shares.clamp_min(1e-12).tolist()
        kept = mask.tolist()
        pages = range(len(shares))
        ax.bar(pages, shares, width=1.0, color=["tab:blue" if k else "0.8" for k in kept])
        ax.set_yscale("log")
        ax.set_ylim(min(shares) / 2, 1.0)
        ax.set_ylabel(label, rotation=0, ha="right", va="center", fontsize=8)
        ax.set_xlim(-0.5, len(shares) - 0.5)
    axes[-1, 0].set_xlabel("logical page (64 tokens)")
    fig.suptitle(f"Moira, gamma={args.gamma}: exact attention share of every page (log scale); "
                 f"blue = kept by the coverage rule, grey = skipped", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _model_and_text(args, fail):
    """``(model, tokenizer, device, text)`` for ``eval`` and ``calibrate``: the model in float32
    with Moira's attention function registered, the text read by ``_check``. ``fail(message)``
    reports a text too short for the windows asked for."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from moira.evaluation import hf

    torch.manual_seed(args.seed)
    hf.register()
    # a GGUF file loads directly (transformers dequantizes it; needs the `gguf` package)
    folder, gguf = ((os.path.dirname(args.model) or ".", os.path.basename(args.model))
                    if args.model.endswith(".gguf") else (args.model, None))
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)

    def encode(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    _check_text_length(args, encode(args.text_content), encode, fail)
    device = _device(args.device)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.float32,
                                                 attn_implementation=hf.ATTENTION_NAME)
    model.to(device)
    return model, tokenizer, device, args.text_content


def _check_text_length(args, ids, encode, fail):
    """``--context`` against the text (``ids``, its tokens): ``calibrate`` draws ``--documents``
    windows from the whole text, ``eval`` draws its samples from each third of it, and its
    pass-key and repeated-passage prompts need room besides the filler."""
    from moira.evaluation import experiments

    if args.command == "calibrate":
        span, count = len(ids), args.documents
    else:
        span = len(ids) // 3
        count = max(args.documents + ("repeat" in args.tasks),
                    args.documents + args.calibration if "ablation" in args.tasks else 0,
                    args.calibrate)
    longest = span - count + 1  # windows of this many tokens still have distinct starts
    if longest < args.context:
        where = "" if args.command == "calibrate" else f" ({span} per third)"
        fix = (f"give --context {longest} or less, or a longer --text" if longest > 0
               else "give a longer --text")
        fail(f"argument --context: the text holds {len(ids)} tokens{where}, too few for "
             f"{count} distinct windows of {args.context}: {fix}")
    if args.command != "eval":
        return
    passage = 2 * experiments.PASSAGE_TOKENS
    if "repeat" in args.tasks and args.context < passage:
        fail(f"argument --context: the repeated-passage task needs --context {passage} or "
             f"more (two {experiments.PASSAGE_TOKENS}-token copies)")
    if "retrieval" in args.tasks:
        try:
            experiments.passkey_samples(ids[:span], 0, encode, args.context)
        except ValueError:
            fail(f"argument --context: {args.context} tokens cannot hold the pass-key prompts "
                 f"(preamble, needles, question): give a larger --context")


def calibrate(args, command, fail):
    import torch

    from moira.evaluation import calibration, experiments
    from moira.evaluation.tasks import windows

    model, tokenizer, device, text = _model_and_text(args, fail)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    start = time.time()
    covered = calibration.measure(experiments.CausalLM(model),
                                  windows(ids, args.context, args.documents, seed=args.seed),
                                  gamma=args.gamma, new_tokens=args.new_tokens,
                                  progress=_Progress(None))
    ratios = calibration.tail_ratios(covered, args.gamma)
    result = dict(command=command, model=args.model, text=args.text, context=args.context,
                  documents=args.documents, new_tokens=args.new_tokens, gamma=args.gamma,
                  mean_covered=covered, tail_ratios=ratios, device=str(device),
                  torch=torch.__version__, date=time.strftime("%Y-%m-%d"),
                  seconds=round(time.time() - start))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    flat = [m for row in covered for m in row]
    targets = calibration.targets(ratios, args.gamma)
    print(f"exact mass inside the gamma={args.gamma} lists: mean {sum(flat) / len(flat):.3f}, "
          f"lowest head {min(flat):.3f}; targets for gamma={args.gamma}: "
          f"{targets.min():.4f} to {targets.max():.4f}; wrote {args.out}")


def evaluate(args, command, fail):
    import torch

    from moira.evaluation import experiments

    model, tokenizer, device, text = _model_and_text(args, fail)
    tail_ratios = None
    if args.calibrated:
        from moira.evaluation import calibration

        config = model.config
        try:
            tail_ratios = calibration.load(
                args.calibrated, config.num_hidden_layers,
                getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
        except ValueError as error:
            fail(f"argument --calibrated: {error}")
    progress = _Progress(None)
    header = dict(command=command, model=args.model, text=args.text, context=args.context,
                  documents=args.documents, gammas=args.gammas, calibrated=args.calibrated,
                  estimators=args.estimators,
                  device=f"{device} (float32 model, Moira's float32 reference)",
                  torch=torch.__version__, date=time.strftime("%Y-%m-%d"))
    last_write = [time.monotonic()]

    def checkpoint(rows):  # every 60 s, the rows so far: a run cut short keeps its samples
        if time.monotonic() - last_write[0] >= 60:
            last_write[0] = time.monotonic()
            with open(args.out + ".partial", "w") as f:
                json.dump(dict(header, rows=rows, partial=True), f)

    result = experiments.evaluate(
        model, lambda s: tokenizer(s, add_special_tokens=False)["input_ids"],
        lambda ids: tokenizer.decode(ids), text, context=args.context,
        documents=args.documents, gammas=args.gammas, tasks=args.tasks,
        new_tokens=args.new_tokens, seed=args.seed, calibration=args.calibration,
        progress=progress, checkpoint=checkpoint, tail_ratios=tail_ratios,
        calibrate_documents=args.calibrate, estimators=args.estimators)
    result.update(header)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    if os.path.exists(args.out + ".partial"):
        os.remove(args.out + ".partial")
    print()
    print(experiments.format_table(result["table"]))
    if result["overlapping_windows"]:
        print("note: the text is too short for disjoint samples; they overlap, so the "
              "intervals are too narrow")
    print(f"wrote {args.out}")


def _check(parser, args):
    """What argparse cannot check per option, before anything heavy loads: the device, the
    extras a command needs, the text's contents and a calibration file's format."""
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("argument --device: torch sees no CUDA device: use --device cpu "
                         "(or auto)")
    if args.command == "demo":
        return
    if importlib.util.find_spec("transformers") is None:
        parser.exit(1, f"{parser.prog}: error: needs transformers: pip install "
                       f"'moira-attn[eval]'\n")
    from moira.evaluation.tasks import read_text

    try:
        args.text_content = read_text(args.text)
    except (OSError, ValueError) as error:
        parser.error(f"argument --text: {error}")
    if getattr(args, "calibrated", None):
        from moira.evaluation import calibration

        try:
            calibration.load(args.calibrated)
        except ValueError as error:
            parser.error(f"argument --calibrated: {error}")


def build_parser():
    """The ``moira`` parser; ``main`` runs it. Returns ``(parser, {command: subparser})``."""
    parser = argparse.ArgumentParser(prog="moira", description=DESCRIPTION)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    helpful = dict(formatter_class=_HelpFormatter)
    seed = dict(type=_whole(0, "the seed", 2**63 - 1), default=0,
                help="random seed (same seed, same samples)")

    run = commands.add_parser(
        "demo", help="run the whole method on a synthetic long context",
        description="Run Summarize -> Estimate -> Select -> Attend -> Merge with Moira's kernels "
                    "on a synthetic paged KV cache and compare with exact attention. Without "
                    "CUDA the kernels run in Triton's CPU interpreter (slow: keep --context to "
                    "a few thousand tokens).", **helpful)
    run.add_argument("--context", type=_whole(1, "tokens per request"), default=8192,
                     help="tokens per request (later requests get 37 fewer each)")
    run.add_argument("--batch", type=_whole(1, "requests"), default=1,
                     help="requests")
    run.add_argument("--kv-heads", type=_whole(1, "KV heads"), default=4,
                     help="KV heads; head h gets profile h %% 4 (sink+local, retrieval, "
                          "diffuse, heavy-tail)")
    run.add_argument("--group", type=_whole(1, "query heads per KV head"), default=4,
                     help="query heads per KV head (G)")
    run.add_argument("--head-dim", type=int, default=64, choices=(64, 128),
                     help="channels per head")
    run.add_argument("--gamma", type=_share(upper_open=False), default=0.98,
                     help="coverage target: each row keeps the fewest pages whose estimated "
                          "attention share reaches it (0 < gamma <= 1; 1 keeps every page)")
    run.add_argument("--seed", **seed)
    run.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"),
                     help="where the kernels run (auto: cuda if torch sees a GPU, else the "
                          "CPU interpreter)")
    run.add_argument("--out", type=_image_file, default="moira-demo.png",
                     help="PNG of the kept pages per head (needs matplotlib: "
                          "pip install 'moira-attn[demo]'; skipped without it)")

    ev = commands.add_parser(
        "eval", help="accuracy of sparse vs dense decoding on a Hugging Face causal LM "
                     "(CPU, float32 reference)",
        description="Sparse against dense decoding on one model, one sequence at a time, with "
                    "Moira's float32 reference: prints a table per gamma and writes every "
                    "sample to --out (JSON). Needs transformers: "
                    "pip install 'moira-attn[eval]'.", **helpful)
    ev.add_argument("--model", required=True, type=_model_path,
                    help="a Hugging Face model folder, or a .gguf file")
    ev.add_argument("--text", required=True, type=_input_file,
                    help="a long text file (.txt, or .json holding {\"text\": ...})")
    ev.add_argument("--context", type=_whole(1, "tokens per prompt"), default=4096,
                    help="tokens per prompt")
    ev.add_argument("--documents", type=_whole(1, "samples per task"), default=20,
                    help="samples per task")
    ev.add_argument("--gammas", type=_gamma_list, default="0.95,0.98,0.99,1.0",
                    help="coverage targets to compare with dense, comma-separated, each in "
                         "(0, 1]")
    ev.add_argument("--estimators", type=_estimator_list, default="",
                    help="also run every gamma < 1 with these page-mass estimators beside "
                         "mvar, comma-separated: int2, int4 (MoiraConfig.estimator)")
    ev.add_argument("--tasks", type=_task_list, default=",".join(EVAL_TASKS),
                    help=f"comma-separated, any of {', '.join(EVAL_TASKS)}")
    ev.add_argument("--calibration", type=_whole(1, "calibration documents"), default=5,
                    help="documents that profile per-(layer, head) budgets for the ablation")
    ev.add_argument("--new-tokens", type=_whole(2, "tokens to continue with, the "
                                                   "first from the prefill"), default=32,
                    help="continuation length for KL")
    ev.add_argument("--seed", **seed)
    targets = ev.add_mutually_exclusive_group()
    targets.add_argument("--calibrated", metavar="FILE", type=_input_file,
                         help="also run every gamma < 1 with per-(layer, KV head) targets from "
                              "this `moira calibrate` result")
    targets.add_argument("--calibrate", type=_whole(0, "documents, 0 for none"), default=0,
                         metavar="N",
                         help="measure per-head targets first on N documents the KL and "
                              "retrieval samples do not use, and add the calibrated arms "
                              "(0: none)")
    ev.add_argument("--device", default="cpu", choices=("auto", "cuda", "cpu"),
                    help="where the model and the reference run (cuda: long contexts)")
    ev.add_argument("--out", type=_output_file, default="accuracy.json",
                    help="the JSON result (while running, OUT.partial holds the samples so far)")

    cal = commands.add_parser(
        "calibrate", help="per-(layer, KV head) coverage targets for a model (tail ratios of "
                          "the mvar estimate)",
        description="Measure how much exact attention mass the coverage rule's lists leave out "
                    "per (layer, KV head) along greedy decoding, and write the tail ratios that "
                    "`moira eval --calibrated` and the vLLM plugin take. Needs transformers: "
                    "pip install 'moira-attn[eval]'.", **helpful)
    cal.add_argument("--model", required=True, type=_model_path,
                     help="a Hugging Face model folder, or a .gguf file")
    cal.add_argument("--text", required=True, type=_input_file,
                     help="a long text file; use text you will not evaluate on")
    cal.add_argument("--context", type=_whole(1, "tokens per document"), default=4096,
                     help="tokens per document")
    cal.add_argument("--documents", type=_whole(1, "documents"), default=5,
                     help="documents to measure on")
    cal.add_argument("--new-tokens", type=_whole(2, "tokens per document, the first "
                                                   "from the prefill"),
                     default=32, help="decode steps per document")
    cal.add_argument("--gamma", type=_share(upper_open=True), default=0.98,
                     help="the target measured at (0 < gamma < 1)")
    cal.add_argument("--seed", **seed)
    cal.add_argument("--device", default="cpu", choices=("auto", "cuda", "cpu"),
                     help="where the model and the reference run (cuda: long contexts)")
    cal.add_argument("--out", type=_output_file, default="calibration.json",
                     help="the JSON result (tail ratios per layer and KV head)")
    return parser, {"demo": run, "eval": ev, "calibrate": cal}


def main(argv=None):
    parser, commands = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    command = commands[args.command]
    _check(command, args)
    if args.command == "demo":
        demo(args)
    elif args.command == "eval":
        evaluate(args, "moira " + " ".join(argv), command.error)
    elif args.command == "calibrate":
        calibrate(args, "moira " + " ".join(argv), command.error)
    return 0


if __name__ == "__main__":
    sys.exit(main())
