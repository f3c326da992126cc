#!/usr/bin/env bash
# Serving benchmark (issue 5, paper Figure 5): one vLLM OpenAI-compatible server on loopback per
# backend, closed-loop clients (benchmarks/serve_bench.py) for each (set, concurrency).
#
#   PYTHONPATH=/tmp/site:. bash benchmarks/serve_bench.sh BACKEND [SETS...]
#   BACKEND: dense | flashinfer | moira (imposed reads of the paper at gamma 0.98)
#   SETS:    e.g. A:1 A:16 B:1 B:8 (default: all four); SET:C@K runs from prompt K, SET:C@K+N
#            prompts K..K+N-1 (given after SERVE_BENCH_ARGS, so they override its --offset and
#            --limit), e.g. A:1@8+8 B:1@7+6
#   SERVE_STATS_INTERVAL: the plugin's stats_interval for the moira server (default 30, the
#   page-read log line; 0 turns Merge's counters off, as in the TPOT and profile engines);
#   other plugin settings through MOIRA_* variables, e.g. MOIRA_FUSED_CACHE_WRITE=1
#   SERVE_BENCH_ARGS: more client arguments, e.g. "--limit 64 --output-tokens 256" (the full
#   protocol, 256 prompts x 1,024 tokens per set A run, takes ~10 min per backend at
#   concurrency 16 and far longer at 1: more than one device session holds; run it in slices,
#   "--offset 64 --limit 64" etc., one server per slice, and keep each slice's JSON under its
#   own name, e.g. serve-moira-A-16-o64.json: serve_report.py pools them). "--deadline 400"
#   sends no request after 400 s, so a slice sized by time is still written; give the other
#   arm that slice's --limit (its "requests")
# Results: $OUT/serve-BACKEND-SET-CONCURRENCY.json; server log: $OUT/server-BACKEND.log
set -euo pipefail
backend=$1; shift
runs=${*:-A:1 A:16 B:1 B:8}
out=${OUT:-.}
model=$(python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import vllm_checks; print(vllm_checks.model_dir('llama-3.1-8b', 0))")
case $backend in
  dense) args=(--attention-backend FLASH_ATTN) ;;
  flashinfer) args=(--attention-backend FLASHINFER) ;;
  moira) args=(--attention-backend CUSTOM --additional-config
               '{"moira": {"imposed_fraction": {"8192": 0.42, "16384": 0.37, "32768": 0.31, "65536": 0.16, "130000": 0.15}, "stats_interval": '"${SERVE_STATS_INTERVAL:-30}"'}}') ;;
  *) echo "unknown backend $backend" >&2; exit 2 ;;
esac
# the server's engine core is another process, and vLLM registers plugins there only through
# `vllm.general_plugins` entry points; moira runs from the source tree (no dist-info on the
# path), so declare its entry point in a minimal dist-info (register() is idempotent)
plugin=$(mktemp -d)/moira_vllm_plugin-0.dist-info
mkdir -p "$plugin"
printf 'Metadata-Version: 2.1\nName: moira-vllm-plugin\nVersion: 0\n' > "$plugin/METADATA"
printf '[vllm.general_plugins]\nmoira = moira.integrations.vllm:register\n' \
  > "$plugin/entry_points.txt"
export PYTHONPATH=$(dirname "$plugin"):$PWD${PYTHONPATH:+:$PYTHONPATH}
# the environment of the in-process runs (vllm_tpot.py); --host: vLLM binds every interface
# by default
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
export VLLM_USE_FLASHINFER_SAMPLER=${VLLM_USE_FLASHINFER_SAMPLER:-0}
python3 -m vllm.entrypoints.openai.api_server --model "$model" --load-format dummy \
  --skip-tokenizer-init --block-size 64 --max-model-len 131072 --no-enable-prefix-caching \
  --max-num-seqs 16 --gpu-memory-utilization 0.88 --host 127.0.0.1 --port 8000 "${args[@]}" \
  > "$out/server-$backend.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
for _ in $(seq 600); do
  curl -sf http://127.0.0.1:8000/health >/dev/null 2>&1 && break
  kill -0 $server 2>/dev/null || { tail -30 "$out/server-$backend.log"; exit 1; }
  sleep 1
done
for run in $runs; do
  slice=()
  if [[ $run == *@* ]]; then
    from=${run#*@}; run=${run%@*}
    slice=(--offset "${from%+*}")
    [[ $from == *+* ]] && slice+=(--limit "${from#*+}")
  fi
  set_name=${run%:*}; concurrency=${run#*:}
  python3 benchmarks/serve_bench.py --set "$set_name" --concurrency "$concurrency" \
    --label "$backend" --out "$out/serve-$backend-$set_name-$concurrency.json" \
    ${SERVE_BENCH_ARGS:-} "${slice[@]}"
done
