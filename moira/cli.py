"""``moira demo``: the whole method on a synthetic long context, on the GPU or the CPU.

Builds a paged KV cache whose heads attend like trained ones (``moira.synthetic``), runs
Summarize -> Estimate -> Select -> Attend -> Merge with Moira's kernels, and prints per KV head
how many pages were kept, the estimated and the exact attention mass they cover, the oracle
coverage set's size, what a mean-only estimate would have covered, and the output error against
dense attention. Writes a PNG of the kept pages per head.

On a machine without CUDA the kernels run in Triton's CPU interpreter (slow: keep the context
to a few thousand tokens per head).
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def _device(choice):
    import torch

    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise SystemExit("moira: --device cuda, but torch sees no CUDA device")
    return choice


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

    progress = _Progress(6)
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


def _model_and_text(args):
    """``(model, tokenizer, device, text)`` for ``eval`` and ``calibrate``: the model in float32
    with Moira's attention function registered, the text from a .txt or {"text": ...} .json."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from moira.evaluation import hf
    from moira.evaluation.tasks import read_text

    torch.manual_seed(args.seed)
    hf.register()
    # a GGUF file loads directly (transformers dequantizes it; needs the `gguf` package)
    folder, gguf = ((os.path.dirname(args.model) or ".", os.path.basename(args.model))
                    if args.model.endswith(".gguf") else (args.model, None))
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    device = _device(args.device)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.float32,
                                                 attn_implementation=hf.ATTENTION_NAME)
    model.to(device)
    return model, tokenizer, device, read_text(args.text)


def calibrate(args, command):
    import json

    import torch

    from moira.evaluation import calibration, experiments
    from moira.evaluation.tasks import windows

    model, tokenizer, device, text = _model_and_text(args)
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


def evaluate(args, command):
    import json

    import torch

    from moira.evaluation import experiments

    if args.calibrated and args.calibrate:
        raise SystemExit("moira eval: --calibrated FILE or --calibrate N, not both")
    model, tokenizer, device, text = _model_and_text(args)
    gammas = [float(g) for g in args.gammas.split(",")]
    tail_ratios = None
    if args.calibrated:
        from moira.evaluation import calibration

        config = model.config
        tail_ratios = calibration.load(
            args.calibrated, config.num_hidden_layers,
            getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    progress = _Progress(None)
    header = dict(command=command, model=args.model, text=args.text, context=args.context,
                  documents=args.documents, gammas=gammas, calibrated=args.calibrated,
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
        documents=args.documents, gammas=gammas, tasks=args.tasks.split(","),
        new_tokens=args.new_tokens, seed=args.seed, calibration=args.calibration,
        progress=progress, checkpoint=checkpoint, tail_ratios=tail_ratios,
        calibrate_documents=args.calibrate)
    result.update(header)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    if os.path.exists(args.out + ".partial"):
        os.remove(args.out + ".partial")
    print(json.dumps(result["table"], indent=1))
    print(f"wrote {args.out}")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="moira", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("demo", help="run the whole method on a synthetic long context")
    run.add_argument("--context", type=int, default=8192, help="tokens per request")
    run.add_argument("--batch", type=int, default=1, help="requests")
    run.add_argument("--kv-heads", type=int, default=4)
    run.add_argument("--group", type=int, default=4, help="query heads per KV head (G)")
    run.add_argument("--head-dim", type=int, default=64, choices=(64, 128))
    run.add_argument("--gamma", type=float, default=0.98)
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    run.add_argument("--out", default="moira-demo.png", help="PNG of the kept pages")
    ev = commands.add_parser("eval", help="accuracy of sparse vs dense decoding on a "
                                          "Hugging Face causal LM (CPU, float32 reference)")
    ev.add_argument("--model", required=True,
                    help="a Hugging Face model folder, or a .gguf file")
    ev.add_argument("--text", required=True, help="a long text file (.txt or {'text': ...} .json)")
    ev.add_argument("--context", type=int, default=4096, help="tokens per prompt")
    ev.add_argument("--documents", type=int, default=20, help="samples per task")
    ev.add_argument("--gammas", default="0.95,0.98,0.99,1.0")
    ev.add_argument("--tasks", default="kl,retrieval,repeat,budget,ablation",
                    help="any of kl, retrieval, repeat, budget, ablation")
    ev.add_argument("--calibration", type=int, default=5,
                    help="documents that profile per-(layer, head) budgets for the ablation")
    ev.add_argument("--new-tokens", type=int, default=32, help="continuation length for KL")
    ev.add_argument("--seed", type=int, default=0)
    ev.add_argument("--calibrated", metavar="FILE",
                    help="also run every gamma < 1 with per-(layer, KV head) targets from this "
                         "`moira calibrate` result")
    ev.add_argument("--calibrate", type=int, default=0, metavar="N",
                    help="measure per-head targets first on N documents the KL and retrieval "
                         "samples do not use, and add the calibrated arms")
    ev.add_argument("--device", default="cpu", choices=("auto", "cuda", "cpu"),
                    help="where the model and the reference run (cuda: long contexts)")
    ev.add_argument("--out", default="accuracy.json")
    cal = commands.add_parser("calibrate", help="per-(layer, KV head) coverage targets for a "
                                                "model (tail ratios of the mvar estimate)")
    cal.add_argument("--model", required=True,
                     help="a Hugging Face model folder, or a .gguf file")
    cal.add_argument("--text", required=True,
                     help="a long text file; use text you will not evaluate on")
    cal.add_argument("--context", type=int, default=4096, help="tokens per document")
    cal.add_argument("--documents", type=int, default=5)
    cal.add_argument("--new-tokens", type=int, default=32, help="decode steps per document")
    cal.add_argument("--gamma", type=float, default=0.98,
                     help="the target measured at (0 < gamma < 1)")
    cal.add_argument("--seed", type=int, default=0)
    cal.add_argument("--device", default="cpu", choices=("auto", "cuda", "cpu"))
    cal.add_argument("--out", default="calibration.json")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if args.command == "demo":
        demo(args)
    elif args.command == "eval":
        evaluate(args, "moira " + " ".join(argv))
    elif args.command == "calibrate":
        calibrate(args, "moira " + " ".join(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
