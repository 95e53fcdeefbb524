"""Compress once, ask many: requests that give the same ``context_id`` share one prefill of their context.

The first of them to be admitted prefills (and, where the stage evicts in prefill, compresses) the context in a
cache of its own; each of them, that first one included, then starts from its own copy of that compressed context
and feeds its own suffix (its question), so no question sees another. The shared cache is dropped once the last
request of its context has copied it.

A shared prefill is exact only where every request of the context would have compressed it alike: the same
context ids, and, in a stage that evicts during the prompt, the same per-layer budgets (under ``stage=both`` an
allocation may cap a layer's budget at the sequence's whole length, context + suffix + new tokens, which differs
by question: pyramid's budgets near the prompt's length do).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from kvbench.engine.cache.cache import KVCache
from kvbench.engine.plan import LayerPlan
from kvbench.engine.sequence import Sequence


@dataclass
class Prefilled:
    """A context prefilled once: its cache (lane 0) and what each request starting from it inherits."""

    cache: KVCache
    logits: torch.Tensor  # the context's last position's logits [1, V] (the first token when a suffix is empty)
    position: int
    forwards: int
    kept_after_prefill: list[float]
    resident_peak: int
    kept_peak: float
    traces: list[list[torch.Tensor]] = field(default_factory=list)

    @classmethod
    def of(cls, cache: KVCache, seq: Sequence, logits: torch.Tensor) -> Prefilled:
        """The context just prefilled into ``cache`` through ``seq``."""
        return cls(
            cache,
            logits,
            seq.position,
            seq.forwards,
            list(seq.kept_after_prefill),
            seq.resident_peak,
            seq.kept_peak,
            list(seq.traces),
        )

    def start(self, seq: Sequence, cache: KVCache) -> torch.Tensor:
        """``seq`` continues in ``cache`` from its own copy of the context, under its own budgets; the context's
        last logits."""
        cache.copy_lane(self.cache, 0, 0)
        cache.assign(0, seq.plans)
        seq.position, seq.forwards = self.position, self.forwards
        seq.kept_after_prefill = list(self.kept_after_prefill)
        seq.resident_peak, seq.kept_peak = self.resident_peak, self.kept_peak
        seq.traces = list(self.traces)
        return self.logits


class SharedContexts:
    """Which requests share which context, the plans a context's cache must serve, and the prefilled contexts
    still to be copied."""

    def __init__(self) -> None:
        self.ids: dict[str, list[int]] = {}
        self.budgets: dict[str, list[int | None]] = {}
        self.plans: dict[str, list[list[LayerPlan]]] = {}
        self.waiting: Counter[str] = Counter()  # requests of each context not yet admitted
        self.ready: dict[str, Prefilled] = {}

    def join(self, key: str, input_ids: list[int], plans: list[LayerPlan], evicts_in_prefill: bool) -> None:
        """A request of context ``key``; ValueError when it cannot share that context's prefill."""
        budgets = [p.budget for p in plans]
        if key not in self.ids:
            self.ids[key], self.budgets[key], self.plans[key] = list(input_ids), budgets, []
        elif self.ids[key] != list(input_ids):
            raise ValueError(f"requests sharing context_id {key!r} give different context ids")
        elif evicts_in_prefill and self.budgets[key] != budgets:
            raise ValueError(
                f"requests sharing context_id {key!r} would compress the context to different layer budgets (under "
                "stage=both the allocation caps them at each sequence's length); use stage=prefill or a smaller budget"
            )
        self.plans[key].append(plans)
        self.waiting[key] += 1

    def take(self, key: str) -> Prefilled | None:
        """The prefilled context for one more request (None: not prefilled yet, the caller prefills and
        ``keep``s it); dropped once its last request has taken it."""
        self.waiting[key] -= 1
        found = self.ready.get(key)
        if found is not None and self.waiting[key] == 0:
            del self.ready[key]
        return found

    def keep(self, key: str, prefilled: Prefilled) -> None:
        if self.waiting[key] > 0:
            self.ready[key] = prefilled
