#!/usr/bin/env bash
# Reproduce results/example: a real sweep on the embedded SmolLM2 (a CPU is enough) and its report.
# Retrieval and an XSum sample (from ../shared/data, the hub's file layout), every named method plus the
# full cache, three budgets, in the stages each method runs in (prefill and decode where both have a meaning).
# A rerun skips the cells already done.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
BOTH=full,streamingllm,h2o,tova,roco,keydiff,lagkv,leverage,cur,threshold,cam  # prefill and decode
PREFILL=expected_attention,criticalkv,criticalkv_adakv,chunkkv,noncausal_attn,compactor,cap  # prompt scores
# Budgets per layer, per head, per channel or from passes of their own (HeadKV reads the committed profile)
PREFILL+=,global_snapkv,layers_snapkv,simlayerkv,kvzip,kvzip_plus,kvgrad,kvcompose,duoattention,cake
PREFILL+=,entropy_gated_chunkkv,think_snapkv,profiled/headkv
DECODE=rkv,quest  # decode-time rules (Quest attends its budget, holding every key)
CELLS=("policy=$BOTH stage=prefill,decode" "policy=$PREFILL stage=prefill" "policy=$DECODE stage=decode")
COMMON=(results_dir=results sweep_name=example "budget=0.25,0.5,0.75" print_table=false)
for cells in "${CELLS[@]}"; do
  read -ra grid <<< "$cells"
  .venv/bin/kvbench-run -m "${COMMON[@]}" "${grid[@]}" task=retrieval task.n=5 task.context_tokens=1024
  .venv/bin/kvbench-run -m "${COMMON[@]}" "${grid[@]}" task=xsum task.data_dir="${XSUM_DIR:-../shared/data/xsum}" \
    task.n=4 task.max_new_tokens=40 task.max_prompt_tokens=1024
done
.venv/bin/kvbench-report results/example --out results/example/report
