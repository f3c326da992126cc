"""What the decode token's cache write costs inside Estimate's launch (``sparse_decode``'s
``new_keys`` / ``new_values`` / ``slot_mapping``, the plugin's ``fused_cache_write``) against
Estimate alone and against a separate write before it.

One layer of Llama-3.1-8B geometry (8 KV heads, G = 4, head_dim 128, bf16) in a 2,048-page
block table (a 131,072-token vLLM engine), rows selecting (``select``) or read in full
(``full_rows``: Estimate exits after the current page's program). Medians of CUDA-graph
replays (``triton.testing.do_bench_cudagraph``), µs:

- ``estimate``: Estimate alone (the token already in the cache);
- ``fused``: Estimate writing each request's new K and V first;
- ``separate``: two ``index_copy_`` launches (K, V) then Estimate. vLLM writes both with one
  kernel (``reshape_and_cache_flash``, ~2.1 µs per call in session 22's step profile), so
  this arm overstates the separate write; the engine's saving is measured with the plugin
  (``tpot_pairs.sh`` arm ``fcw``, ``vllm_step_profile.py`` with MOIRA_FUSED_CACHE_WRITE=1).

    python3 benchmarks/bench_cache_write.py --out results/cache-write-<date>.json
    python3 benchmarks/bench_cache_write.py --plot results/cache-write-<date>.json
"""

import argparse
import datetime
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

KV_HEADS, GROUP, HEAD_DIM, WIDTH = 8, 4, 128, 2048
SHAPES = ((8192, 1), (8192, 32), (131072, 4))
ARMS = ("estimate", "fused", "separate")


def measure():
    import torch
    import triton

    from moira.kernels.estimate import estimate

    torch.manual_seed(0)
    results = []
    for context, batch in SHAPES:
        pages = context // 64
        keys = torch.randn(batch * pages + 8, 64, KV_HEADS, HEAD_DIM, device="cuda",
                           dtype=torch.bfloat16)
        values = torch.randn_like(keys)
        table = torch.randperm(keys.shape[0], device="cuda")[:batch * pages].view(batch, pages)
        table = torch.cat([table.int(), torch.zeros(batch, max(0, WIDTH - pages),
                                                    dtype=torch.int32, device="cuda")], 1)
        seq_lens = torch.full((batch,), context - 5, dtype=torch.int32, device="cuda")
        query = torch.randn(batch, KV_HEADS * GROUP, HEAD_DIM, device="cuda",
                            dtype=torch.bfloat16)
        summaries = torch.zeros(keys.shape[0], KV_HEADS, 2, HEAD_DIM, device="cuda",
                                dtype=torch.bfloat16)
        log_masses = torch.empty(batch * KV_HEADS, GROUP, WIDTH, device="cuda")
        new_keys = torch.randn(batch, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        new_values = torch.randn_like(new_keys)
        last = (seq_lens - 1).long()
        slots = table[torch.arange(batch, device="cuda"), last // 64].long() * 64 + last % 64
        for mode, dense_below_pages in (("select", 0), ("full_rows", 1 << 20)):
            def plain():
                estimate(query, keys, summaries, table, seq_lens, HEAD_DIM ** -0.5, log_masses,
                         dense_below_pages=dense_below_pages)

            def fused():
                estimate(query, keys, summaries, table, seq_lens, HEAD_DIM ** -0.5, log_masses,
                         dense_below_pages=dense_below_pages,
                         new_kv=(new_keys, new_values, values, slots))

            def separate():
                keys.view(-1, KV_HEADS, HEAD_DIM).index_copy_(0, slots, new_keys)
                values.view(-1, KV_HEADS, HEAD_DIM).index_copy_(0, slots, new_values)
                plain()

            times = {arm: round(triton.testing.do_bench_cudagraph(
                fn, rep=50, return_mode="median") * 1e3, 2)
                for arm, fn in zip(ARMS, (plain, fused, separate))}
            row = dict(context=context, batch=batch, rows=mode, us=times)
            print(json.dumps(row), flush=True)
            results.append(row)
    return results


def plot(path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(path) as f:
        rows = json.load(f)["results"]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    width = 0.27
    for i, arm in enumerate(ARMS):
        ax.bar([j + (i - 1) * width for j in range(len(rows))], [r["us"][arm] for r in rows],
               width, label=arm)
    ax.set_xticks(range(len(rows)),
                  [f"{r['context'] // 1024}k×{r['batch']}\n{r['rows']}" for r in rows],
                  fontsize=7)
    ax.set_ylabel("µs per layer (median, CUDA graph)")
    ax.set_title("Estimate with the decode token's K/V write in its launch (H200)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.splitext(path)[0] + ".png", dpi=110)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="cache-write.json")
    parser.add_argument("--plot", metavar="JSON", help="only draw the PNG of a result file")
    args = parser.parse_args()
    if args.plot:
        return plot(args.plot)
    import torch
    import triton

    results = measure()
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    with open(args.out, "w") as f:
        json.dump(dict(command="python3 " + " ".join(sys.argv), commit=commit,
                       gpu=torch.cuda.get_device_name(),
                       versions=dict(torch=torch.__version__, triton=triton.__version__),
                       date=datetime.datetime.now(datetime.timezone.utc).strftime(
                           "%Y-%m-%d %H:%M UTC"),
                       results=results), f, indent=1)
    plot(args.out)


if __name__ == "__main__":
    main()
