"""The engine as the tests call it: one prompt (``generate``) or a list of requests (``generate_batch``) under one
policy and budget, each through a fresh ``Engine``."""

from __future__ import annotations

from typing import Any

from kvbench.engine.engine import DecodeSettings, Engine, EngineSettings, Generation, Request


def generate(
    model: Any,
    tokenizer: Any,
    input_ids: list[int],
    policy: Any,
    budget: float | int,
    stage: str = "prefill",
    settings: DecodeSettings | None = None,
    suffix_ids: list[int] | None = None,
    stride: int | None = None,
    *,
    forced_tokens: list[int] | None = None,
    replay_trace: list | None = None,
    **options: Any,
) -> Generation:
    """One prompt's generation; ``options``: the other ``EngineSettings`` (return_logits, trace, fused)."""
    request = Request(
        list(input_ids), list(suffix_ids or []), settings or DecodeSettings(), forced_tokens, replay_trace
    )
    return Engine(model, tokenizer, EngineSettings(policy, budget, stage, stride=stride, **options)).run([request])[0]


def generate_batch(
    model: Any,
    tokenizer: Any,
    requests: list[Request],
    policy: Any,
    budget: float | int,
    stage: str = "prefill",
    batch_size: int = 1,
    stride: int | None = None,
    **options: Any,
) -> list[Generation]:
    """Every request's generation, ``batch_size`` decoded together."""
    settings = EngineSettings(policy, budget, stage, batch_size, stride, **options)
    return Engine(model, tokenizer, settings).run(requests)
