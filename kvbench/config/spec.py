"""What a validated cell is: ``RunSpec``, read by the runner and the engine (plain values, no enums)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvbench.engine.sampling import DecodeSettings
from kvbench.policies.policy import Policy


class ConfigError(ValueError):
    """A config that cannot run; the message says what to change."""


@dataclass
class RunSpec:
    model: dict[str, Any]
    policy_cfg: dict[str, Any]
    task_cfg: dict[str, Any]
    policy: Policy
    budget: float | int
    stage: str
    stride: int | None
    seed: int
    max_new_tokens: int | None
    sampling: dict[str, Any]
    fidelity: bool
    tracking: dict[str, Any] = field(default_factory=dict)
    batch_size: int = 1
    capacity: dict[str, Any] = field(default_factory=dict)

    @property
    def task_id(self) -> str:
        subset = self.task_cfg.get("subset")
        return f"{self.task_cfg['name']}/{subset}" if subset else self.task_cfg["name"]

    @property
    def n_samples(self) -> int:
        return int(self.sampling.get("n_samples", 1))

    def decode_settings(self, task_max_new_tokens: int, stop_strings: list[str], sample: int = 0) -> DecodeSettings:
        """The decoder's settings; sample ``j`` of a prompt is seeded ``seed + j`` (sample 0: the run's seed)."""
        return DecodeSettings(
            max_new_tokens=self.max_new_tokens or task_max_new_tokens,
            do_sample=bool(self.sampling.get("do_sample", False)),
            temperature=float(self.sampling.get("temperature", 1.0)),
            top_p=float(self.sampling.get("top_p", 1.0)),
            seed=self.seed + sample,
            stop_strings=list(stop_strings),
        )
