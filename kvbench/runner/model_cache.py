"""One loaded model per process: the cells of a sweep that share a model reuse it."""

from __future__ import annotations

import gc
from typing import Any

import torch

from kvbench.engine.engine import DecodeSettings, Engine, EngineSettings, Request
from kvbench.models import LoadedModel, load_model
from kvbench.policies.full import never_evicting

_MODELS: dict[tuple, LoadedModel] = {}


def get_model(model_cfg: dict[str, Any]) -> LoadedModel:
    """Load once per process; the cells that follow reuse it. A sweep that moves on to another model frees the
    last one first."""
    key = tuple(sorted((k, str(v)) for k, v in model_cfg.items()))
    if key not in _MODELS:
        if _MODELS:
            _MODELS.clear()
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        options = {k: v for k, v in model_cfg.items() if k != "name"}
        loaded = load_model(model_cfg["name"], **options)
        warm_up(loaded)
        _MODELS[key] = loaded
    return _MODELS[key]


def warm_up(lm: LoadedModel) -> None:
    """One short generation so the first timed example pays no one-off start-up costs."""
    request = Request(list(range(10, 42)), settings=DecodeSettings(max_new_tokens=4))
    Engine(lm.model, lm.tokenizer, EngineSettings(never_evicting())).run([request])
