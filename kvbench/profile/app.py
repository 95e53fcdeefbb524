"""``kvbench-profile``: the attention profile of a model on a task's prompts, and the oracle consistency of every
score and policy, e.g. ``kvbench-profile model=smollm2-135m task=xsum task.n=20``; with ``mode=retrieval_heads``,
the retrieval-head scores ``allocation=headkv`` reads (``kvbench.profile.retrieval_heads``).

Per example: the task's prompt (its context, what a ``stage=prefill`` policy compresses), a greedy continuation
from the full cache (the task's suffix, then up to ``max_new_tokens`` generated tokens), and one profiled forward
over both (``collect.record``). Writes ``profile.json``, CSVs, figures and ``profile.md`` to ``output_dir``.
"""

from __future__ import annotations

import functools
import logging
import sys
import time
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from kvbench.budget import BudgetError, parse_budget
from kvbench.config import ConfigError
from kvbench.config.read import typed
from kvbench.config.schema import ModelConfig, PolicyConfig
from kvbench.config.validate import check_model, check_task, plain
from kvbench.engine.engine import DecodeSettings, Engine, EngineSettings, Request
from kvbench.families import layer_windows, policy_problem
from kvbench.models import load_config, load_model, load_tokenizer
from kvbench.policies.full import never_evicting
from kvbench.policies.parts import SCORES
from kvbench.policies.policy import Policy
from kvbench.policies.registry import build_policy
from kvbench.profile import retrieval_heads
from kvbench.profile.collect import record
from kvbench.profile.consistency import bare_scores, layer_budgets, measurable_scores, unmeasurable
from kvbench.profile.summary import Profile, candidate_kinds, layer_result, write_profile
from kvbench.tasks.registry import build_task

log = logging.getLogger("kvbench.profile")
CONFIG_DIR = str(Path(__file__).resolve().parents[2] / "configs")
MODES = ("consistency", "retrieval_heads")


def check(
    cfg: dict[str, Any],
) -> tuple[dict[str, Any], dict[str, Policy], dict[str, Policy], list[float | int]]:
    """Everything that can be refused before a model loads: model and task settings, budgets, scores, policies.
    Returns the model's settings with the schema's defaults filled in, and what the profile measures."""
    model = plain(typed(ModelConfig, dict(cfg["model"])))
    check_model(model)
    check_task(dict(cfg["task"]))
    try:
        budgets = [parse_budget(b) for b in cfg.get("budgets") or []]
    except BudgetError as err:
        raise ConfigError(f"budgets: {err}") from err
    if not budgets:
        raise ConfigError("budgets must list at least one budget, e.g. budgets=[0.1,0.25,0.5]")
    kinds = measurable_scores() if cfg.get("scores") == "all" else list(cfg.get("scores") or [])
    unknown = sorted(set(kinds) - set(SCORES.names()))
    if unknown:
        raise ConfigError(f"scores: unknown {unknown}; give all or a list of {SCORES.choices()}")
    scores = bare_scores(kinds)
    for kind, policy in scores.items():
        why = unmeasurable(policy)
        if why:
            raise ConfigError(f"scores: {kind} cannot be profiled: {why}")
    max_new = cfg.get("max_new_tokens")
    if max_new is not None and (not isinstance(max_new, int) or max_new < 1):
        raise ConfigError(f"max_new_tokens={max_new!r} must be a positive integer or null (the task's own)")
    policies = {}
    model_config = load_config(
        **{k: v for k, v in model.items() if k in ("source", "name_or_path", "cache_dir", "embedded")}
    )
    for name, spec in (cfg.get("policies") or {}).items():
        try:
            policy = build_policy(plain(typed(PolicyConfig, dict(spec))))
        except ValueError as err:
            raise ConfigError(f"policies.{name}: {err}") from err
        if not policy.evicts:
            raise ConfigError(f"policies.{name} keeps the full cache: nothing to measure; drop it")
        problem = policy_problem(model_config, policy)
        if problem:
            raise ConfigError(f"policies.{name} on model={cfg['model']['name']}: {problem}")
        policies[name] = policy
    return model, scores, policies, budgets


def continuation(model: Any, context: list[int], suffix: list[int], max_new: int) -> list[int]:
    """The task's suffix, then the full cache's greedy continuation (stopping at end of sequence)."""
    request = Request(context + suffix, settings=DecodeSettings(max_new_tokens=max_new))
    (generation,) = Engine(model, None, EngineSettings(never_evicting())).run([request])
    return suffix + generation.tokens


def profile_task(cfg: dict[str, Any]) -> dict[str, Any]:
    model_cfg, scores, policies, budgets = check(cfg)
    task = build_task(dict(cfg["task"]))
    examples = task.examples()
    lm = load_model(model_cfg.pop("name"), **model_cfg)
    candidates = {f"score/{k}": v for k, v in scores.items()} | {f"policy/{k}": v for k, v in policies.items()}
    windows = layer_windows(lm.model.config)
    profile = Profile(
        lm.name,
        str(cfg["task"]["name"]),
        windows,
        budgets,
        candidate_kinds(candidates),
        int(cfg["n_sink"]),
        int(cfg["n_recent"]),
    )
    history = max([p.history for p in candidates.values()] + [1])
    for i, example in enumerate(examples):
        start = time.perf_counter()
        prompt = task.render(example, lm.tokenizer)
        max_new = cfg.get("max_new_tokens") or task.generation(example).max_new_tokens
        context = list(prompt.input_ids)
        rest = continuation(lm.model, context, list(prompt.suffix_ids), max_new)
        split = layer_budgets(candidates, budgets, len(context), windows)
        results = record(
            lm.model,
            context,
            rest,
            functools.partial(layer_result, candidates=candidates, budgets=split, seed=int(cfg["seed"])),
            history=history,
            max_age=int(cfg["max_age"]),
            n_sink=int(cfg["n_sink"]),
            n_recent=int(cfg["n_recent"]),
        )
        profile.add(results, len(context), len(rest))  # type: ignore[arg-type]
        log.info(
            "example %d/%d (%s): %d + %d tokens in %.1f s",
            i + 1,
            len(examples),
            example.id,
            len(context),
            len(rest),
            time.perf_counter() - start,
        )
    return profile.to_dict()


def check_mode(mode: Any) -> None:
    """Refuse a mode the profiler does not have, before anything loads."""
    if mode not in MODES:
        raise ConfigError(f"mode={mode!r} must be one of {MODES}")


def profile_heads(cfg: dict[str, Any], out: Path) -> Path:
    """``mode=retrieval_heads``: the retrieval-head scores on the task's examples, saved in ``out``."""
    model_cfg = plain(typed(ModelConfig, dict(cfg["model"])))
    check_model(model_cfg)
    check_task(dict(cfg["task"]))
    task = build_task(dict(cfg["task"]))
    tokenizer, _ = load_tokenizer(**model_cfg)
    try:
        examples = retrieval_heads.needles(task, tokenizer)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    lm = load_model(model_cfg.pop("name"), **model_cfg)
    scores = retrieval_heads.measure(lm.model, examples)
    return retrieval_heads.write(scores, lm.name, str(cfg["task"]["name"]), len(examples), out)


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="profile")
def main(cfg: DictConfig) -> None:
    """Profile one model on one task; a config that cannot run exits with status 2 and one message."""
    from kvbench.report.profile import build_profile_report

    logging.getLogger("fontTools").setLevel(logging.WARNING)  # the PDF backend logs every font it subsets

    data: dict[str, Any] = OmegaConf.to_container(cfg, resolve=True)  # type: ignore[assignment]
    out = Path(str(cfg.output_dir))
    mode = data.get("mode")
    try:
        check_mode(mode)
        if mode == "retrieval_heads":
            log.info("retrieval-head scores written to %s", profile_heads(data, out))
            return
        profile = profile_task(data)
    except ConfigError as err:
        print(f"kvbench-profile: {err}", file=sys.stderr)
        sys.exit(2)
    write_profile(profile, out)
    build_profile_report(out)
    log.info("profile written to %s", out)


if __name__ == "__main__":
    main()
