"""Helpers for lm-eval runs of kvbench's model and of lm-eval's own ``hf`` model, offline: RULER tasks that need only a
tokenizer, and the fact tasks over a local JSONL file (tests/fixtures/lm_eval)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
pytest.importorskip("lm_eval")

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "lm_eval"
SEQ_LENGTH = 512  # RULER's prompts, in tokens: short, so that a run takes seconds


def kvbench_lm(**model_args: Any) -> Any:
    """kvbench's lm-eval model on the embedded SmolLM2 in float32, with ``model_args`` as kvbench settings."""
    from kvbench.lm_eval.model import KvbenchLM

    return KvbenchLM.create_from_arg_obj({"model": "smollm2-135m", "model.dtype": "float32", **model_args})


def evaluate(lm: Any, tasks: list[str], task_manager: Any, limit: int) -> dict[str, Any]:
    """lm-eval's results, per-sample log included."""
    from lm_eval import simple_evaluate

    return simple_evaluate(
        model=lm, tasks=tasks, task_manager=task_manager, limit=limit, log_samples=True, bootstrap_iters=0
    )


def samples(results: dict[str, Any], task: str) -> list[dict[str, Any]]:
    return sorted(results["samples"][task], key=lambda s: s["doc_id"])


def measures(sample: dict[str, Any]) -> list[dict[str, Any]]:
    """kvbench's measures of a sample's first request, one per repeat."""
    return sample["arguments"][0][-1]["kvbench"]
