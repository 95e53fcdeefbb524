#!/usr/bin/env bash
# Every check that needs CUDA, in one call: the gpu-marked tests, scripts/bench_batch.py on the device and a
# small capacity sweep (experiment=capacity) with its report, each logging into OUT (bench JSON, rows, report).
#
#   scripts/gpu_check.sh OUT                      # tiny-llama: no download, a few minutes on one GPU
#   MODEL=smollm2-135m scripts/gpu_check.sh OUT   # the embedded SmolLM2 (needs scripts/setup.sh's packages)
#
# PYTHON picks the interpreter (default: .venv/bin/python if present, else python3); CAP_GIB the sweep's memory
# cap (device memory: weights, KV cache and working memory). A failing step does not stop the later ones; the
# exit status is non-zero if any failed, and OUT/summary.txt lists each step's status.
set -uo pipefail
OUT=${1:?usage: scripts/gpu_check.sh OUTPUT_DIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
MODEL=${MODEL:-tiny-llama}
CAP_GIB=${CAP_GIB:-0.01}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 WANDB_MODE=disabled
: > "$OUT/summary.txt"
failed=0

step() {  # step NAME TIMEOUT_S COMMAND...: run it, log to OUT/NAME.log, record its exit status
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc, $((SECONDS - start)) s" | tee -a "$OUT/summary.txt"
  [ "$rc" -eq 0 ] || failed=1
}

"$PYTHON" - > "$OUT/device.txt" 2>&1 <<'PY' || { cat "$OUT/device.txt"; echo "torch sees no CUDA: nothing to check"; exit 1; }
import torch
assert torch.cuda.is_available(), "torch.cuda.is_available() is False"
print("torch", torch.__version__, "CUDA", torch.version.cuda, torch.cuda.get_device_name(0))
PY
cat "$OUT/device.txt"

step pytest_gpu 300 "$PYTHON" -m pytest -m gpu -q -rs -p no:cacheprovider tests --junitxml="$OUT/pytest_gpu.xml"
step bench_batch 180 "$PYTHON" scripts/bench_batch.py --device cuda --model "$MODEL" --context 256 \
  --new-tokens 16 --batch 8 --rounds 2 --out "$OUT"
step capacity_sweep 180 "$PYTHON" -m kvbench.run -m experiment=capacity "model=$MODEL" model.device=cuda \
  task.n=2 task.context_tokens=256 max_new_tokens=8 "capacity.memory_gib=$CAP_GIB" capacity.max_batch=64 \
  policy=full,window,h2o budget=0.25,0.5 "results_dir=$OUT" sweep_name=capacity
step capacity_report 120 "$PYTHON" -m kvbench.report.cli "$OUT/capacity" --out "$OUT/capacity/report"
exit $failed
