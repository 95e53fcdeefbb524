#!/usr/bin/env bash
# The test command: set up .venv if needed, then lint and format check (ruff), types (mypy) and the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check kvbench tests scripts
.venv/bin/ruff format --check kvbench tests scripts
.venv/bin/mypy
.venv/bin/pytest -q "$@"
