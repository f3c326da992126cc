#!/usr/bin/env bash
# Interleaved TPOT pairs (issue 5, the paper's Table 3 protocol): engines dense, Moira, dense,
# Moira, one after another on one GPU, each timing the same shapes (benchmarks/vllm_tpot.py).
#
#   PYTHONPATH=/tmp/site:. bash benchmarks/tpot_pairs.sh [SHAPES] [MODEL] [PAIRS]
#   e.g. bash benchmarks/tpot_pairs.sh 8k32,32k16,130k4 llama-3.1-8b 2
#   ARMS="dense moira pdl" bash benchmarks/tpot_pairs.sh 2k1,8k1,16k1 llama-3.1-8b 2
#     (batch 1: a third engine per pair with programmatic launch, <model>-moira-g098-pdl.json)
#   ARMS="dense moira split": the third engine with session 13's batch-1 split
#     (floor_rows 96, min_programs 1: chunk floor 2 pages, 32 chunks per row; since session 14
#     on top of the default short-row floor), -split.json
#   ARMS="dense moira eq4": the third engine with Attend's split as before session 14 (the
#     paper's Eq. 4 alone, step_programs 0), -eq4.json; "t128": step_programs 128 (the
#     default of session 14; 256 since), -t128.json; "jmin": min_programs 1 (J = 32), -jmin.json;
#     "n1024": min_programs 1024 (J = 128 at batch 1 as by default since session 20; 64 at
#     2, 32 from 4), -n1024.json; "jnocap": max_chunks_per_row 4096 (J from Eq. 4 alone, the
#     split before session 20: 342 at batch 1 in a 2,048-page table), -jnocap.json;
#     "nj16": min_chunks_per_row 16 (N_J: J 16 instead of 32 from 256 rows, e.g. 8k x 32,
#     whose rows need at most 6 chunks of 24 pages), -nj16.json;
#     (n1024, nj16, jmin and split share the report's "split" column: one of them per pair)
#     "g099": Moira at the paper's gamma = 0.99 reads (Table 7), -g099.json
#     "nofcw": the new tokens' K/V written by vLLM's own kernel, as before session 23,
#       -nofcw.json (session 23's arm "fcw", the write in Estimate's launch, is the default
#       since: the "moira" engine)
#   "hnd": Moira on vLLM's head-major cache (VLLM_KV_CACHE_LAYOUT=HND: each page-head's K|V
#     rows in one 32 KiB run, against the default's 256-byte rows 4 KiB apart), -hnd.json
#   "kern": kernel tuning constants as KERNEL_SETTINGS says (e.g. "estimate.IMPLEMENTATION=triton
#     estimate.MAX_REGISTERS=96 attend.IMPLEMENTATION=triton attend.PAGES_PER_ITER=1"; a
#     Triton kernel's knobs need its IMPLEMENTATION named), -kern.json
#   TPOT_ARGS: more vllm_tpot.py options for every engine, e.g. "--max-model-len 131072" (the
#     block table of serve_bench.sh's server, 2,048 pages per row, at any shape)
# Results: $OUT/pair<i>/<model>-dense.json and <model>-moira-g098.json; report with
#   python3 benchmarks/tpot_report.py --pairs results/<folder>/pair1 results/<folder>/pair2
# About 4 x (engine start-up ~60 s + ~40 s per shape) for two pairs.
set -euo pipefail
shapes=${1:-8k32,16k32,32k16,64k8,130k4}
model=${2:-llama-3.1-8b}
pairs=${3:-2}
out=${OUT:-.}
for pair in $(seq "$pairs"); do
  mkdir -p "$out/pair$pair"
  for arm in ${ARMS:-dense moira}; do
    layout=""  # VLLM_KV_CACHE_LAYOUT for this engine (empty: left unset, vLLM's NHD)
    case $arm in
      dense) args="--backend dense"; name=$model-dense ;;
      moira) args="--backend moira"; name=$model-moira-g098 ;;
      pdl) args="--backend moira --programmatic-launch"; name=$model-moira-g098-pdl ;;
      split) args="--backend moira --floor-rows 96 --min-programs 1"
             name=$model-moira-g098-split ;;
      # the splits before session 14 (eq4) and of session 14 (t128), J uncapped as then
      eq4) args="--backend moira --step-programs 0 --max-chunks-per-row 4096"
           name=$model-moira-g098-eq4 ;;
      t128) args="--backend moira --step-programs 128 --max-chunks-per-row 4096"
            name=$model-moira-g098-t128 ;;
      g099) args="--backend moira --gamma 0.99"  # Table 7's reads
            name=$model-moira-g099 ;;
      jmin) args="--backend moira --min-programs 1"
            name=$model-moira-g098-jmin ;;
      n1024) args="--backend moira --min-programs 1024"
             name=$model-moira-g098-n1024 ;;
      jnocap) args="--backend moira --max-chunks-per-row 4096"
              name=$model-moira-g098-jnocap ;;
      nj16) args="--backend moira --min-chunks-per-row 16"
            name=$model-moira-g098-nj16 ;;
      nofcw) args="--backend moira --no-fused-cache-write"
             name=$model-moira-g098-nofcw ;;
      hnd) args="--backend moira"; layout=HND
           name=$model-moira-g098-hnd ;;
      # a candidate of the kernels' tuning constants, e.g. KERNEL_SETTINGS=
      # "estimate_cuda.MIN_BLOCKS_PER_SM=4" (vllm_tpot.py --kernel-setting)
      kern) args="--backend moira"
            for setting in ${KERNEL_SETTINGS:?the kern arm needs KERNEL_SETTINGS}; do
              args="$args --kernel-setting $setting"
            done
            name=$model-moira-g098-kern ;;
      *) echo "unknown arm $arm (dense, moira, g099, pdl, split, eq4, t128, jmin, n1024, jnocap, nj16, nofcw, hnd, kern)"; exit 1 ;;
    esac
    env ${layout:+VLLM_KV_CACHE_LAYOUT=$layout} python3 benchmarks/vllm_tpot.py --model "$model" \
      --shapes "$shapes" $args ${TPOT_ARGS:-} \
      --repeats 1 --out "$out/pair$pair/$name.json" 2>&1 | grep "tpot_ms\|Error\|Traceback" \
      | cut -c1-120 || true
  done
done
