"""The engine's entry points: one prompt (``generate``, or ``generation`` to pause between steps) or many at once
(``generate_batch``), through prefill and decode with a policy holding a budget; see ``engine.batch``.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import torch

from kvbench.engine.batch import STAGES, BatchRun
from kvbench.engine.sampling import DecodeSettings
from kvbench.engine.sequence import Generation, Request, reference_length, resolve_budget
from kvbench.policies.base import Policy

__all__ = [
    "STAGES",
    "DecodeSettings",
    "Generation",
    "Request",
    "generate",
    "generate_batch",
    "generation",
    "reference_length",
    "resolve_budget",
]


def generate(*args: Any, **kwargs: Any) -> Generation:
    """Run one prompt through prefill and decode: ``generation``'s steps, to the end."""
    steps = generation(*args, **kwargs)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def generation(
    model: Any,
    tokenizer: Any,
    input_ids: list[int],
    policy: Policy,
    budget: float | int,
    stage: str = "prefill",
    settings: DecodeSettings | None = None,
    suffix_ids: list[int] | None = None,
    stride: int | None = None,
    return_logits: bool = False,
    trace: bool = False,
    forced_tokens: list[int] | None = None,
    replay_trace: list[list[torch.Tensor]] | None = None,
    fused: bool | None = None,
) -> Generator[None, None, Generation]:
    """Run one prompt through prefill and decode with ``policy`` holding ``budget`` in ``stage``, pausing
    (``yield``) once the prompt is in and after every decode step; the ``Generation`` is the return value.
    Pausing lets a benchmark interleave the decode steps of several runs, so that a slow spell of a shared
    machine lands on all of them alike (the device's peak-memory counters are then shared by those runs).
    See ``Request`` for ``suffix_ids``, ``forced_tokens`` and ``replay_trace``; ``fused`` runs the forward
    with fused, pre-transposed projections (``None``: wherever the model supports it)."""
    request = Request(
        list(input_ids), list(suffix_ids or []), settings or DecodeSettings(), forced_tokens, replay_trace
    )
    run = BatchRun(model, tokenizer, [request], policy, budget, stage, 1, stride, return_logits, trace, fused)
    while run.step():
        yield
    return run.results()[0]


def generate_batch(
    model: Any,
    tokenizer: Any,
    requests: list[Request],
    policy: Policy,
    budget: float | int,
    stage: str = "prefill",
    batch_size: int = 1,
    stride: int | None = None,
    return_logits: bool = False,
    trace: bool = False,
    fused: bool | None = None,
) -> list[Generation]:
    """Every request's ``Generation``, in request order, decoded ``batch_size`` at a time."""
    return BatchRun(
        model, tokenizer, requests, policy, budget, stage, batch_size, stride, return_logits, trace, fused
    ).run()
