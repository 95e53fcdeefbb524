#!/usr/bin/env bash
# Reproduce results/profile_example (a CPU is enough; about 90 minutes on 2 busy cores):
#  1. attention profiles (kvbench-profile) of the embedded SmolLM2 (retrieval: 6 prompts, XSum: 4) and
#     Gemma 3 270M (retrieval: 4, XSum: 4);
#  2. allocation=profiled (policy=profiled/snapkv: budgets from step 1's profile of the same model and task)
#     against uniform (snapkv) and pyramid (pyramidkv) at the same total budget, same score and scope, on
#     retrieval (6 prompts), and its report with bootstrap intervals.
# XSUM_DIR: a local directory holding test.jsonl in the hub's field names; unset, XSum is fetched from the hub.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
OUT=results/profile_example
XSUM=(task=xsum task.n=4 task.max_new_tokens=32)
if [ -n "${XSUM_DIR:-}" ]; then XSUM+=("task.data_dir=$XSUM_DIR"); fi
.venv/bin/kvbench-profile model=smollm2-135m task=retrieval task.n=6 output_dir=$OUT/smollm2-135m/retrieval
.venv/bin/kvbench-profile model=smollm2-135m "${XSUM[@]}" output_dir=$OUT/smollm2-135m/xsum
.venv/bin/kvbench-profile model=gemma3-270m task=retrieval task.n=4 output_dir=$OUT/gemma3-270m/retrieval
.venv/bin/kvbench-profile model=gemma3-270m "${XSUM[@]}" output_dir=$OUT/gemma3-270m/xsum
.venv/bin/kvbench-run -m model=smollm2-135m,gemma3-270m policy=snapkv,pyramidkv,profiled/snapkv budget=0.2 \
  stage=prefill task=retrieval task.n=6 results_dir=results sweep_name=profile_example/allocation print_table=false
.venv/bin/kvbench-report $OUT/allocation --out $OUT/allocation/report
