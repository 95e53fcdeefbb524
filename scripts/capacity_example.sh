#!/usr/bin/env bash
# Reproduce results/capacity_example: experiment=capacity on the embedded SmolLM2 (a CPU is enough) and its
# report. full, window, streamingllm, h2o, tova and roco at budgets 0.5, 0.25 and 0.1 (in that order: the
# smaller the budget, the larger the batches to probe), retrieval prompts cycled to fill a batch, stage both,
# under one memory cap (CPU: KV cache plus working memory above the loaded model). CAP_GIB, CONTEXT_TOKENS and
# NEW_TOKENS override the sizes; BUDGETS the budgets. A cell already in the directory is resumed, not rerun.
# About 9 minutes on 2 idle CPU cores; run it alone: the decode tokens/s it records are the machine's.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
run() {
  .venv/bin/kvbench-run -m experiment=capacity results_dir=results sweep_name=capacity_example print_table=false \
    "capacity.memory_gib=${CAP_GIB:-0.0625}" "task.context_tokens=${CONTEXT_TOKENS:-256}" \
    "max_new_tokens=${NEW_TOKENS:-16}" "$@"
}
run policy=full budget=1.0
for budget in ${BUDGETS:-0.5 0.25 0.1}; do
  run policy=window,streamingllm,h2o,tova,roco "budget=$budget"
done
.venv/bin/kvbench-report results/capacity_example --out results/capacity_example/report
