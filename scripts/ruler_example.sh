#!/usr/bin/env bash
# Reproduce results/ruler_example: RULER's offline subtasks on the embedded SmolLM2 at 1k and 2k tokens, a slice on
# Gemma 3 270M, the context compressed before the question is read (query-agnostic), and the report.
# Essay haystacks are XSum articles from ../shared/data (HAYSTACK_DIR: any folder of .txt files, e.g. Paul Graham's
# essays). qa_1 / qa_2 need SQuAD v2 / HotpotQA (task.qa_path) and are left out. A rerun skips the cells done.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
HAYSTACK=${HAYSTACK_DIR:-outputs/haystack_xsum}
.venv/bin/python scripts/make_haystack.py "${XSUM_FILE:-../shared/data/xsum/test.jsonl}" "$HAYSTACK"
RUN=(.venv/bin/kvbench-run -m results_dir=results sweep_name=ruler_example print_table=false stage=prefill
  task=ruler task.n=4 task.haystack_dir="$HAYSTACK")
SUBSETS=niah_single_1,niah_multikey_1,niah_multivalue,niah_multiquery,vt,cwe,fwe
POLICIES=streamingllm,tova,snapkv,expected_attention
"${RUN[@]}" model=smollm2-135m task.context_tokens=1024,2048 task.subset=$SUBSETS policy=full
"${RUN[@]}" model=smollm2-135m task.context_tokens=1024,2048 task.subset=$SUBSETS policy=$POLICIES budget=0.25,0.5
"${RUN[@]}" model=gemma3-270m task.context_tokens=1024 task.subset=niah_single_1,vt,fwe policy=full
"${RUN[@]}" model=gemma3-270m task.context_tokens=1024 task.subset=niah_single_1,vt,fwe policy=streamingllm,snapkv \
  budget=0.25
.venv/bin/kvbench-report results/ruler_example --out results/ruler_example/report
