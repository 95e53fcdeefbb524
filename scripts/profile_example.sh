#!/usr/bin/env bash
# Reproduce results/profile_example (a CPU is enough; about 95 minutes on 2 cores, measured in several runs):
#  1. attention profiles (kvbench-profile) of the embedded SmolLM2 and Gemma 3 270M on retrieval and XSum, 20
#     prompts each, drawn with task.seed=1: held out from the prompts step 2 scores; and each model's
#     retrieval-head scores on the same retrieval prompts (mode=retrieval_heads, read by policy=profiled/headkv);
#  2. allocation=profiled (policy=profiled/snapkv: per-layer budgets from step 1's profile of the same model
#     and task) against uniform (snapkv) and pyramid (pyramidkv) at the same total budget, same score and
#     scope, stage prefill, on 20 prompts of each task drawn with task.seed=0 (budgets 0.1, 0.2, 0.3 and 0.5
#     on each task), beside the full cache;
#  3. the report, and the paired differences against pyramid and uniform with bootstrap intervals.
# XSUM_DIR: a local directory holding test.jsonl in the hub's field names; unset, XSum is fetched from the hub.
# A cell already in results/profile_example/allocation is resumed, not rerun.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
OUT=results/profile_example
N=${N:-20}
XSUM=(task=xsum "task.n=$N")
if [ -n "${XSUM_DIR:-}" ]; then XSUM+=("task.data_dir=$XSUM_DIR"); fi
for model in smollm2-135m gemma3-270m; do
  .venv/bin/kvbench-profile "model=$model" task=retrieval "task.n=$N" task.seed=1 \
    "output_dir=$OUT/$model/retrieval"
  .venv/bin/kvbench-profile mode=retrieval_heads "model=$model" task=retrieval "task.n=$N" task.seed=1 \
    "output_dir=$OUT/$model/retrieval"
  .venv/bin/kvbench-profile "model=$model" "${XSUM[@]}" task.seed=1 task.max_new_tokens=32 \
    "output_dir=$OUT/$model/xsum"
done
run() {
  .venv/bin/kvbench-run -m model=smollm2-135m,gemma3-270m policy=full,snapkv,pyramidkv,profiled/snapkv stage=prefill \
    task.seed=0 "task.n=$N" results_dir=results sweep_name=profile_example/allocation print_table=false "$@"
}
run task=retrieval budget=0.1,0.2,0.3,0.5
run "${XSUM[@]}" budget=0.1,0.2,0.3,0.5
.venv/bin/kvbench-report $OUT/allocation --out $OUT/allocation/report --paired pyramidkv --paired snapkv
