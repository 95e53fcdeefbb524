"""The capacity question: what the memory a policy saves buys. Under a memory cap, the largest batch a policy ×
budget fits, found by real runs (doubling, then bisection), and the decode tokens/s it serves at each batch.

A probe runs ``batch`` sequences to the end, decoded together, and measures its peak memory: on CUDA the
device's (``max_memory_allocated``: weights, KV cache and working memory; an out-of-memory error is a probe
that does not fit), on CPU the process's resident set above the level before the run (KV cache plus the run's
working memory; the weights were loaded before). Decode tokens/s is the batch's: sequences per step over the
median step time while the batch was full.
"""

from __future__ import annotations

import gc
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from kvbench.engine.engine import Engine, EngineSettings, Request
from kvbench.engine.measure import PeakMemory
from kvbench.policies.policy import Policy
from kvbench.stages import Stage

GIB = 1 << 30


@dataclass
class Probe:
    batch: int
    fits: bool
    peak_memory_bytes: int
    memory_kind: str
    decode_tokens_per_s: float | None
    decode_step_ms: float | None
    kv_resident_bytes: int | None
    error: str | None = None

    def row(self) -> dict[str, Any]:
        return asdict(self)


def probe(
    model: Any,
    requests: list[Request],
    policy: Policy,
    budget: float | int,
    stage: str,
    batch: int,
    cap_bytes: int,
    stride: int | None = None,
) -> Probe:
    """``batch`` sequences (the requests, cycled) decoded together under ``policy``; whether the run stayed
    within ``cap_bytes``."""
    device = next(model.parameters()).device
    chosen = [requests[i % len(requests)] for i in range(batch)]
    error, generations = None, []
    engine = Engine(
        model, None, EngineSettings(policy, budget, Stage(stage), batch, stride)
    )  # packs weights: not counted
    with PeakMemory(device) as memory:
        try:
            generations = engine.run(chosen)
        except torch.cuda.OutOfMemoryError as err:
            error = f"OutOfMemoryError: {err}"
    del engine
    peak = memory.peak + (memory.base if device.type == "cuda" else 0)  # CUDA: all device memory in use
    if error is not None:
        if device.type == "cuda":  # the failed run's blocks go back to the device before the next probe
            gc.collect()
            torch.cuda.empty_cache()
        return Probe(batch, False, peak, memory.kind, None, None, None, error)
    full_steps = [
        dt for g in generations[:1] for dt, n in zip(g.decode_latencies_s, g.decode_batch_sizes) if n == batch
    ]
    step = statistics.median(full_steps) if full_steps else None
    resident = sum(g.measures.kv_resident_peak_bytes for g in generations)
    return Probe(
        batch,
        peak <= cap_bytes,
        peak,
        memory.kind,
        batch / step if step else None,
        step * 1e3 if step else None,
        resident,
    )


def largest_batch(fits: Callable[[int], Probe], limit: int = 1024) -> tuple[int, list[Probe]]:
    """The largest batch whose probe fits: 1, 2, 4, … until one does not, then bisection between the last that
    fit and the first that did not. Returns it (0 if not even one fits) and every probe, in the order run."""
    probes: list[Probe] = []

    def run(b: int) -> bool:
        probes.append(fits(b))
        return probes[-1].fits

    if not run(1):
        return 0, probes
    good, bad = 1, None
    while bad is None and good < limit:
        b = min(2 * good, limit)
        if run(b):
            good = b
        else:
            bad = b
    if bad is None:
        return good, probes
    while bad - good > 1:
        mid = (good + bad) // 2
        if run(mid):
            good = mid
        else:
            bad = mid
    return good, probes


def capacity_rows(
    model: Any,
    requests: list[Request],
    policy: Policy,
    budget: float | int,
    stage: str,
    memory_gib: float,
    max_batch: int,
    stride: int | None,
    done: dict[int, dict[str, Any]],
) -> tuple[int, list[dict[str, Any]]]:
    """One cell of ``experiment=capacity``: the largest batch under ``memory_gib`` and a row per probe (batch
    size, whether it fit, peak memory, the batch's decode tokens/s). Probes already in ``done`` (a resumed
    cell's rows, by batch size) are not run again."""
    cap = int(memory_gib * GIB)
    new: list[dict[str, Any]] = []

    def fits(batch: int) -> Probe:
        if batch in done:
            return Probe(**{k: done[batch][k] for k in Probe.__dataclass_fields__})
        found = probe(model, requests, policy, budget, stage, batch, cap, stride)
        new.append(found.row())
        return found

    best, _ = largest_batch(fits, max_batch)
    return best, new
