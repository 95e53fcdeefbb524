#!/usr/bin/env bash
# Reproduce results/ruler_example: four of RULER's offline subtasks at 1k tokens on the embedded SmolLM2 and Gemma 3
# 270M, the context compressed before the question is read (query-agnostic), and the report.
# Essay haystacks are XSum articles from ../shared/data (HAYSTACK_DIR: any folder of .txt files, e.g. Paul Graham's
# essays); the other subtasks run the same way (qa_1 / qa_2 need SQuAD v2 / HotpotQA: task.qa_path). The NIAH
# subtasks answer within 64 new tokens (RULER allows 128, which only lengthens the misses); vt and fwe keep RULER's.
# A rerun skips the cells done.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
HAYSTACK=${HAYSTACK_DIR:-outputs/haystack_xsum}
.venv/bin/python scripts/make_haystack.py "${XSUM_FILE:-../shared/data/xsum/test.jsonl}" "$HAYSTACK"
RUN=(.venv/bin/kvbench-run -m results_dir=results sweep_name=ruler_example print_table=false stage=prefill
  task=ruler task.n=4 task.haystack_dir="$HAYSTACK")
NIAH=(task.subset=niah_single_1,niah_multikey_1 task.max_new_tokens=64)
for model in smollm2-135m gemma3-270m; do
  for policies in policy=full "policy=streamingllm,snapkv budget=0.25,0.5"; do
    read -ra cells <<< "$policies"
    "${RUN[@]}" model=$model task.context_tokens=1024 "${NIAH[@]}" "${cells[@]}"
    "${RUN[@]}" model=$model task.context_tokens=1024 task.subset=vt,fwe "${cells[@]}"
  done
done
.venv/bin/kvbench-report results/ruler_example --out results/ruler_example/report
