"""One launch of each Moira kernel at two shapes, for Nsight Compute:

    ncu --clock-control none -k regex:"estimate|select|attend|merge" \\
        --section SpeedOfLight --section Occupancy --section LaunchStats \\
        --section WarpStateStats --section MemoryWorkloadAnalysis \\
        python3 benchmarks/profile_kernels.py

Each kernel runs twice (the first launch compiles); profile the second (--launch-skip or
read the last of each). Llama-3.1-8B geometry, 22% of each row's pages (top-k mode).
``--kernel-setting MODULE.NAME=INT`` (repeatable, as ``vllm_tpot.py``'s) profiles a tuning
candidate, e.g. ``attend.PAGE_IDS_AHEAD=1 attend.PAGES_PER_ITER=1 attend.NUM_STAGES=3``.
"""

import argparse
import sys

import torch

import moira

sys.path.insert(0, "benchmarks")
from tune_kernels import GROUP, HEAD_DIM, KV_HEADS, step_inputs  # noqa: E402
from vllm_tpot import apply_kernel_settings, parse_kernel_settings  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--kernel-setting", action="append", default=[],
                        help="a tuning constant of moira/kernels/<MODULE>.py, e.g. "
                             "attend.NUM_STAGES=3 (repeatable)")
    apply_kernel_settings(parse_kernel_settings(parser, parser.parse_args().kernel_setting))
    for context, batch in [(131072, 4), (8192, 32)]:
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
