"""Accuracy of Moira's selection against dense attention, on trained models.

    PYTHONPATH=. python3 benchmarks/accuracy.py vllm --model HF_DIR --text essays.json \
        --arm dense|GAMMA|top_k=N --out DIR/ARM.json
    PYTHONPATH=. python3 benchmarks/accuracy.py eval MODEL TEXT OUT [--deadline 540] [JOB ...]
    PYTHONPATH=. python3 benchmarks/accuracy.py calibrate --out cal.json
    PYTHONPATH=. python3 benchmarks/accuracy.py calibrated-kl --calibration cal.json \
        --part 0/2 --out part0.json
    PYTHONPATH=. python3 benchmarks/accuracy.py summary-precision --out precision.json
    PYTHONPATH=. python3 benchmarks/accuracy.py estimators --tasks passkey,fact --samples 10 \
        --out part.json
    PYTHONPATH=. python3 benchmarks/accuracy.py estimators --merge part*.json --out all.json \
        --plot all.png

``report.py accuracy-vllm DIR`` (the ``vllm`` arms), ``report.py accuracy`` (``eval``'s files)
and ``report.py calibration`` (``calibrated-kl``'s parts) make the tables and plots.

vllm: one trained model served by vLLM with dense FA3 and with Moira's kernels (the plugin
inside full CUDA graphs, prefill rows by FA3), on the samples ``moira eval`` uses; one engine
per arm, several arms may share the GPU. Per context (``--contexts``, the longest first):

- retrieval: ``moira eval``'s pass-key samples (single- and 4-key), a greedy answer of 8
  tokens, exact match of its digits (the first token from the prefill, FA3 in every arm).
- kl: ``moira eval``'s KL documents; for each, ``--positions`` prompts ending 1..P tokens
  before the window's end, two greedy tokens each: the second from one decode step over the
  whole context, whose top ``--logprobs`` log-probabilities are saved (``ARM.npz``); the
  report computes KL(dense || sparse) over the tokens in both arms' top lists, the rest of
  the vocabulary lumped into one outcome (a lower bound on the full KL, tight when the lumped
  mass is small).
- repeat: ``moira eval``'s repeated-passage pairs; each token of the second copy forced
  (``logit_bias``) and the next token's log-probability read from one decode step: the NLL
  of the copy, teacher-forced.

Arms: ``dense`` (FA3), a gamma (Moira's coverage rule) or ``top_k=N`` (N pages per row).
Prefix caching is on: each document's first prompt runs alone and its pages serve the others
(so Moira also reads the summaries of cached pages). Every arm gets the same KV-cache size, so
every engine schedules the same batches. ``--dummy`` runs the model's geometry on random
weights with a byte tokenizer (a smoke test of the plumbing).

eval: ``moira eval`` processes on the GPU, one per JOB (``name:context:tasks[:extra args]``;
default the 16k and 32k KL and retrieval runs and a 32k budget analysis on 10 documents), all
in parallel on one GPU (each is bound by Python and kernel launches), each writing
``OUT/<name>.json`` (rows so far in ``.json.partial``) and ``OUT/<name>.log``; unfinished jobs
are stopped after ``--deadline`` seconds.

calibrate / calibrated-kl: does a per-(layer, KV head) coverage target fix mvar's
mis-calibration? ``calibrate`` measures, per head, the exact mass inside the gamma-lists along
the greedy continuation on calibration documents (the text's first half) and the tail ratio
r = (1 - mean covered) / (1 - gamma) that sets the head's target gamma' = 1 - (1 - gamma) / r;
``calibrated-kl`` measures token KL to dense (teacher-forced on the dense continuation) and
pages read on held-out documents (the second half) for global gammas and calibrated targets
(``--part i/n`` runs every n-th document, for parallel processes).

estimators: candidate page-mass estimators (``moira/estimators.py``) against the exact masses
and against each other on short-needle retrieval tasks (``moira/evaluation/estimator_study.py``
says what is measured; docs/design/estimate.md the results).

summary-precision: would FP8 page summaries select the same pages? On a trained model each
decode step of each layer selects its pages (coverage rule, ``moira.reference``) from
summaries rounded to bfloat16 (what the kernels store) and to FP8 forms (``FORMS``: e4m3;
e4m3 with a per-vector scale; the variance alone scaled to e4m3), on the same queries and
keys, and records how the FP8 lists differ from the bfloat16 ones and how much exact attention
mass each keeps. The model decodes with the bfloat16 lists along its dense greedy
continuation.
"""

import argparse
import json
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
from moira import reference  # noqa: E402
from moira.evaluation import calibration, experiments, hf  # noqa: E402
from moira.evaluation.tasks import read_text, windows  # noqa: E402

# --------------------------------------------------------------------------------------------
# vllm: one arm through the plugin
# --------------------------------------------------------------------------------------------

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


def vllm_run(args):
    """One arm: an engine, every context's measurements, to ``--out``."""
    common.vllm_in_process()
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
    info = common.run_info("vllm")
    result = dict(arm=args.arm, model=args.model, text=args.text, contexts=contexts,
                  documents=args.documents, positions=args.positions, logprobs=args.logprobs,
                  dummy=args.dummy, startup_s=round(time.time() - start, 1),
                  gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                  vllm=__import__("vllm").__version__, date=info["date"][:10],
                  command=info["command"], commit=info["commit"], dirty=info["dirty"],
                  phases={})

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
# eval: `moira eval` jobs in parallel on one GPU
# --------------------------------------------------------------------------------------------

EVAL_JOBS = ("32k-kl:32000:kl", "32k-retrieval:32000:retrieval", "16k-kl:16384:kl",
             "16k-retrieval:16384:retrieval", "32k-budget:32000:budget:--documents 10 "
             "--new-tokens 16")


def eval_command(model, text, out, job):
    """The ``moira eval`` command of one JOB ``name:context:tasks[:extra args]`` (e.g.
    ``32k-kl:32000:kl:--calibrate 5`` adds calibrated arms); ``(name, command)``."""
    name, context, tasks, *extra = job.split(":", 3)
    return name, [sys.executable, "-m", "moira.cli", "eval", "--model", model, "--text", text,
                  "--device", "cuda", "--documents", "20", "--context", context, "--tasks",
                  tasks, *(extra[0].split() if extra else []),
                  "--out", os.path.join(out, f"{name}.json")]


def eval_jobs(args):
    """Start every job, wait for them or the deadline, stop the unfinished ones (their rows so
    far stay in ``OUT/*.json.partial``), and print each log's last lines."""
    os.makedirs(args.out, exist_ok=True)
    start, running = time.time(), []
    for job in args.jobs or EVAL_JOBS:
        name, command = eval_command(args.model, args.text, args.out, job)
        log = open(os.path.join(args.out, f"{name}.log"), "w")
        running.append((name, log, subprocess.Popen(command, stdout=log,
                                                    stderr=subprocess.STDOUT)))
    while any(process.poll() is None for _, _, process in running) \
            and time.time() - start < args.deadline:
        time.sleep(5)
    unfinished = [process for _, _, process in running if process.poll() is None]
    if unfinished:
        print(f"deadline: stopping {len(unfinished)} unfinished job(s)")
        for process in unfinished:
            process.terminate()
            process.wait()
    for name, log, _ in running:
        log.close()
        with open(log.name) as f:
            print(f"== {log.name}\n" + "".join(f.readlines()[-2:]), end="")


# --------------------------------------------------------------------------------------------
# calibrate / calibrated-kl: per-head coverage targets (CPU)
# --------------------------------------------------------------------------------------------

DEFAULT_MODEL = os.path.expanduser("~/.cache/moira-models/smollm2-135m-hf")
DEFAULT_TEXT = os.path.join(common.REPO, "..", "shared", "data", "paul_graham_essays.json")


def load(args):
    """The model (float32, Moira's attention registered) and the text's token ids: its first
    half (calibration documents) and its second (evaluation)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf.register()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32,
                                                 attn_implementation=hf.ATTENTION_NAME)
    ids = tokenizer(read_text(args.text), add_special_tokens=False)["input_ids"]
    # calibration documents from the first half of the text, evaluation from the second
    half = len(ids) // 2
    return experiments.CausalLM(model), ids[:half], ids[half:]


def calibrate(args):
    """Per (layer, KV head) tail ratios on calibration documents (``moira calibrate``)."""
    lm, calibration_ids, _ = load(args)
    start = time.time()
    covered = calibration.measure(lm, windows(calibration_ids, args.context, args.documents,
                                              seed=7),
                                  gamma=args.gamma, new_tokens=args.new_tokens)
    ratios = calibration.tail_ratios(covered, args.gamma)
    with open(args.out, "w") as f:
        json.dump(dict(gamma=args.gamma, mean_covered=covered, tail_ratios=ratios,
                       targets=calibration.targets(ratios, args.gamma).tolist(),
                       documents=args.documents, context=args.context,
                       seconds=round(time.time() - start), command=" ".join(sys.argv)), f)
    flat = [m for row in covered for m in row]
    print(f"mean covered {sum(flat) / len(flat):.3f}")


def calibrated_kl(args):
    """Token KL and pages read on held-out documents: global gammas, calibrated targets."""
    lm, _, evaluation_ids = load(args)
    with open(args.calibration) as f:
        measured = json.load(f)
    part, parts = map(int, args.part.split("/"))
    docs = windows(evaluation_ids, args.context, args.documents, seed=11)[part::parts]
    # the tail ratios measured at the calibration's gamma serve every target
    ratios = calibration.tail_ratios(measured["mean_covered"], measured["gamma"])
    arms = list(args.gammas) + [experiments.Calibrated(target, calibration.targets(ratios, target))
                                for target in args.calibrated]
    names = {experiments.label(arm): (f"calibrated target={arm.gamma}"
                                      if isinstance(arm, experiments.Calibrated)
                                      else f"global gamma={arm}") for arm in arms}
    rows = []
    start = time.time()

    def save(message):  # after every document: a run cut short keeps what it measured
        print(f"{message} ({time.time() - start:.0f} s)", flush=True)
        with open(args.out, "w") as f:
            json.dump(dict(rows=[dict(doc=part + r["doc"] * parts, arm=names[r["gamma"]],
                                      kl=r["kl"], read_fraction=r["read_fraction"])
                                 for r in rows],
                           calibration=args.calibration, command=" ".join(sys.argv),
                           seconds=round(time.time() - start)), f)

    experiments.token_kl(lm, docs, arms, args.new_tokens, progress=save, rows=rows)



# --------------------------------------------------------------------------------------------
# summary-precision: would FP8 summaries select the same pages? (CPU)
# --------------------------------------------------------------------------------------------

E4M3_MAX = 448.0


def _e4m3(x):
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()


def _e4m3_scaled(x):
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30) / E4M3_MAX
    return _e4m3(x / scale) * scale


def _bf16(x):
    return x.to(torch.bfloat16).float()


# summaries [pages, kv_heads, 2 (mean, variance), D] -> the same, rounded
FORMS = {
    "bf16": _bf16,
    "e4m3": _e4m3,
    "e4m3 scaled": _e4m3_scaled,
    "var e4m3": lambda s: torch.stack([_bf16(s[:, :, 0]), _e4m3_scaled(s[:, :, 1])], dim=2),
}


def comparing_select(gamma, stats):
    """A ``SparseDecoding`` selector (batch 1) that returns the bf16 form's lists and adds, per
    form, each row's list length, its exact kept mass and its overlap with the bf16 list."""

    def select(layer, query, key_cache, block_table, seq_lens, scale):
        summaries = reference.summarize(key_cache, block_table, seq_lens)
        shares = reference.group_shares(reference.exact_log_masses(
            query, key_cache, block_table, seq_lens, scale))
        chosen = {}
        for name, form in FORMS.items():
            log_masses = reference.estimate(query, key_cache, form(summaries), block_table,
                                            seq_lens, scale)
            chosen[name] = reference.select(log_masses, seq_lens, gamma=gamma)
        base_lists, base_counts = chosen["bf16"]
        for name, (lists, counts) in chosen.items():
            row = stats.setdefault(name, dict(rows=0, identical=0, pages=0, base_pages=0,
                                              only_here=0, only_base=0, kept_mass=0.0,
                                              min_kept_mass=1.0))
            for head in range(counts.shape[1]):
                kept = set(lists[0, head, : counts[0, head]].tolist())
                base = set(base_lists[0, head, : base_counts[0, head]].tolist())
                mass = float(shares[0, head, sorted(kept)].sum())
                row["rows"] += 1
                row["identical"] += kept == base
                row["pages"] += len(kept)
                row["base_pages"] += len(base)
                row["only_here"] += len(kept - base)
                row["only_base"] += len(base - kept)
                row["kept_mass"] += mass
                row["min_kept_mass"] = min(row["min_kept_mass"], mass)
        return base_lists, base_counts

    return select




def summary_precision(args):
    """Every form's lists against bfloat16's along each document's dense continuation: a
    table, ``--out`` and ``--plot``."""

    lm, _, evaluation_ids = load(args)  # the text's second half, as calibrated-kl's
    docs = windows(evaluation_ids, args.context, args.documents, seed=11)
    stats, start = {}, time.time()
    for index, doc in enumerate(docs):
        cache, logprobs = lm.prefill(doc)
        tokens, _ = lm.greedy(cache, logprobs, args.new_tokens)
        lm.teacher_forced(cache, tokens[:-1],
                          hf.SparseDecoding(select=comparing_select(args.gamma, stats)))
        print(f"document {index + 1}/{len(docs)} ({time.time() - start:.0f} s)", flush=True)
    table = {name: dict(rows=s["rows"], identical_lists=s["identical"] / s["rows"],
                        pages_vs_bf16=s["pages"] / s["base_pages"],
                        pages_only_here=s["only_here"] / s["base_pages"],
                        bf16_pages_missed=s["only_base"] / s["base_pages"],
                        mean_kept_mass=s["kept_mass"] / s["rows"],
                        min_kept_mass=s["min_kept_mass"])
             for name, s in stats.items()}
    with open(args.out, "w") as f:
        json.dump(dict(common.run_info(), table=table, model=os.path.basename(args.model),
                       context=args.context, documents=args.documents,
                       new_tokens=args.new_tokens, gamma=args.gamma,
                       seconds=round(time.time() - start)), f, indent=1)
    print("| form | rows | identical lists | pages vs bf16 | pages not in bf16's | bf16's pages "
          "missed | mean exact mass kept | min |")
    print("|---|---|---|---|---|---|---|---|")
    for name, row in table.items():
        print(f"| {name} | {row['rows']} | {row['identical_lists']:.3f} | "
              f"{row['pages_vs_bf16']:.4f} | {row['pages_only_here']:.4f} | "
              f"{row['bf16_pages_missed']:.4f} | {row['mean_kept_mass']:.4f} | "
              f"{row['min_kept_mass']:.3f} |")
    if args.plot:
        precision_plot(table, args.plot, f"{os.path.basename(args.model)}, {args.context} tokens, "
             f"gamma = {args.gamma}, {args.documents} documents x {args.new_tokens - 1} steps")




def precision_plot(table, path, title):
    plt = common.pyplot()

    names = list(table)
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    panels = [("identical_lists", "lists identical to bf16's"),
              ("bf16_pages_missed", "bf16's pages not selected (per bf16 page)"),
              ("mean_kept_mass", "exact attention mass kept (mean)")]
    for ax, (key, label) in zip(axes, panels):
        values = [table[name][key] for name in names]
        ax.bar(names, values, color=["#999999"] + ["#1f77b4"] * (len(names) - 1))
        ax.set_title(label, fontsize=9)
        ax.tick_params(axis="x", labelsize=8)
        if key == "mean_kept_mass":
            ax.set_ylim(min(values) - 0.002, max(values) + 0.001)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


# --------------------------------------------------------------------------------------------
# estimators: candidate page-mass estimators against the exact masses (CPU)
# --------------------------------------------------------------------------------------------

STUDY_STATS = ["exact", "mvar", "quest", "quest-32", "quest-16", "int1", "int2", "int4",
               "landmark1-norm", "landmark2-deviation", "landmark2-channel", "mvar+quest",
               "two-stage quest/int2 50%", "two-stage quest/int4 30%"]
STUDY_ARMS = ([(name, "fraction", 0.25) for name in
               ["exact", "mvar", "quest", "quest-16", "int1", "int2", "int4",
                "landmark2-deviation", "mvar+quest", "two-stage quest/int2 50%"]]
              + [(name, "gamma", 0.95) for name in
                 ["exact", "mvar", "int1", "int2", "int4", "landmark2-deviation",
                  "two-stage quest/int2 50%"]]
              + [("mvar", "gamma", 0.98)])


def study_arms(text):
    """``--arms`` as ``(estimator, mode, value)``: comma-separated ``NAME@GAMMA`` (the coverage
    rule) or ``NAME@readFRACTION`` (a fixed share of each row's pages), e.g.
    ``int2@0.99,mvar@read0.25``; empty: ``STUDY_ARMS``."""
    from moira import estimators

    if not text:
        return STUDY_ARMS
    arms = []
    for item in text.split(","):
        name, _, value = item.partition("@")
        mode = "fraction" if value.startswith("read") else "gamma"
        try:
            number = float(value.removeprefix("read"))
        except ValueError:
            number = -1.0
        if name not in estimators.CANDIDATES or not 0 < number <= 1:
            raise SystemExit(f"--arms: {item!r} is not NAME@GAMMA or NAME@readFRACTION with "
                             f"NAME in {sorted(estimators.CANDIDATES)} and a value in (0, 1]")
        arms.append((name, mode, number))
    return arms


def estimator_study(args):
    """Every estimator's statistics and every arm on each task's samples: ``--out`` (rewritten
    after every sample), the table on stdout; ``--merge`` combines such files instead."""
    from moira import estimators
    from moira.evaluation import estimator_study as study

    if args.merge:
        samples, parts = [], []
        for path in args.merge:
            with open(path) as f:
                data = json.load(f)
            samples += data["samples"]
            parts.append({k: v for k, v in data.items() if k not in ("samples", "table")})
        table = study.summarize(samples)
        meta = dict(parts[-1], **common.run_info("transformers"), parts=parts)
        with open(args.out, "w") as f:
            json.dump(dict(meta, table=table, samples=samples), f, indent=None)
        print_study(table)
        if args.plot:
            study_plot(table, args.plot, meta)
        return
    arms, stats = study_arms(args.arms), args.stats.split(",")
    unknown = sorted(set(stats) - set(estimators.CANDIDATES))
    if unknown:
        raise SystemExit(f"--stats: unknown estimators {unknown}")
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer
    lm, _, evaluation_ids = load(args)
    tokenizer = AutoTokenizer.from_pretrained(args.model)

    def encode(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(ids):
        return tokenizer.decode(ids)

    head_dim = lm.model.config.hidden_size // lm.model.config.num_attention_heads
    head_dim = getattr(lm.model.config, "head_dim", None) or head_dim
    start, samples = time.time(), []
    meta = dict(model=os.path.basename(args.model), context=args.context,
                fractions=list(study.FRACTIONS), gammas=list(study.GAMMAS),
                needle_share=study.NEEDLE_SHARE,
                bytes_per_page_per_kv_head={name: estimators.BYTES[name](head_dim)
                                            for name in stats},
                key_bytes_per_page_per_kv_head=estimators.BYTES["exact"](head_dim),
                **common.run_info("transformers"))
    for task in args.tasks.split(","):
        for index, sample in enumerate(study.task_samples(task, args.samples, encode,
                                                          evaluation_ids, args.context)):
            if index < args.first:
                continue
            samples.append(dict(study.run_sample(lm, sample, decode, stats, arms),
                                sample=index))
            with open(args.out, "w") as f:
                json.dump(dict(meta, seconds=round(time.time() - start), samples=samples), f)
            print(f"{task} {index + 1}/{args.samples}: dense "
                  f"{samples[-1]['dense_correct']} ({time.time() - start:.0f} s)", flush=True)
    table = study.summarize(samples)
    with open(args.out, "w") as f:
        json.dump(dict(meta, seconds=round(time.time() - start), table=table,
                       samples=samples), f)
    print_study(table)


def print_study(table):
    for task, entry in table.items():
        print(f"\n{task}: {entry['samples']} samples, dense accuracy "
              f"{entry['dense_accuracy']:.2f}")
        print("| arm | accuracy | token KL | pages read |")
        print("|---|---|---|---|")
        for label, arm in entry["arms"].items():
            print(f"| {label} | {arm['accuracy']:.2f} | {arm['kl']:.4f} | "
                  f"{arm['read_fraction']:.1%} |")
        print("| estimator | covered @0.15/0.25/0.4 | pages @gamma 0.9/0.95/0.98 | covered "
              "@gamma | needle rows | needle kept @0.15/0.25/0.4 | needle est/exact share |")
        print("|---|---|---|---|---|---|---|")
        for name, e in entry["estimators"].items():
            def fmt(values, form="{:.3f}"):
                return " / ".join(form.format(v) for v in values.values())
            print(f"| {name} | {fmt(e['covered_at_fraction'])} | "
                  f"{fmt(e['pages_at_gamma'], '{:.1%}')} | {fmt(e['covered_at_gamma'])} | "
                  f"{e['needle_rows']} | {fmt(e['needle_kept_at_fraction'], '{:.2f}')} | "
                  f"{e['needle_mean_estimated_share']:.3f} / "
                  f"{e['needle_mean_exact_share']:.3f} |")


def study_plot(table, path, meta):
    """Accuracy and token KL against pages read, every arm, over all tasks."""
    plt = common.pyplot()
    entry = table["all"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    names = list(dict.fromkeys(arm["estimator"] for arm in entry["arms"].values()))
    colors = {name: plt.get_cmap("tab10")(i % 10) for i, name in enumerate(names)}
    for ax, key, label in ((axes[0], "accuracy", "accuracy (dense answer reproduced)"),
                           (axes[1], "kl", "token KL(dense || arm)")):
        for name in names:
            for mode, marker in (("fraction", "o"), ("gamma", "s")):
                arms = [a for a in entry["arms"].values()
                        if a["estimator"] == name and a["mode"] == mode]
                if not arms:
                    continue
                ax.scatter([a["read_fraction"] for a in arms], [a[key] for a in arms],
                           marker=marker, color=colors[name], s=40,
                           label=("oracle (exact)" if name == "exact" else name)
                           if mode == "fraction" or not any(
                               a["estimator"] == name and a["mode"] == "fraction"
                               for a in entry["arms"].values()) else None)
                for a in arms:  # the fraction or gamma beside each point
                    ax.annotate(f"{a['value']:g}", (a["read_fraction"], a[key]), fontsize=6,
                                xytext=(3, 3), textcoords="offset points")
        if key == "accuracy":
            ax.axhline(entry["dense_accuracy"], color="gray", linestyle="--", label="dense")
            ax.legend(fontsize=7)
        else:
            ax.set_yscale("log")
        ax.set_xlabel("pages read (circles: a fixed fraction; squares: the coverage rule "
                      "at the gamma shown)", fontsize=8)
        ax.set_title(label, fontsize=9)
    fig.suptitle(f"{meta.get('model')}, {meta.get('context')} tokens, "
                 f"{entry['samples']} samples over the retrieval tasks", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    routines = parser.add_subparsers(dest="routine", required=True)
    one = routines.add_parser("vllm", help="one arm through the vLLM plugin")
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

    one = routines.add_parser("eval", help="moira eval jobs in parallel on one GPU")
    one.add_argument("model", help="a Hugging Face folder or a .gguf file")
    one.add_argument("text", help="the essays (.json or .txt)")
    one.add_argument("out", help="the results' folder")
    one.add_argument("jobs", nargs="*", metavar="JOB",
                     help="name:context:tasks[:extra args] (default: EVAL_JOBS)")
    one.add_argument("--deadline", type=float, default=540.0,
                     help="seconds after which unfinished jobs are stopped")

    for name, text in (("calibrate", "per-head tail ratios on calibration documents"),
                       ("calibrated-kl", "token KL of global and calibrated targets"),
                       ("summary-precision", "FP8 summaries' lists against bfloat16's")):
        one = routines.add_parser(name, help=text)
        one.add_argument("--model", default=DEFAULT_MODEL)
        one.add_argument("--text", default=DEFAULT_TEXT)
        one.add_argument("--context", type=int, default=4096)
        one.add_argument("--new-tokens", type=int, default=32)
        one.add_argument("--out", required=True)
    one = routines.choices["calibrate"]
    one.add_argument("--documents", type=int, default=5)
    one.add_argument("--gamma", type=float, default=0.98)
    one = routines.choices["calibrated-kl"]
    one.add_argument("--calibration", required=True)
    one.add_argument("--documents", type=int, default=10)
    one.add_argument("--part", default="0/1")
    one.add_argument("--gammas", type=float, nargs="+", default=[0.98, 0.99, 0.995])
    one.add_argument("--calibrated", type=float, nargs="+", default=[0.98, 0.99])
    one = routines.choices["summary-precision"]
    one.add_argument("--documents", type=int, default=4)
    one.add_argument("--gamma", type=float, default=0.98)
    one.add_argument("--plot", help="a PNG of the table")
    one = routines.add_parser("estimators", help="candidate page-mass estimators (CPU)")
    one.add_argument("--model", default=DEFAULT_MODEL)
    one.add_argument("--text", default=DEFAULT_TEXT)
    one.add_argument("--context", type=int, default=3072)
    one.add_argument("--tasks", default="passkey,fact,multikey,uuid,code-kv,vartrack")
    one.add_argument("--samples", type=int, default=20, help="samples per task")
    one.add_argument("--first", type=int, default=0, help="skip each task's first samples")
    one.add_argument("--threads", type=int, default=1)
    one.add_argument("--arms", default="", help="NAME@GAMMA or NAME@readFRACTION, "
                     "comma-separated (default: the study's set)")
    one.add_argument("--stats", default=",".join(STUDY_STATS),
                     help="estimators whose per-step statistics are gathered")
    one.add_argument("--merge", nargs="+", help="combine these --out files instead")
    one.add_argument("--plot", help="with --merge: a PNG of accuracy and KL against reads")
    one.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    routine = {"estimators": estimator_study, "vllm": vllm_run, "eval": eval_jobs,
               "calibrate": calibrate, "calibrated-kl": calibrated_kl,
               "summary-precision": summary_precision}
    routine[args.routine](args)


if __name__ == "__main__":
    main()
