#!/usr/bin/env bash
# Reproduce results/niah_example: needle in a haystack on the embedded SmolLM2, 2 lengths x 5 depths, the full cache
# and two methods at a quarter budget, the context compressed before the question is read; and the report with
# its heatmaps. The haystack is XSum articles from ../shared/data (HAYSTACK_DIR: any folder of .txt files).
# A rerun skips the cells done.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
HAYSTACK=${HAYSTACK_DIR:-outputs/haystack_xsum}
.venv/bin/python scripts/make_haystack.py "${XSUM_FILE:-../shared/data/xsum/test.jsonl}" "$HAYSTACK"
RUN=(.venv/bin/kvbench-run -m results_dir=results sweep_name=niah_example print_table=false stage=prefill
  model=smollm2-135m task=niah task.n=2 task.haystack_dir="$HAYSTACK" task.context_tokens=1024,2048
  task.depth=0,25,50,75,100)
"${RUN[@]}" policy=full
"${RUN[@]}" policy=streamingllm,snapkv budget=0.25
.venv/bin/kvbench-report results/niah_example --out results/niah_example/report
