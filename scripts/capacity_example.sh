#!/usr/bin/env bash
# Reproduce results/capacity_example: experiment=capacity on the embedded SmolLM2 (a CPU is enough) and its
# report. Four 512-token retrieval prompts (cycled to fill a batch), 16 new tokens, stage both; full, window and
# h2o at budgets 0.25 and 0.5 under one memory cap (CPU: KV cache plus working memory above the loaded model;
# CAP_GIB overrides it). The committed sweep took 17 minutes on 2 CPU cores.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/kvbench-run -m experiment=capacity results_dir=results sweep_name=capacity_example print_table=false \
  policy=full,window,h2o "capacity.memory_gib=${CAP_GIB:-0.25}"
.venv/bin/kvbench-report results/capacity_example --out results/capacity_example/report
