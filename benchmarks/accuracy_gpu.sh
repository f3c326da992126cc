#!/usr/bin/env bash
# Accuracy of sparse vs dense decoding on the GPU (issue 6): one `moira eval` process per
# (context, task), all in parallel on one GPU (each is bound by Python and kernel launches, not
# by the GPU), each writing its rows every minute to OUT/<name>.json.partial and its result to
# OUT/<name>.json.
#
#   benchmarks/accuracy_gpu.sh MODEL TEXT OUT [DEADLINE_S] [JOB ...]
#
# MODEL: a Hugging Face folder or a .gguf file; TEXT: the essays (.json or .txt); a JOB is
# "name:context:tasks[:extra args]", default the 16k and 32k KL and retrieval runs and a 32k
# budget analysis on 10 documents. Returns when every job ended or after DEADLINE_S seconds
# (default 540); then it stops the unfinished jobs, whose rows so far stay in OUT/*.partial.
set -u
model=$1 text=$2 out=$3 deadline=${4:-540}
shift $(( $# < 4 ? $# : 4 ))
jobs=("$@")
[ ${#jobs[@]} -gt 0 ] || jobs=("32k-kl:32000:kl" "32k-retrieval:32000:retrieval"
                               "16k-kl:16384:kl" "16k-retrieval:16384:retrieval"
                               "32k-budget:32000:budget:--documents 10 --new-tokens 16")
# calibrated arms too (per-head targets): "--calibrate 5" in a job's extra arguments, e.g.
# "32k-kl:32000:kl:--calibrate 5"
mkdir -p "$out"
start=$(date +%s)
for job in "${jobs[@]}"; do
  IFS=: read -r name context tasks extra <<< "$job"
  # shellcheck disable=SC2086  # extra holds several arguments
  python3 -m moira.cli eval --model "$model" --text "$text" --device cuda --documents 20 \
      --context "$context" --tasks "$tasks" $extra --out "$out/$name.json" \
      > "$out/$name.log" 2>&1 &
done
while [ -n "$(jobs -r)" ] && [ $(( $(date +%s) - start )) -lt "$deadline" ]; do sleep 5; done
running=$(jobs -p)
[ -z "$running" ] || { echo "deadline: stopping $(echo $running | wc -w) unfinished job(s)"; kill $running; }
for log in "$out"/*.log; do echo "== $log"; tail -n 2 "$log"; done
