#!/usr/bin/env bash
# Reproduce results/example: a real sweep on the embedded SmolLM2 (a CPU is enough) and its report.
# Retrieval and an XSum sample (from ../shared/data, the hub's file layout), four policies plus the
# full cache, three budgets, prefill and decode stages.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
GRID=(results_dir=results sweep_name=example "policy=full,streamingllm,h2o,tova,roco"
      "budget=0.25,0.5,0.75" "stage=prefill,decode" print_table=false)
.venv/bin/kvbench-run -m "${GRID[@]}" task=retrieval task.n=5 task.context_tokens=1024
.venv/bin/kvbench-run -m "${GRID[@]}" task=xsum task.data_dir="${XSUM_DIR:-../shared/data/xsum}" task.n=4 \
  task.max_new_tokens=40 task.max_prompt_tokens=1024
.venv/bin/kvbench-report results/example --out results/example/report
