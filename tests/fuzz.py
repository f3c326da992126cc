"""Differential fuzz: ``moira.sparse_decode`` against the float32 spec on random steps.

Each configuration draws a geometry (head dim 64 / 128, G, KV heads), a batch of rows of random
lengths (padded rows, full and one-token pages, long rows), a block table wider than the rows,
a mode (coverage at a random gamma, gamma = 1, a fixed count, per-row fractions), an estimator
and the kernels' backends, runs one step and checks it against ``moira.reference``:

- Select's lists: the spec's (``reference.select`` on ``reference.estimate``), but for pages
  whose share lies within the estimate's rounding of the threshold; counts equal in
  fixed-count mode; every list starts with the sink and ends with the current page.
- the output: attention over the kernel's own lists in float32, within twice the error of the
  same attention in bf16 (flash-attention's rule), every element written.

    python3 tests/fuzz.py --configs 10000 --large [--seed 0] [--out fuzz.json]   # GPU host

``tests/test_fuzz.py`` runs a small budget of small configurations in CI (CPU interpreter).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time

import torch

if not torch.cuda.is_available():  # before any kernel module loads: Triton's CPU interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import moira  # noqa: E402
from moira import reference as ref  # noqa: E402
from moira.config import ESTIMATOR_BITS, PAGE_SIZE  # noqa: E402

NEAR = 1e-6  # a share this close to the threshold may go either way


def draw(rng: random.Random, device: str, large: bool) -> dict:
    """One configuration, as plain values (JSON-ready: printed with a mismatch)."""
    head_dim = rng.choice([64, 128])
    group = rng.choice([1, 2, 3, 4, 7, 8] + ([16] if large else []))
    num_kv_heads = rng.choice([1, 2, 4, 8] if large else [1, 2])
    batch = min(int(math.exp(rng.uniform(0, math.log(300)))), 300) if large \
        else rng.randint(1, 4)
    longest = 131072 if large else 64 * 20
    lengths = []
    for _ in range(batch):
        kind = rng.random()
        if kind < 0.05:
            lengths.append(rng.choice([0, -3]))  # padded rows
        elif kind < 0.2:
            lengths.append(PAGE_SIZE * rng.randint(1, longest // PAGE_SIZE))  # page just full
        else:
            lengths.append(int(math.exp(rng.uniform(0, math.log(longest)))))
    mode = rng.choices(["gamma", "gamma1", "top_k", "fractions"], [6, 1, 2, 1])[0]
    config = dict(head_dim=head_dim, group=group, num_kv_heads=num_kv_heads, lengths=lengths,
                  extra_columns=rng.randint(0, 64 if large else 3), mode=mode,
                  gamma=1.0 if mode == "gamma1" else round(rng.uniform(0.3, 0.999), 4),
                  top_k=rng.randint(2, 40), estimator=rng.choice(list(ESTIMATOR_BITS)),
                  dense_below_pages=rng.choice([0, 0, 0, rng.randint(1, 8)]),
                  backend="triton", seed=rng.getrandbits(31))
    if device == "cuda":
        config["backend"] = rng.choice(["auto", "triton", "cuda"])
    return config


def _kernel_options(config):
    if config["backend"] != "cuda":
        return moira.KernelOptions(estimate=config["backend"], select=config["backend"],
                                   attend=config["backend"])
    # explicit CUDA where its kernels take the shapes, Triton elsewhere
    estimate = "cuda" if config["estimator"] == "mvar" and config["group"] <= 8 else "triton"
    return moira.KernelOptions(estimate=estimate,
                               select="cuda" if config["group"] <= 8 else "triton",
                               attend="cuda" if config["group"] <= 8 else "triton")


def check(config: dict, device: str) -> list[str]:
    """Run one configuration; the list of what disagrees with the spec (empty: all agree)."""
    torch.manual_seed(config["seed"])
    lengths = torch.tensor(config["lengths"], dtype=torch.int32)
    batch, head_dim = len(lengths), config["head_dim"]
    num_kv_heads, group = config["num_kv_heads"], config["group"]
    width = max(1, -(-int(lengths.clamp(min=0).max()) // PAGE_SIZE)) + config["extra_columns"]
    total = batch * width + 3
    keys = torch.randn(total, PAGE_SIZE, num_kv_heads, head_dim) * 1.5
    values = torch.randn(total, PAGE_SIZE, num_kv_heads, head_dim)
    towering = torch.randint(0, total, (4,))  # a few keys far along a random direction
    keys[towering, torch.randint(0, PAGE_SIZE, (4,))] *= 6
    keys, values = keys.bfloat16().to(device), values.bfloat16().to(device)
    table = torch.randperm(total)[: batch * width].view(batch, width).int().to(device)
    query = torch.randn(batch, num_kv_heads * group, head_dim).bfloat16().to(device)
    seq_lens = lengths.to(device)
    moira_config = moira.MoiraConfig(estimator=config["estimator"],
                                     dense_below_pages=config["dense_below_pages"],
                                     kernels=_kernel_options(config), chunk_pages=2,
                                     min_chunks_per_row=3, min_programs=8)
    summaries = moira.summarize(keys, table, seq_lens, estimator=config["estimator"])
    selection = {}
    if config["mode"] in ("gamma", "gamma1"):
        selection["gamma"] = config["gamma"]
    elif config["mode"] == "top_k":
        selection["top_k"] = config["top_k"]
    else:
        fractions = torch.rand(batch, num_kv_heads).clamp(min=0.05)
        selection["keep_fractions"] = fractions.to(device)
    out = torch.full_like(query, float("nan"))
    out, lists, counts = moira.sparse_decode(query, keys, values, summaries, table, seq_lens,
                                             config=moira_config, return_pages=True, out=out,
                                             **selection)
    query_c, keys_c, values_c, summaries_c, table_c, seq_lens_c = (
        t.cpu() for t in (query, keys, values, summaries, table, seq_lens))
    lists, counts = lists.cpu(), counts.cpu()
    problems = []
    if torch.isnan(out).any():
        problems.append("output elements left unwritten (NaN)")
    problems += _check_summaries(keys_c, table_c, seq_lens_c, summaries_c, config["estimator"])
    estimates = ref.estimate(query_c, keys_c, summaries_c, table_c, seq_lens_c,
                             estimator=config["estimator"])
    reference = dict(selection)
    if "keep_fractions" in reference:
        reference["keep_fractions"] = reference["keep_fractions"].cpu()
    want_lists, want_counts = ref.select(estimates, seq_lens_c, **reference,
                                         dense_below_pages=config["dense_below_pages"])
    shares = ref.group_shares(estimates)
    # the kernels' estimates differ from the spec's by float32 rounding (mvar) or the codes'
    # tf32x3 products on the GPU (int2 / int4): a share may move by NEAR, or that relative part
    slack = 0.0 if device == "cpu" or config["estimator"] == "mvar" else 1e-4
    for b in range(batch):
        pages = ref.num_pages(int(lengths[b]), width)
        for h in range(num_kv_heads):
            got = lists[b, h, : counts[b, h]].tolist()
            want = want_lists[b, h, : want_counts[b, h]].tolist()
            where = f"row ({b}, {h}) of {pages} pages"
            if pages and (got[0] != 0 or got[-1] != pages - 1 or got != sorted(set(got))):
                problems.append(f"{where}: list {got[:8]}... not sink, increasing, current")
                continue
            if "gamma" not in selection and counts[b, h] != want_counts[b, h]:
                problems.append(f"{where}: {int(counts[b, h])} pages, spec {len(want)}")
            row = shares[b, h, :pages].double()
            differ = set(got) ^ set(want)
            if differ:
                edge = min(row[sorted(set(want) - {0, pages - 1})].tolist() or [0.0])
                far = [p for p in differ
                       if abs(float(row[p]) - edge) > NEAR + slack * max(edge, float(row[p]))]
                # the coverage rule's margin (2e-6 over the target) may add the next page
                if far and not ("gamma" in selection and len(far) <= 1
                                and set(got) > set(want)):
                    problems.append(f"{where}: pages {sorted(far)[:8]} differ from the spec's "
                                    f"beyond rounding (edge share {edge:.3g})")
            if "gamma" in selection and pages > 2:
                kept = float(row[got].sum())
                if kept < min(selection["gamma"], float(row.sum())) - 1e-5 - slack:
                    problems.append(f"{where}: keeps {kept:.6f} of the share, gamma "
                                    f"{selection['gamma']}")
    inputs = (query_c, keys_c, values_c, table_c, seq_lens_c, lists, counts)
    exact = ref.attend(*inputs)
    lowp = ref.attend(*inputs, dtype=torch.bfloat16)
    error = (out.float().cpu() - exact).abs().max().item() if out.numel() else 0.0
    baseline = (lowp.float() - exact).abs().max().item() if out.numel() else 0.0
    atol = 2 * (exact + 0.3 - 0.3 - exact).abs().max().item() if out.numel() else 0.0
    if not error <= 2 * baseline + atol:
        problems.append(f"output error {error:.3e} > 2 x bf16's {baseline:.3e} + {atol:.1e}")
    return problems


def _check_summaries(keys, table, seq_lens, summaries, estimator):
    """The kernels' summaries against ``reference.summarize`` in the same dtype: min and max
    exact, codes equal but for keys within rounding of a half step (at most one level off);
    mean and variance within a bf16 rounding."""
    want = ref.summarize(keys, table, seq_lens, torch.zeros_like(summaries), estimator)
    full = sorted({p for b, n in enumerate(seq_lens.tolist())
                   for p in table[b, : max(n, 0) // PAGE_SIZE].tolist()})
    if not full:
        return []
    got, want = summaries[full], want[full]
    bits = ESTIMATOR_BITS[estimator]
    if bits == 0:
        close = torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2)
        return [] if close else ["mean / variance summaries differ from the spec's"]
    problems = [] if torch.equal(got[:, :, :2], want[:, :, :2]) else ["min / max differ"]
    codes = [ref.unpack_codes(ref.code_bytes(s), bits, summaries.shape[-1]) for s in (got, want)]
    off = (codes[0] - codes[1]).abs()
    if off.max() > 1 or off.float().mean() > 1e-3:
        problems.append(f"codes differ: {int((off > 0).sum())} of {off.numel()}")
    return problems


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--large", action="store_true",
                        help="engine-sized draws: batch to 300, rows to 131k tokens, G to 16")
    parser.add_argument("--out", help="a JSON summary: counts and every mismatch")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rng = random.Random(args.seed)
    start, failures, errors = time.time(), [], []
    for index in range(args.configs):
        config = draw(rng, device, args.large)
        try:
            problems = check(config, device)
        except Exception as error:  # noqa: BLE001 -- a crash is a finding, not the end
            problems = [f"{type(error).__name__}: {error}"]
            errors.append(index)
        if problems:
            failures.append(dict(index=index, config=config, problems=problems[:5]))
            print(f"config {index}: {problems[:2]} {json.dumps(config)}", flush=True)
    summary = dict(configs=args.configs, seed=args.seed, large=args.large, device=device,
                   gpu=torch.cuda.get_device_name() if device == "cuda" else None,
                   mismatches=len(failures), crashes=len(errors),
                   seconds=round(time.time() - start), failures=failures)
    print(f"{args.configs} configurations, {len(failures)} with mismatches "
          f"({len(errors)} crashed), {summary['seconds']} s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
