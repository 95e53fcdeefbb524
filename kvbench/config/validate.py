"""Turn a composed Hydra config into a validated ``RunSpec``.

Every check here runs before any model weights load, so a bad sweep cell fails in milliseconds with one
message that names the fix. Types, choices and ranges come from the schema (``read``); what is left here are
the rules that span several settings, and the ones that look outside the config (files, CUDA, credentials).
"""

from __future__ import annotations

import dataclasses
from enum import Enum
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from kvbench.budget import too_small
from kvbench.config.phases import named_policy, resolve_phases
from kvbench.config.read import read_run
from kvbench.config.schema import SamplingConfig, Source, Stage
from kvbench.config.spec import ConfigError, RunSpec
from kvbench.policies.policy import Policy
from kvbench.policies.registry import build_policy

if TYPE_CHECKING:
    from kvbench.tasks.base import Task


def stage_refusal(policy: str, stage: str) -> str:
    """How a refused stage is said: the report knows a refused cell's ``error.txt`` by it."""
    return f"policy={policy} cannot run in stage={stage}"


def validate(cfg: DictConfig | dict[str, Any]) -> RunSpec:
    """Check one cell's config; raise ``ConfigError`` naming the fix."""
    data = _plain_config(cfg)
    spec = _engine_spec(data)
    task_data = dict(data.get("task") or {})
    task = check_task(task_data, spec.model)
    if spec.batch_size > 1 and not task.protocol.batchable:
        raise ConfigError(
            f"task={task_data.get('name')} {task.protocol.alone}, so batch_size={spec.batch_size} would label one "
            "sequence's timings as a batch's; use batch_size=1"
        )
    if spec.n_samples > 1 and not task.protocol.samples:
        raise ConfigError(
            f"task={task_data.get('name')} teacher-forces its text instead of generating, so "
            f"sampling.n_samples={spec.n_samples} has nothing to sample; use sampling.n_samples=1"
        )
    question = question_problem(spec.policy, task)
    if question:
        raise ConfigError(
            f"policy={spec.policy.name} observes the prompt's question, and task={task_data.get('name')} {question}"
        )
    spec.task_cfg = task_data
    return spec


def question_problem(policy: Policy, task: Task) -> str | None:
    """Why ``task`` cannot give a question-observing policy (Finch) its question, or None: the question must be
    fed apart from the context (the suffix, ``question_aware=false``), one question per compressed context."""
    if not policy.question:
        return None
    if task.protocol.name == "shared_context":
        return "compresses one context for several questions; use task.ask=all"
    aware = getattr(task, "question_aware", None)  # the tasks that can feed their question apart have the option
    if task.protocol.name != "generate" or aware is None:
        return "gives no question apart from its context"
    if aware:
        return "compresses its question with the context; add task.question_aware=false"
    return None


def validate_engine(cfg: DictConfig | dict[str, Any]) -> RunSpec:
    """Check everything of a config but its task, for a harness that brings its own requests (lm-eval's): the
    model, policy, budget, stage, batch and sampling settings; the spec's ``task_cfg`` is empty."""
    spec = _engine_spec(_plain_config(cfg))
    if spec.policy.question:
        raise ConfigError(
            f"policy={spec.policy.name} observes the prompt's question, which a harness's own requests do not give "
            "apart from the context; run it on a kvbench task with task.question_aware=false"
        )
    return spec


DECODE_PHASE_POLICIES = ("h2o", "snapkv", "tova")  # what a refusal suggests for the decode phase, in order


def _decode_phase_hint(policy_cfg: dict[str, Any]) -> str | None:
    """How to pair a prompt-only policy with a decode policy, checked by building the pair (None: no named
    policy pairs with it). Both phases share one allocation: one that is not uniform (KVzip's global top-k) is
    named for the run, with the prompt policy as its prefill phase."""
    allocation = policy_cfg.get("allocation") or "uniform"
    spec = allocation if isinstance(allocation, dict) else {"kind": allocation}
    uniform = spec.get("kind", "uniform") == "uniform"
    literal = "{" + ",".join(f"{k}:{v}" for k, v in spec.items()) + "}"
    for decode in DECODE_PHASE_POLICIES:
        named = named_policy(decode)
        if uniform:
            pair, hint = {**policy_cfg, "decode": named}, f"policy.decode={decode}"
        else:
            pair = {**named, "allocation": allocation, "prefill": policy_cfg}
            hint = f"policy={decode} policy.prefill={policy_cfg.get('name')} 'policy.allocation={literal}'"
        try:
            build_policy(pair)
        except (ValueError, TypeError, KeyError):
            continue
        return hint
    return None


def _engine_spec(data: dict[str, Any]) -> RunSpec:
    """The spec of a plain config, every setting checked but the task's."""
    _check_pretrained_path(dict(data.get("model") or {}))
    run = read_run(data)
    _check_sampling(run.sampling)
    policy_cfg = resolve_phases(plain(run.policy), run.stage)
    try:
        policy = build_policy(policy_cfg)
    except (ValueError, TypeError, KeyError) as err:
        raise ConfigError(f"policy={run.policy.name}: {err}") from err
    _check_budget(run.budget, policy)
    unsupported = policy.unsupported_stages or ()
    if run.stage in unsupported:
        allowed = [s.value for s in Stage if s not in unsupported]
        hint = _decode_phase_hint(policy_cfg) if run.stage is Stage.both and "prefill" not in unsupported else None
        phases = f" (or keep stage=both and name a policy for the decode phase: {hint})" if hint else ""
        raise ConfigError(f"{stage_refusal(policy.name, run.stage)}; use stage in {allowed}{phases}")
    if run.stride is not None and policy.question:
        raise ConfigError(
            f"policy={policy.name} compresses the prompt once, observing the question at its end, so it needs the "
            f"prompt in one step; use stride=null (not stride={run.stride})"
        )
    if run.stride is not None and policy.whole_prompt:
        prefill = policy_cfg.get("prefill")
        who = f"policy.prefill={prefill['name']}" if isinstance(prefill, dict) else f"policy={policy.name}"
        reads = "every query of a second pass of the prompt" if policy.rereads else "every prompt query"
        raise ConfigError(
            f"{who} scores the prompt from {reads}, so it needs the prompt in one step; "
            f"use stride=null (not stride={run.stride})"
        )
    model = plain(run.model)
    check_model(model)
    tracking = plain(run.tracking)
    _check_tracking(tracking)
    return RunSpec(
        model=model,
        policy_cfg=policy_cfg,
        task_cfg={},
        policy=policy,
        budget=run.budget,
        stage=str(run.stage.value),
        stride=run.stride,
        seed=run.seed,
        max_new_tokens=run.max_new_tokens,
        sampling=plain(run.sampling),
        fidelity=run.fidelity,
        tracking=tracking,
        batch_size=run.batch_size,
        capacity=plain(run.capacity),
    )


def plain(instance: Any) -> dict[str, Any]:
    """A schema dataclass as a dict of plain values (enums as their strings), for code that takes dicts."""
    return _plain_value(dataclasses.asdict(instance))


def _plain_value(value: Any) -> Any:
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, dict):
        return {k: _plain_value(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain_value(v) for v in value]
    return value


def _plain_config(cfg: DictConfig | dict[str, Any]) -> dict[str, Any]:
    """The config as plain data, refusing unset (``???``) values and interpolations that do not resolve."""
    if not isinstance(cfg, DictConfig):
        return {k: v for k, v in dict(cfg).items() if k != "hydra"}
    missing = sorted(k for k in OmegaConf.missing_keys(cfg) if not k.startswith("hydra"))
    if missing:
        raise ConfigError(
            f"{', '.join(missing)} must be set (it is ??? in the config): add "
            f"{' '.join(m + '=...' for m in missing)} to the command line"
        )
    try:
        data: Any = OmegaConf.to_container(cfg, resolve=True)
    except Exception as err:  # a bad interpolation: name it rather than crash later
        raise ConfigError(f"the config does not resolve: {err}") from err
    data.pop("hydra", None)
    return dict(data)


def _check_sampling(sampling: SamplingConfig) -> None:
    if not sampling.do_sample:
        if sampling.n_samples > 1:
            raise ConfigError(
                f"sampling.n_samples={sampling.n_samples} needs sampling.do_sample=true: greedy decoding would draw "
                "the same text every time"
            )
        return
    if sampling.temperature <= 0:
        raise ConfigError(
            f"sampling.temperature={sampling.temperature:g} must be > 0 when sampling.do_sample=true "
            "(use sampling.do_sample=false for greedy decoding)"
        )
    if not 0.0 < sampling.top_p <= 1.0:
        raise ConfigError(f"sampling.top_p={sampling.top_p:g} must be in (0, 1]")


def _check_budget(budget: float | int, policy: Policy) -> None:
    """A token budget below what the policy always protects (a fraction is checked per example, in tokens)."""
    problem = too_small(budget, policy) if isinstance(budget, int) else None
    if problem:
        raise ConfigError(f"budget={problem}")


def _check_pretrained_path(model: dict[str, Any]) -> None:
    """Before typing: a pretrained model's name defaults to its path, so a missing path would be reported as a
    missing name."""
    if model.get("source") == Source.pretrained and not model.get("name_or_path"):
        raise ConfigError("model.source=pretrained needs model.name_or_path=<hub id or local directory>")


def check_model(model: dict[str, Any]) -> None:
    """Source, path and device, checked without touching weights (or CUDA beyond asking if it is there)."""
    from kvbench.embedded import embedded_package_error
    from kvbench.models import local_path_problem

    if model["source"] == Source.pretrained:
        problem = local_path_problem(model["name_or_path"])
        if problem:
            raise ConfigError(problem)
    device = str(model["device"])
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(f"model.device={device} but CUDA is not available here; use model.device=auto or cpu")
        index = device.partition(":")[2]
        if index and int(index) >= torch.cuda.device_count():
            raise ConfigError(f"model.device={device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    problem = embedded_package_error(model)
    if problem:
        raise ConfigError(problem)


def _check_tracking(tracking: dict[str, Any]) -> None:
    from kvbench.tracking import check_settings

    problem = check_settings(dict(tracking.get("wandb") or {}))
    if problem:
        raise ConfigError(problem)


def check_task(task_cfg: dict[str, Any], model: dict[str, Any] | None = None) -> Task:
    """Build the task (cheap: no model) so unknown names, missing files and unreadable prompts fail now."""
    from kvbench.tasks.registry import build_task

    try:
        task = build_task(task_cfg, model)
        task.validate()
    except (ValueError, FileNotFoundError, TypeError) as err:
        raise ConfigError(f"task={task_cfg.get('name')}: {err}") from err
    return task
