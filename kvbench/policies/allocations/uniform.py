"""The uniform split (the base ``Allocation``), under its name."""

from __future__ import annotations

from kvbench.policies.base import Allocation
from kvbench.policies.parts import register_allocation


@register_allocation("uniform")
class Uniform(Allocation):
    """Every layer and every head keeps ``budget`` tokens."""
