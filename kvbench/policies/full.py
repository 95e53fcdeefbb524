"""The policy that never evicts: the full cache (stored as the run stores entries, quantised or re-indexed)."""

from __future__ import annotations

from typing import Any

from kvbench.policies.policy import Policy
from kvbench.policies.scopes.everything import All
from kvbench.policies.scores.recency import Recency


def never_evicting(name: str = "full", quantize: Any = None, positions: str = "absolute", **options: Any) -> Policy:
    """A policy that holds every entry; ``options``: any other ``Policy`` field (``sliding_layers``)."""
    return Policy(
        name=name,
        score=Recency(),
        scope=All(),
        evicts=False,
        quantize=quantize,
        positions=positions,
        **options,
    )
