#!/usr/bin/env bash
# Reproduce results/profile_example: attention profiles of the embedded SmolLM2 and Gemma 3 270M on retrieval and
# XSum (a CPU is enough), then allocation=profiled against uniform and pyramid at equal total budget.
# XSUM_DIR: a local directory holding test.jsonl (the hub's field names); unset, XSum is fetched from the hub.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
OUT=results/profile_example
N_RETRIEVAL=${N_RETRIEVAL:-8}
N_XSUM=${N_XSUM:-8}
XSUM=(task=xsum "task.n=$N_XSUM" task.max_new_tokens=32)
if [ -n "${XSUM_DIR:-}" ]; then XSUM+=("task.data_dir=$XSUM_DIR"); fi
for model in smollm2-135m gemma3-270m; do
  .venv/bin/kvbench-profile model=$model task=retrieval "task.n=$N_RETRIEVAL" output_dir=$OUT/$model/retrieval
  .venv/bin/kvbench-profile model=$model "${XSUM[@]}" output_dir=$OUT/$model/xsum
done
