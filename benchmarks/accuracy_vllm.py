"""Accuracy through the vLLM plugin (issue 6): one trained model served by vLLM 0.26 with dense
FA3 and with Moira's kernels (the plugin inside full CUDA graphs, prefill rows by FA3), on the
samples `moira eval` uses; one engine per arm, several arms may share the GPU.

    PYTHONPATH=/tmp/site:. python3 benchmarks/accuracy_vllm.py run --model HF_DIR \\
        --text essays.json --arm dense|GAMMA --out DIR/ARM.json
    python3 benchmarks/accuracy_vllm.py report DIR [--out summary.json] [--readme benchmarks/RESULTS.md]
    python3 benchmarks/accuracy_vllm.py report DIR/summary.json [--readme benchmarks/RESULTS.md]  # redraw

Per context (``--contexts``, the longest first):

- retrieval: `moira eval`'s pass-key samples (the same third of the text, windows, seeds and
  needle depths; single- and 4-key), a greedy answer of 8 tokens, exact match of its digits.
  The answer's first token comes from the prefill (FA3 in every arm), the rest from decode
  steps.
- kl: `moira eval`'s KL documents; for each, ``--positions`` prompts ending 1..P tokens before
  the window's end (teacher forcing on the text), two greedy tokens each. The first comes from
  the prefill, the same in every arm (``report`` checks it), the second from one decode step
  over the whole context: that step's top ``--logprobs`` log-probabilities are saved
  (``ARM.npz``). ``report`` computes KL(dense || sparse) over the tokens in both arms' top
  lists, the rest of the vocabulary lumped into one outcome: the exact KL of that coarser
  distribution, a lower bound on the full KL (data processing), tight when the lumped mass is
  small (reported).

- repeat: `moira eval`'s repeated-passage pairs (passage, filler, passage); for each token of
  the second copy, a prompt ending just before it, its first generated token forced to the
  text's (``logit_bias``; vLLM returns log-probabilities of the raw logits, before the bias)
  and the second token's log-probability of the text's next token read from one decode step
  (``logprob_token_ids``): the NLL of the copy, teacher-forced, as in `moira eval`.

Arms: ``dense`` (FA3), a gamma (Moira's coverage rule) or ``top_k=N`` (Moira, N pages per row:
the fixed-budget ablation at the reads a gamma arm reported).

Prefix caching is on: each document's first prompt runs alone and its pages serve the others
(so Moira also reads the summaries of cached pages). Every arm gets the same KV-cache size
(``kv_cache_memory_bytes``), so every engine schedules the same batches. ``--dummy`` runs the
model's geometry on random weights with a byte tokenizer (a smoke test of the plumbing).
"""

import argparse
import json
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in this process
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ANSWER_TOKENS = 8  # as `moira eval`'s retrieval


def samples(encode, text, context, documents, seed=0):
    """(KL documents, pass-key samples, repeated-passage prompts with the index where the
    second copy starts) exactly as ``moira eval`` draws them."""
    from moira.evaluation.experiments import passkey_samples, repeat_pairs, text_parts
    from moira.evaluation.tasks import repeated_passage, windows

    parts = text_parts(encode(text), seed)
    docs = windows(parts[0], context, documents, seed=seed)
    haystacks = windows(parts[1], context, documents, seed=seed)
    passkeys = [sample for index, haystack in enumerate(haystacks)
                for sample in passkey_samples(haystack, index, encode, context)]
    repeats = [repeated_passage(passage, filler, context)
               for passage, filler in repeat_pairs(parts[2], context, documents, seed=seed)]
    return docs, passkeys, repeats


def arm_settings(arm):
    """The plugin settings of an arm: ``None`` for dense, else Moira's ``{"moira": {...}}``."""
    if arm == "dense":
        return None
    # the rule on every row: no full reads of short rows at small batches (dense_below_tokens)
    if arm.startswith("top_k="):
        return {"top_k": int(arm[len("top_k="):]), "dense_below_tokens": 0}
    gamma = float(arm)
    if not 0.0 < gamma <= 1.0:
        raise SystemExit(f"--arm: a gamma must lie in (0, 1], got {arm}")
    return {"gamma": gamma, "dense_below_tokens": 0}


def arm_order(arm):
    """Table order: gammas ascending, then fixed budgets ascending."""
    settings = arm_settings(arm)
    return (1, settings["top_k"]) if "top_k" in settings else (0, settings["gamma"])


def run(args):
    import numpy as np
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import moira.integrations.vllm as plugin

    plugin.register()
    from moira.evaluation.tasks import read_text
    from moira.integrations.vllm.state import PageStatsLog

    if args.dummy:
        def encode(text):
            return list(text.encode("utf-8"))

        def decode(ids):
            return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model)

        def encode(text):
            return tokenizer(text, add_special_tokens=False)["input_ids"]

        decode = tokenizer.decode
    text = read_text(args.text)
    contexts = sorted((int(c) for c in args.contexts.split(",")), reverse=True)

    settings = arm_settings(args.arm)
    dense = settings is None
    extra = {} if dense else dict(additional_config={"moira": dict(
        settings, stats_interval=3600.0)})  # counters on, few log lines
    start = time.time()
    llm = LLM(model=args.model, skip_tokenizer_init=True, dtype="bfloat16", seed=0,
              load_format="dummy" if args.dummy else "auto", block_size=64,
              attention_backend="FLASH_ATTN" if dense else "CUSTOM",
              max_model_len=contexts[0] + 64, enable_prefix_caching=True, max_num_seqs=64,
              gpu_memory_utilization=0.05, kv_cache_memory_bytes=int(args.kv_gib * 2**30),
              max_logprobs=args.logprobs,
              compilation_config={"inductor_compile_config": {
                  "combo_kernels": False, "benchmark_combo_kernel": False}}, **extra)
    result = dict(arm=args.arm, model=args.model, text=args.text, contexts=contexts,
                  documents=args.documents, positions=args.positions, logprobs=args.logprobs,
                  dummy=args.dummy, startup_s=round(time.time() - start, 1),
                  gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                  vllm=__import__("vllm").__version__, date=time.strftime("%Y-%m-%d"),
                  command="python3 " + " ".join(sys.argv), phases={})

    def pages():
        totals = PageStatsLog(0).read()
        return (sum(r for r, _ in totals.values()), sum(p for _, p in totals.values()))

    def phase(name, body):
        before, t0 = pages(), time.time()
        try:
            rows = body()
        except Exception as error:  # noqa: BLE001 -- the other phases still run; report says
            result["phases"][name] = dict(error=f"{type(error).__name__}: {error}"[:500],
                                          seconds=round(time.time() - t0, 1))
            print(f"{args.arm} {name}: failed: {result['phases'][name]['error']}", flush=True)
        else:
            after = pages()
            read, present = after[0] - before[0], after[1] - before[1]
            result["phases"][name] = dict(rows=rows, seconds=round(time.time() - t0, 1),
                                          read_fraction=read / present if present else None)
            print(f"{args.arm} {name}: {result['phases'][name]['seconds']} s, pages read "
                  f"{result['phases'][name]['read_fraction']}", flush=True)
        with open(args.out, "w") as f:  # after every phase: a run cut short keeps its phases
            json.dump(result, f)

    greedy = SamplingParams(max_tokens=ANSWER_TOKENS, temperature=0.0, ignore_eos=True,
                            detokenize=False)
    two = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, detokenize=False,
                         logprobs=args.logprobs)
    def shared_prefix_generate(prompts, params):
        """``params``: one SamplingParams per prompt. The first prompt runs alone: its pages
        (and Moira's summaries) then serve the rest from the prefix cache."""
        return (llm.generate(prompts[:1], params[:1], use_tqdm=False)
                + llm.generate(prompts[1:], params[1:], use_tqdm=False))

    arrays = {}
    tasks = args.tasks.split(",")
    for context in contexts:
        docs, passkeys, repeats = samples(encode, text, context, args.documents)

        def retrieval():
            outputs = llm.generate([TokensPrompt(prompt_token_ids=s.prompt) for s in passkeys],
                                   greedy, use_tqdm=False)
            rows = []
            for index, (sample, out) in enumerate(zip(passkeys, outputs)):
                answer = decode(list(out.outputs[0].token_ids)).strip()
                rows.append(dict(sample=index // 2, kind=sample.kind, depth=sample.depth,
                                 correct=answer[: len(sample.answer)] == sample.answer,
                                 output=answer, finished=out.finished))
            return rows

        def kl_steps():
            rows, top_ids, top_logprobs = [], [], []
            for index, doc in enumerate(docs):
                prompts = [TokensPrompt(prompt_token_ids=doc[: context - back])
                           for back in range(args.positions, 0, -1)]
                outputs = shared_prefix_generate(prompts, [two] * len(prompts))
                for position, out in enumerate(outputs):
                    completion = out.outputs[0]
                    step = sorted(completion.logprobs[1].items(), key=lambda kv: -kv[1].logprob)
                    step = step[: args.logprobs]
                    top_ids.append([token for token, _ in step])
                    top_logprobs.append([entry.logprob for _, entry in step])
                    rows.append(dict(doc=index, position=position,
                                     tokens=list(completion.token_ids)))
            arrays[f"ids_{context}"] = np.array(top_ids, dtype=np.int32)
            arrays[f"logprobs_{context}"] = np.array(top_logprobs, dtype=np.float32)
            np.savez_compressed(os.path.splitext(args.out)[0] + ".npz", **arrays)
            return rows

        def repeat_nll():
            rows = []
            for index, (ids, second) in enumerate(repeats):
                ends = range(second + 1, len(ids) - 1)  # prompt ends; fed token, then target
                prompts = [TokensPrompt(prompt_token_ids=ids[:end]) for end in ends]
                forced = [SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True,
                                         detokenize=False, logit_bias={ids[end]: 100.0},
                                         logprob_token_ids=[ids[end + 1]]) for end in ends]
                outputs = shared_prefix_generate(prompts, forced)
                nll, missing = [], 0
                for end, out in zip(ends, outputs):
                    completion = out.outputs[0]
                    entry = completion.logprobs[1].get(ids[end + 1])
                    if completion.token_ids[0] != ids[end] or entry is None:
                        missing += 1  # not forced, or no log-probability returned
                        continue
                    nll.append(-entry.logprob)
                rows.append(dict(doc=index, nll=sum(nll) / max(len(nll), 1), tokens=len(nll),
                                 missing=missing))
            return rows

        for name, body in (("retrieval", retrieval), ("kl", kl_steps), ("repeat", repeat_nll)):
            if name in tasks:
                phase(f"{name}_{context}", body)
    result["seconds"] = round(time.time() - start, 1)
    with open(args.out, "w") as f:
        json.dump(result, f)


# --------------------------------------------------------------------------------------------
# report: combine the arms' files (CPU; numpy and torch)
# --------------------------------------------------------------------------------------------


def _perplexity(rows):
    """exp of the token-weighted mean NLL over documents."""
    import math

    tokens = sum(r["tokens"] for r in rows)
    return math.exp(sum(r["nll"] * r["tokens"] for r in rows) / tokens) if tokens else None


def coarse_kl(p_ids, p_logprobs, q_ids, q_logprobs):
    """KL(p || q) over the tokens in both top lists, the rest of the vocabulary lumped into one
    outcome; and p's lumped mass. Inputs: one step's top token ids and log-probabilities."""
    import math

    q = dict(zip(q_ids.tolist(), q_logprobs.tolist()))
    kl, p_in, q_in = 0.0, 0.0, 0.0
    for token, lp in zip(p_ids.tolist(), p_logprobs.tolist()):
        if token in q:
            kl += math.exp(lp) * (lp - q[token])
            p_in += math.exp(lp)
            q_in += math.exp(q[token])
    p_rest, q_rest = max(1.0 - p_in, 0.0), max(1.0 - q_in, 1e-12)
    if p_rest > 0:
        kl += p_rest * math.log(p_rest / q_rest)
    return kl, p_rest


def report(args):
    if args.folder.endswith(".json"):  # a summary written before: tables and plot again
        with open(args.folder) as f:
            return render(json.load(f), args.folder, args.readme)
    import numpy as np

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from moira.evaluation.experiments import paired_bootstrap

    arms = {}
    for name in sorted(os.listdir(args.folder)):
        if name.endswith(".json") and not name.startswith("summary"):
            with open(os.path.join(args.folder, name)) as f:
                result = json.load(f)
            if "arm" in result:
                npz = os.path.join(args.folder, name[:-5] + ".npz")
                if not os.path.exists(npz):
                    raise SystemExit(f"{npz} is missing: KL needs every arm's top lists (to "
                                     f"redraw from a summary, pass its .json)")
                result["arrays"] = dict(np.load(npz))
                arms[result["arm"]] = result
    if "dense" not in arms:
        raise SystemExit(f"{args.folder}: no dense arm")
    dense = arms.pop("dense")
    summary = dict(model=dense["model"], gpu=dense["gpu"], vllm=dense["vllm"],
                   torch=dense["torch"], date=dense["date"], documents=dense["documents"],
                   positions=dense["positions"], logprobs=dense["logprobs"],
                   commands={arm: r["command"] for arm, r in [("dense", dense), *arms.items()]},
                   contexts={})
    for result in (dense, *arms.values()):  # a failed phase (its error is in the arm's file)
        result["phases"] = {name: phase for name, phase in result["phases"].items()
                            if "rows" in phase}
    for context in dense["contexts"]:
        table = {}
        retrieval = dense["phases"].get(f"retrieval_{context}")
        kl_rows = dense["phases"].get(f"kl_{context}")
        if retrieval:
            table["dense"] = dict(retrieval=np.mean([r["correct"] for r in retrieval["rows"]]),
                                  samples=len(retrieval["rows"]))
        repeat = dense["phases"].get(f"repeat_{context}")
        if repeat:
            table.setdefault("dense", {})["repeat_ppl"] = _perplexity(repeat["rows"])
        for arm in sorted(arms, key=arm_order):
            phases, entry = arms[arm]["phases"], {}
            sparse = phases.get(f"retrieval_{context}")
            if retrieval and sparse:
                d = [float(r["correct"]) for r in retrieval["rows"]]
                s = [float(r["correct"]) for r in sparse["rows"]]
                entry.update(retrieval=float(np.mean(s)), retrieval_read=sparse["read_fraction"],
                             retrieval_minus_dense=paired_bootstrap(d, s))
            sparse = phases.get(f"kl_{context}")
            ids = arms[arm]["arrays"].get(f"ids_{context}")
            if kl_rows and sparse and ids is not None and f"ids_{context}" in dense["arrays"]:
                p_ids = dense["arrays"][f"ids_{context}"]
                p_lp = dense["arrays"][f"logprobs_{context}"]
                q_lp = arms[arm]["arrays"][f"logprobs_{context}"]
                per_doc, lumped, mismatched = {}, [], 0
                for row, (a, b) in enumerate(zip(kl_rows["rows"], sparse["rows"])):
                    if a["tokens"][0] != b["tokens"][0]:  # different histories: not comparable
                        mismatched += 1
                        continue
                    value, rest = coarse_kl(p_ids[row], p_lp[row], ids[row], q_lp[row])
                    per_doc.setdefault(a["doc"], []).append(value)
                    lumped.append(rest)
                doc_means = [sum(v) / len(v) for v in per_doc.values()]
                entry.update(kl=float(np.mean(doc_means)), kl_docs=len(doc_means),
                             kl_steps=len(lumped), kl_read=sparse["read_fraction"],
                             kl_lumped_mass=float(np.mean(lumped)),
                             kl_first_token_mismatches=mismatched,
                             kl_doc_means=[round(v, 6) for v in doc_means])
            sparse = phases.get(f"repeat_{context}")
            if sparse:
                entry.update(repeat_ppl=_perplexity(sparse["rows"]),
                             repeat_read=sparse["read_fraction"],
                             repeat_missing=sum(r["missing"] for r in sparse["rows"]))
            if entry:  # an arm run at other contexts only (a top_k budget is per context)
                table[arm] = entry
        summary["contexts"][str(context)] = table
    out = args.out or os.path.join(args.folder, "summary.json")
    with open(out, "w") as f:
        json.dump(summary, f, indent=1, default=float)
    render(summary, out, args.readme)


def render(summary, path, readme=None):
    """Print the markdown table, draw ``<summary>.png``, and optionally fill the
    ``accuracy-vllm`` section of ``readme`` (benchmarks/RESULTS.md)."""
    text = markdown(summary)
    print(text)
    plot(summary, os.path.splitext(path)[0] + ".png")
    if readme:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from readme_section import write_section

        write_section(readme, "accuracy-vllm", text)


def _model_name(summary):
    return summary.get("model_name") or os.path.basename(summary["model"].rstrip("/"))


def plot(summary, path):
    """Token KL and pass-key accuracy against the fraction of pages read, one line per
    context; dense accuracy as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (kl_axis, acc_axis) = plt.subplots(1, 2, figsize=(10, 3.8))
    colors = ("tab:blue", "tab:orange", "tab:green", "tab:red")
    for (context, table), color in zip(summary["contexts"].items(), colors):
        arms = [(arm, row) for arm, row in table.items() if arm != "dense"]
        kl = [(row["kl_read"], row["kl"], arm) for arm, row in arms if "kl" in row]
        acc = [(row["retrieval_read"], row["retrieval"], arm) for arm, row in arms
               if "retrieval" in row]
        for axis, points in ((kl_axis, kl), (acc_axis, acc)):
            rule = [(x, y) for x, y, arm in points if not arm.startswith("top_k")]
            fixed = [(x, y) for x, y, arm in points if arm.startswith("top_k")]
            axis.plot([x for x, _ in rule], [y for _, y in rule], "o-", color=color,
                      label=f"{context} tokens, coverage rule")
            if fixed:
                axis.plot([x for x, _ in fixed], [y for _, y in fixed], "s", color=color,
                          mfc="none", label=f"{context} tokens, fixed K")
            for x, y, arm in points:
                axis.annotate(arm if arm.startswith("top_k") else f"γ={arm}", (x, y), fontsize=7,
                              textcoords="offset points",
                              xytext=(3, 3))
        if "dense" in table:
            acc_axis.axhline(table["dense"]["retrieval"], color=color, ls="--", lw=1,
                             label=f"dense, {context}")
    kl_axis.set(xlabel="fraction of KV pages read", ylabel="token KL to dense (lower bound)",
                yscale="log", title="KL of the decode step's next-token distribution")
    samples = {row["dense"].get("samples") for row in summary["contexts"].values()
               if "dense" in row}
    acc_axis.set(xlabel="fraction of KV pages read", ylabel="pass-key exact match",
                 title=f"pass-key retrieval ({'/'.join(map(str, sorted(samples - {None})))} "
                       f"samples per context)")
    for axis in (kl_axis, acc_axis):
        axis.legend(fontsize=7)
    fig.suptitle(f"{_model_name(summary)}: Moira in vLLM "
                 f"{summary['vllm']} vs dense FA3, {summary['gpu']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(summary):
    lines = [f"**{_model_name(summary)}** through vLLM {summary['vllm']} "
             f"on one {summary['gpu']}, {summary['date']}: dense FA3 against the Moira plugin "
             f"(prefill by FA3, decode steps by Moira's kernels in full CUDA graphs); "
             f"{summary['documents']} documents per context, pass-key samples single and 4-key "
             f"(2 per document), KL over {summary['positions']} decode steps per document "
             f"(top-{summary['logprobs']} lists, the rest lumped: a lower bound).", "",
             "| context | arm | pass-key acc. (dense) | Δ vs dense [95% CI] | pages read | "
             "token KL | pages read | lumped mass |", "|---|---|---|---|---|---|---|---|"]
    with_repeat = any("repeat_ppl" in row for table in summary["contexts"].values()
                      for row in table.values())
    if with_repeat:
        lines[-2] += " repeated-passage ppl (dense) | pages read |"
        lines[-1] += "---|---|"
    for context, table in summary["contexts"].items():
        dense = table.get("dense", {})
        for arm, row in table.items():
            if arm == "dense":
                continue
            delta = row.get("retrieval_minus_dense")
            lines.append(
                f"| {context} | {'γ = ' + arm if arm[0].isdigit() else arm} | "
                + (f"{row['retrieval']:.3f} ({dense['retrieval']:.3f})" if "retrieval" in row
                   else "—")
                + (f" | {delta['mean']:+.3f} [{delta['low']:+.3f}, {delta['high']:+.3f}] | "
                   f"{row['retrieval_read']:.1%}" if delta else " | — | —")
                + (f" | {row['kl']:.4f} | {row['kl_read']:.1%} | {row['kl_lumped_mass']:.4f} |"
                   if "kl" in row else " | — | — | — |")
                + ((f" {row['repeat_ppl']:.3f} ({dense.get('repeat_ppl', float('nan')):.3f}) | "
                    f"{row['repeat_read']:.1%} |" if "repeat_ppl" in row else " — | — |")
                   if with_repeat else ""))
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    one = commands.add_parser("run", help="one arm: an engine, every context's measurements")
    one.add_argument("--model", required=True, help="a Hugging Face folder (config, weights)")
    one.add_argument("--text", required=True, help="a .txt or {'text': ...} .json file")
    one.add_argument("--arm", required=True,
                     help="dense, a gamma (Moira's coverage rule) or top_k=N (Moira, N pages)")
    one.add_argument("--tasks", default="retrieval,kl,repeat")
    one.add_argument("--contexts", default="32000,16384")
    one.add_argument("--documents", type=int, default=20)
    one.add_argument("--positions", type=int, default=32, help="KL decode steps per document")
    one.add_argument("--logprobs", type=int, default=1000, help="top log-probs kept per step")
    one.add_argument("--kv-gib", type=float, default=8.0, help="KV cache size (every arm alike)")
    one.add_argument("--dummy", action="store_true", help="random weights, byte tokenizer")
    one.add_argument("--out", required=True)
    both = commands.add_parser("report", help="combine the arms' files in one folder")
    both.add_argument("folder", help="the arms' folder (with their .npz), or a summary .json")
    both.add_argument("--out", default=None)
    both.add_argument("--readme", default=None)
    args = parser.parse_args()
    run(args) if args.command == "run" else report(args)


if __name__ == "__main__":
    main()
