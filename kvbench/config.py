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
    batch_size: int = 1
    capacity: dict[str, Any] = field(default_factory=dict)

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


DTYPES = ("auto", "float32", "float16", "bfloat16")


def validate(cfg: DictConfig | dict[str, Any]) -> RunSpec:
    """Check one cell's config; raise ``ConfigError`` naming the fix."""
    if isinstance(cfg, DictConfig):
        missing = sorted(k for k in OmegaConf.missing_keys(cfg) if not k.startswith("hydra"))
        if missing:
            raise ConfigError(
                f"{', '.join(missing)} must be set (it is ??? in the config): add "
                f"{' '.join(m + '=...' for m in missing)} to the command line"
            )
        try:
            data = OmegaConf.to_container(cfg, resolve=True)
        except Exception as err:  # a bad interpolation: name it rather than crash later
            raise ConfigError(f"the config does not resolve: {err}") from err
    else:
        data = dict(cfg)
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
    batch_size = data.get("batch_size", 1)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch_size={batch_size!r} must be a positive integer (sequences decoded together)")
    capacity = dict(data.get("capacity") or {})
    cap, most = capacity.get("memory_gib"), capacity.get("max_batch", 1024)
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or cap <= 0):
        raise ConfigError(f"capacity.memory_gib={cap!r} must be a positive number of GiB (or null: no capacity search)")
    if isinstance(most, bool) or not isinstance(most, int) or most < 1:
        raise ConfigError(f"capacity.max_batch={most!r} must be a positive integer")
    seed = data.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"seed={seed!r} must be an integer")
    sampling = _check_sampling(dict(data.get("sampling") or {}))
    try:
        policy = build_policy(data["policy"])
    except (ValueError, TypeError, KeyError) as err:
        raise ConfigError(f"policy={data['policy'].get('name')}: {err}") from err
    if policy.evicts and isinstance(budget, int) and budget < policy.scope.min_budget():
        raise ConfigError(
            f"budget={budget} tokens is below the {policy.scope.min_budget()} tokens policy {policy.name!r} "
            "always protects; raise the budget or lower policy.scope.n_sink / window"
        )
    unsupported = getattr(policy, "unsupported_stages", ())
    if stage in unsupported:
        raise ConfigError(
            f"policy={policy.name} cannot run in stage={stage}; use stage in "
            f"{[s for s in STAGES if s not in unsupported]}"
        )
    model = _check_model(dict(data["model"]))
    from kvbench.embedded import embedded_package_error

    problem = embedded_package_error(model)
    if problem:
        raise ConfigError(problem)
    _check_task(data["task"])
    tracking = dict(data.get("tracking") or {})
    _check_tracking(tracking)
    return RunSpec(
        model=model,
        policy_cfg=dict(data["policy"]),
        task_cfg=dict(data["task"]),
        policy=policy,
        budget=budget,
        stage=stage,
        stride=stride,
        seed=int(seed),
        max_new_tokens=max_new,
        sampling=sampling,
        fidelity=bool(data.get("fidelity", False)),
        tracking=tracking,
        batch_size=batch_size,
        capacity=capacity,
    )


def _check_sampling(sampling: dict[str, Any]) -> dict[str, Any]:
    do_sample = sampling.get("do_sample", False)
    if not isinstance(do_sample, bool):
        raise ConfigError(f"sampling.do_sample={do_sample!r} must be true or false")
    for key, default in (("temperature", 1.0), ("top_p", 1.0)):
        value = sampling.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"sampling.{key}={value!r} must be a number")
    if do_sample:
        if float(sampling.get("temperature", 1.0)) <= 0:
            raise ConfigError(
                f"sampling.temperature={sampling.get('temperature')} must be > 0 when "
                "sampling.do_sample=true (use sampling.do_sample=false for greedy decoding)"
            )
        if not 0.0 < float(sampling.get("top_p", 1.0)) <= 1.0:
            raise ConfigError(f"sampling.top_p={sampling.get('top_p')} must be in (0, 1]")
    return sampling


def _check_model(model: dict[str, Any]) -> dict[str, Any]:
    """Source, dtype and device, checked without touching weights (or CUDA beyond asking if it is there)."""
    source = model.get("source")
    if source not in ("embedded", "pretrained", "tiny"):
        raise ConfigError(f"model.source={source!r} is unknown; choose embedded, pretrained or tiny")
    if source == "pretrained" and not model.get("name_or_path"):
        raise ConfigError("model.source=pretrained needs model.name_or_path=<hub id or local directory>")
    dtype = model.get("dtype", "auto")
    if dtype not in DTYPES:
        raise ConfigError(f"model.dtype={dtype!r} is unknown; choose one of {', '.join(DTYPES)}")
    device = str(model.get("device", "auto"))
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(f"model.device={device} but CUDA is not available here; use model.device=auto or cpu")
        index = device.partition(":")[2]
        if index and (not index.isdigit() or int(index) >= torch.cuda.device_count()):
            raise ConfigError(f"model.device={device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif device not in ("auto", "cpu", "mps"):
        raise ConfigError(f"model.device={device!r} is unknown; choose auto, cpu, cuda, cuda:N or mps")
    return model


def _check_tracking(tracking: dict[str, Any]) -> None:
    from kvbench.tracking import check_settings

    problem = check_settings(dict(tracking.get("wandb") or {}))
    if problem:
        raise ConfigError(problem)


def _check_task(task_cfg: dict[str, Any]) -> None:
    """Build the task (cheap: no data is read) so unknown names and missing files fail now."""
    from kvbench.tasks.registry import build_task

    try:
        task = build_task(task_cfg)
        task.validate()
    except (ValueError, FileNotFoundError, TypeError) as err:
        raise ConfigError(f"task={task_cfg.get('name')}: {err}") from err
