"""Per-row running quantities: what a score reads of a whole row, kept up to date by the cache.

A score that needs, at every eviction, a sum over every entry a row holds (KeyDiff's mean normalised key)
declares it as a ``RowSum``: a vector per entry, computed from its key and value as stored. The cache adds an
entry's vector when the entry is written and subtracts it when the entry leaves (evicted, trimmed, or rewritten
by a merge), so the score reads the row's sum (``TokenState.row_sums[name]``, [H, F]) instead of summing every
held entry again. The sums are kept in float64: thousands of additions and subtractions round no further than
one float32 sum of the held entries would.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RowSum:
    """``of(keys, values)``: the vector of each entry, keys/values [r, m, D] as stored -> [r, m, F]."""

    name: str
    of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
