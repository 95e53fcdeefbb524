"""How an engine runs every request of a run (``EngineSettings``): read by the engine and by its batch loop."""

from __future__ import annotations

from dataclasses import dataclass

from kvbench.policies.policy import Policy
from kvbench.stages import Stage


@dataclass(frozen=True)
class EngineSettings:
    """How every request of a run goes through the model: ``policy`` holding ``budget`` (a fraction of the
    reference length, or tokens) in ``stage``; ``batch_size`` sequences decoded together; the prompt fed
    ``stride`` tokens at a time (None: at once). ``return_logits`` and ``trace`` add each step's logits and
    each forward's kept positions to the generations. ``fused`` runs the forward with fused, pre-transposed
    projections (None: wherever the model supports it, on CPU)."""

    policy: Policy
    budget: float | int = 1.0
    stage: Stage = Stage.prefill
    batch_size: int = 1
    stride: int | None = None
    return_logits: bool = False
    trace: bool = False
    fused: bool | None = None

    def __post_init__(self) -> None:
        if self.stage not in tuple(Stage):
            raise ValueError(f"unknown stage {self.stage!r}; choose one of {[s.value for s in Stage]}")
        object.__setattr__(self, "stage", Stage(self.stage))  # a plain string is accepted, kept as the enum
        if self.batch_size < 1:
            raise ValueError(f"batch_size {self.batch_size} must be >= 1")
        if self.stride is not None and self.stride < 1:
            raise ValueError(f"stride {self.stride} must be >= 1")
