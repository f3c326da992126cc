#!/usr/bin/env bash
# On the GPU host: the whole test suite with CUDA, the demo on the GPU, and one-layer step timings.
#   bash tools/gpu_check.sh    (writes logs under $OUT when set)
set -uo pipefail
out=${OUT:-/tmp/moira-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/gpu.txt"
PYTHONPATH=. python3 -m pytest -q -p no:cacheprovider tests 2>&1 | tee "$out/pytest-cuda.log" | tail -15
PYTHONPATH=. python3 -m moira.cli demo --context 32768 --batch 2 --kv-heads 8 --group 4 --head-dim 128 --out "$out/demo-gpu.png" 2>&1 | tee "$out/demo-gpu.log" | tail -22
OUT="$out" PYTHONPATH=. python3 benchmarks/tune.py --quick --kinds step 2>&1 | tee "$out/step.log"
