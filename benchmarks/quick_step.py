"""A first look at the kernels' speed at Llama-3.1-8B geometry (8 KV heads, G = 4, D = 128):
one layer's Estimate, Select, Attend+Merge and the whole step, keeping a fixed 22% of each row's
pages (fixed-count mode) and every page (gamma = 1). Prints only; the full benchmark suite with
peers and committed results is benchmarks/bench_kernels.py (issue 3).

    PYTHONPATH=. python benchmarks/quick_step.py
"""

import math

import torch
import triton

import moira
from moira.kernels.estimate import estimate
from moira.kernels.select import select

KV_HEADS, GROUP, HEAD_DIM = 8, 4, 128
PAGE_BYTES = 2 * 64 * HEAD_DIM * 2  # K and V of one page of one KV head, bf16


def bench(fn):
    return triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median") * 1e3  # us


def main():
    print(f"{'shape':>10} {'est':>7} {'sel':>7} {'att22%':>8} {'step22%':>8} {'att100%':>8} "
          f"{'GB/s att100%':>12}")
    for context, batch in [(8192, 32), (32768, 16), (65536, 8), (131072, 4)]:
        pages = context // 64
        keys = torch.randn(batch * pages, 64, KV_HEADS, HEAD_DIM, device="cuda",
                           dtype=torch.bfloat16)
        values = torch.randn_like(keys)
        table = torch.randperm(batch * pages, device="cuda").view(batch, pages).int()
        seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        query = torch.randn(batch, KV_HEADS * GROUP, HEAD_DIM, device="cuda",
                            dtype=torch.bfloat16)
        summaries = moira.summarize(keys, table, seq_lens)
        workspace = moira.DecodeWorkspace(batch, pages, KV_HEADS * GROUP, KV_HEADS, HEAD_DIM,
                                          device="cuda")
        out = torch.empty_like(query)
        top_k = round(0.22 * pages)
        log_masses, lists, counts = workspace.selection_buffers(batch, pages)
        scale = 1 / math.sqrt(HEAD_DIM)
        ways = workspace.config.bisection_ways_for(pages)

        t_est = bench(lambda: estimate(query, keys, summaries, table, seq_lens, scale,
                                       log_masses))
        t_sel = bench(lambda: select(log_masses, seq_lens, lists, counts,
                                     num_kv_heads=KV_HEADS, max_pages=pages, gamma=0.98,
                                     top_k=top_k, ways=ways))
        t_step = bench(lambda: moira.sparse_decode(query, keys, values, summaries, table,
                                                   seq_lens, top_k=top_k, workspace=workspace,
                                                   out=out))
        _, sparse_lists, sparse_counts = moira.sparse_decode(
            query, keys, values, summaries, table, seq_lens, top_k=top_k, workspace=workspace,
            out=out, return_pages=True)
        sparse_lists, sparse_counts = sparse_lists.clone(), sparse_counts.clone()
        t_att = bench(lambda: moira.attend(query, keys, values, table, seq_lens, sparse_lists,
                                           sparse_counts, workspace=workspace, out=out))
        full_lists = torch.arange(pages, device="cuda", dtype=torch.int32).expand(
            batch, KV_HEADS, pages).contiguous()
        full_counts = torch.full((batch, KV_HEADS), pages, device="cuda", dtype=torch.int32)
        t_full = bench(lambda: moira.attend(query, keys, values, table, seq_lens, full_lists,
                                            full_counts, workspace=workspace, out=out))
        gbps = batch * KV_HEADS * pages * PAGE_BYTES / t_full / 1e3
        print(f"{context // 1024:>4}k x{batch:<4} {t_est:7.1f} {t_sel:7.1f} {t_att:8.1f} "
              f"{t_step:8.1f} {t_full:8.1f} {gbps:12.0f}", flush=True)
        del keys, values


if __name__ == "__main__":
    main()
