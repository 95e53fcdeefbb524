"""The Hydra entry point: one call of ``main`` runs one cell (model × policy × budget × stage × task)."""
from __future__ import annotations

import logging
import sys
import traceback
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from kvbench.config import ConfigError, RunSpec, validate
from kvbench.engine.generate import DecodeSettings, generate
from kvbench.models import LoadedModel, load_model, load_tokenizer
from kvbench.provenance import provenance
from kvbench.results import CellBusy, CellResults, summarize
from kvbench.tasks.base import Example, RenderedPrompt, Task
from kvbench.tasks.registry import build_task
from kvbench.tracking import Tracker, check_credentials

log = logging.getLogger("kvbench")
_MODELS: dict[tuple, LoadedModel] = {}


def cell_path(model: str, task: str, subset: Any, policy: str, stage: str, budget: Any) -> str:
    """A cell's directory below the sweep: stable, so a rerun finds what it already wrote.
    The full cache ignores the budget, so all its budgets share one cell."""
    task_id = f"{task}-{subset}" if subset not in (None, "None", "null", "") else task
    budget_id = "full" if policy == "full" else budget
    return f"{model}/{task_id}/{policy}/{stage}/budget={budget_id}"


OmegaConf.register_new_resolver("kvbench_cell", cell_path, replace=True)


def get_model(model_cfg: dict[str, Any]) -> LoadedModel:
    """Load once per process; the cells that follow reuse it."""
    key = tuple(sorted((k, str(v)) for k, v in model_cfg.items()))
    if key not in _MODELS:
        _MODELS.clear()
        options = {k: v for k, v in model_cfg.items() if k != "name"}
        loaded = load_model(model_cfg["name"], **options)
        _warm_up(loaded)
        _MODELS[key] = loaded
    return _MODELS[key]


def _warm_up(lm: LoadedModel) -> None:
    """One short generation so the first timed example pays no one-off start-up costs."""
    from kvbench.policies.registry import build_policy

    ids = list(range(10, 42))
    generate(lm.model, lm.tokenizer, ids, build_policy({"name": "full"}), 1.0, "prefill",
             DecodeSettings(max_new_tokens=4))


def render_all(task: Task, examples: list[Example], spec: RunSpec) -> dict[str, RenderedPrompt]:
    """Render every prompt with the tokenizer alone and refuse contexts the model cannot hold."""
    tokenizer, limit = load_tokenizer(**spec.model)
    rendered = {}
    for ex in examples:
        prompt = task.render(ex, tokenizer)
        new_tokens = spec.max_new_tokens or task.generation(ex).max_new_tokens
        total = len(prompt.input_ids) + len(prompt.suffix_ids) + new_tokens
        if limit and total > limit:
            raise ConfigError(
                f"example {ex.id}: {total} tokens (prompt + max_new_tokens) exceed the model's limit of {limit}; "
                "lower the task's context length or set task.max_prompt_tokens to truncate"
            )
        rendered[ex.id] = prompt
    return rendered


def run_example(lm: LoadedModel, task: Task, spec: RunSpec, ex: Example, prompt: RenderedPrompt) -> dict[str, Any]:
    settings = task.generation(ex)
    decode = spec.decode_settings(settings.max_new_tokens, settings.stop_strings)
    g = generate(lm.model, lm.tokenizer, prompt.input_ids, spec.policy, spec.budget, spec.stage, decode,
                 suffix_ids=prompt.suffix_ids, stride=spec.stride)
    prediction = task.postprocess(g.text, ex)
    metrics = task.score(prediction, ex)
    return {
        "status": "ok",
        "primary_metric": task.primary_metric,
        "score": metrics.get(task.primary_metric),
        **{f"metric.{k}": v for k, v in metrics.items()},
        "budget_tokens": g.budget_tokens,
        "budget_achieved": g.budget_achieved,
        "budget_achieved_per_layer": g.budget_achieved_per_layer,
        "kept_tokens": g.kept_tokens,
        "seen_tokens": g.seen_tokens,
        "kv_resident_bytes": g.kv_resident_bytes,
        "kv_resident_peak_bytes": g.kv_resident_peak_bytes,
        "kv_capacity_bytes": g.kv_capacity_bytes,
        "peak_memory_prefill_bytes": g.peak_memory_prefill_bytes,
        "peak_memory_bytes": g.peak_memory_bytes,
        "peak_memory_kind": g.peak_memory_kind,
        **g.timings(),
        "prompt_tokens": g.prompt_tokens,
        "new_tokens": len(g.tokens),
        "truncated": prompt.truncated,
        "stop_reason": g.stop_reason,
        "prediction": prediction,
        "references": ex.references,
    }


def run_cell(cfg: DictConfig, cell_dir: Path, sweep: str) -> dict[str, Any]:
    """Validate, then run every example not already in ``rows.jsonl``; errors become rows."""
    spec = validate(cfg)
    problem = check_credentials(spec.tracking.get("wandb", {}).get("mode", "disabled"))
    if problem:
        raise ConfigError(problem)
    task = build_task(spec.task_cfg)
    identity = {"model": spec.model["name"], "task": spec.task_id, "policy": spec.policy.name,
                "budget": 1.0 if not spec.policy.evicts else spec.budget, "stage": spec.stage,
                "run_dir": str(cell_dir), "sweep": sweep}
    with CellResults(cell_dir) as results:
        if results.is_complete():
            log.info("cell %s is complete; skipping", cell_dir)
            return summarize(results.rows(), len(results.rows()))
        examples = task.examples()
        results.write_config(OmegaConf.to_yaml({k: v for k, v in cfg.items() if k != "hydra"}, resolve=True))
        done = results.finished_ids()
        todo = [ex for ex in examples if ex.id not in done]
        if todo:
            rendered = render_all(task, todo, spec)
            lm = get_model(spec.model)
            origin = provenance(lm.device, lm.dtype)
            tracker = Tracker(spec.tracking.get("wandb", {}), cell_path_name(identity), cell_dir,
                              OmegaConf.to_container(cfg, resolve=True), sweep)
            for ex in tqdm(todo, desc=f"{spec.policy.name} {spec.stage} budget={spec.budget}", leave=False):
                row = {**identity, "example_id": ex.id}
                try:
                    row.update(run_example(lm, task, spec, ex, rendered[ex.id]))
                except Exception as err:  # one failing example must not end the sweep
                    if isinstance(err, torch.cuda.OutOfMemoryError):
                        torch.cuda.empty_cache()
                    row.update(status="error", error=f"{type(err).__name__}: {err}",
                               traceback=traceback.format_exc(limit=4))
                    log.warning("example %s failed: %s", ex.id, row["error"])
                row.update(origin)
                results.append(row)
                tracker.log_example(row)
        else:
            tracker = None
        summary = {**identity, **summarize(results.rows(), len(examples))}
        results.write_summary(summary)
        if tracker is not None:
            tracker.finish(summary)
    return summary


def cell_path_name(identity: dict[str, Any]) -> str:
    return f"{identity['model']}|{identity['task']}|{identity['policy']}|{identity['stage']}|{identity['budget']}"


CONFIG_DIR = str(Path(__file__).resolve().parent.parent / "configs")


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")
def main(cfg: DictConfig) -> None:
    hc = HydraConfig.get()
    cell_dir = Path(hc.runtime.output_dir)
    multirun = hc.mode == RunMode.MULTIRUN
    try:
        summary = run_cell(cfg, cell_dir, str(cfg.sweep_name))
        log.info("done: %s", {k: v for k, v in summary.items() if not k.startswith("mean.") or "score" in k})
    except (ConfigError, CellBusy) as err:
        message = f"kvbench: {err}"
        print(message, file=sys.stderr)
        if not multirun:
            sys.exit(2)
        (cell_dir / "error.txt").write_text(message + "\n")
    except Exception:
        if not multirun:
            raise
        log.error("cell %s failed:\n%s", cell_dir, traceback.format_exc())
        (cell_dir / "error.txt").write_text(traceback.format_exc())


if __name__ == "__main__":
    main()
