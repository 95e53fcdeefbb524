#!/usr/bin/env bash
# Reproduce results/profile_example (a CPU is enough):
#  1. attention profiles of the embedded SmolLM2 and Gemma 3 270M on retrieval and XSum (kvbench-profile);
#  2. allocation=profiled (policy snapkv_profiled, budgets from step 1's profile of the same model and task)
#     against uniform (snapkv) and pyramid (pyramidkv) at the same total budget, same score and scope, and its
#     report with bootstrap intervals.
# XSUM_DIR: a local directory holding test.jsonl in the hub's field names; unset, XSum is fetched from the hub.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
OUT=results/profile_example
N=${N:-6}
XSUM=(task=xsum "task.n=$N" task.max_new_tokens=32)
if [ -n "${XSUM_DIR:-}" ]; then XSUM+=("task.data_dir=$XSUM_DIR"); fi
for model in smollm2-135m gemma3-270m; do
  .venv/bin/kvbench-profile model=$model task=retrieval "task.n=$N" output_dir=$OUT/$model/retrieval
  .venv/bin/kvbench-profile model=$model "${XSUM[@]}" output_dir=$OUT/$model/xsum
done
SWEEP=(-m model=smollm2-135m,gemma3-270m policy=snapkv,pyramidkv,snapkv_profiled budget=0.2 stage=prefill
  results_dir=results sweep_name=profile_example/allocation print_table=false)
.venv/bin/kvbench-run "${SWEEP[@]}" task=retrieval "task.n=$N"
.venv/bin/kvbench-run "${SWEEP[@]}" "${XSUM[@]}"
.venv/bin/kvbench-report $OUT/allocation --out $OUT/allocation/report
