"""One launch of each Moira kernel at two shapes, for Nsight Compute:

    ncu --clock-control none -k regex:"estimate|select|attend|merge" \\
        --section SpeedOfLight --section Occupancy --section LaunchStats \\
        --section WarpStateStats --section MemoryWorkloadAnalysis \\
        python3 benchmarks/profile_kernels.py

Each kernel runs twice (the first launch compiles); profile the second (--launch-skip or
read the last of each). Llama-3.1-8B geometry, 22% of each row's pages (top-k mode).
``--kernel-setting MODULE.NAME=INT`` (repeatable, as ``vllm_tpot.py``'s) profiles a tuning
candidate, e.g. ``attend.IMPLEMENTATION=cuda attend.CUDA_STAGES=3``; ``--shapes
32768x16`` other (context x batch) shapes.
"""

import argparse
import sys

import torch

import moira

sys.path.insert(0, "benchmarks")
from tune_kernels import GROUP, HEAD_DIM, KV_HEADS, step_inputs  # noqa: E402
from vllm_tpot import (add_kernel_settings, apply_kernel_settings,  # noqa: E402
                        parse_kernel_settings)


def main():
    parser = argparse.ArgumentParser()
    add_kernel_settings(parser)
    parser.add_argument("--shapes", default="131072x4,8192x32",
                        help="comma-separated CONTEXTxBATCH, profiled in that order")
    args = parser.parse_args()
    apply_kernel_settings(parse_kernel_settings(parser, args.kernel_setting))
    for shape in args.shapes.split(","):
        context, batch = (int(part) for part in shape.split("x"))
        query, keys, values, summaries, table, seq_lens = step_inputs(context, batch)
        pages = context // 64
        workspace = moira.DecodeWorkspace(batch, pages, KV_HEADS * GROUP, KV_HEADS, HEAD_DIM,
                                          device="cuda")
        out = torch.empty_like(query)
        for _ in range(2):
            moira.sparse_decode(query, keys, values, summaries, table, seq_lens,
                                top_k=round(0.22 * pages), workspace=workspace, out=out)
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
