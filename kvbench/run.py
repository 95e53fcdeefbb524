"""The Hydra entry point: one call of ``main`` runs one cell (model × policy × budget × stage × task)."""

from __future__ import annotations

import gc
import json
import logging
import os
import sys
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from kvbench.capacity import capacity_rows
from kvbench.config import ConfigError, RunSpec, validate
from kvbench.engine.batch import BatchRun
from kvbench.engine.generate import DecodeSettings, Generation, Request, generate, reference_length, resolve_budget
from kvbench.families import policy_problem
from kvbench.fidelity import (
    ReferenceStore,
    default_reference_dir,
    generated_reference,
    prompt_hash,
    reference_key,
    store_at,
)
from kvbench.metrics.fidelity import fidelity_rouge_l, kl_divergence, top1_agreement, topk_mass
from kvbench.models import LoadedModel, load_config, load_model, load_tokenizer
from kvbench.provenance import provenance
from kvbench.results import CellBusy, CellConflict, CellResults, summarize, write_error
from kvbench.tasks.base import Example, RenderedPrompt, Task
from kvbench.tasks.registry import build_task
from kvbench.tracking import Tracker

log = logging.getLogger("kvbench")
# configs/hydra/launcher/{joblib,submitit_local,submitit_slurm}.yaml are complete launcher configs named
# like the plugins' own schemas; Hydra merges the two and warns about it in every process.
warnings.filterwarnings("ignore", message=r"[\s\S]*is validated against ConfigStore schema with the same name")
_MODELS: dict[tuple, LoadedModel] = {}


def cell_path(model: str, task: str, subset: Any, policy: str, stage: str, budget: Any, batch: Any = 1) -> str:
    """A cell's directory below the sweep: stable, so a rerun finds what it already wrote.
    The full cache ignores the budget, so all its budgets share one cell. A batched cell (its timings are a
    batch's) has a directory of its own."""
    task_id = f"{task}-{subset}" if subset not in (None, "None", "null", "") else task
    budget_id = "full" if policy == "full" else budget
    batched = f"/batch={batch}" if str(batch) not in ("1", "None") else ""
    return f"{model}/{task_id}/{policy}/{stage}/budget={budget_id}{batched}"


OmegaConf.register_new_resolver("kvbench_cell", cell_path, replace=True)


def get_model(model_cfg: dict[str, Any]) -> LoadedModel:
    """Load once per process; the cells that follow reuse it."""
    key = tuple(sorted((k, str(v)) for k, v in model_cfg.items()))
    if key not in _MODELS:
        if _MODELS:  # a sweep moved on to another model: free the last one first
            _MODELS.clear()
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        options = {k: v for k, v in model_cfg.items() if k != "name"}
        loaded = load_model(model_cfg["name"], **options)
        _warm_up(loaded)
        _MODELS[key] = loaded
    return _MODELS[key]


def _warm_up(lm: LoadedModel) -> None:
    """One short generation so the first timed example pays no one-off start-up costs."""
    from kvbench.policies.registry import build_policy

    ids = list(range(10, 42))
    generate(
        lm.model, lm.tokenizer, ids, build_policy({"name": "full"}), 1.0, "prefill", DecodeSettings(max_new_tokens=4)
    )


def check_model_support(spec: RunSpec) -> None:
    """Refuse from the model's config alone (no weights) what kvbench cannot run exactly on it."""
    problem = policy_problem(load_config(**spec.model), spec.policy)
    if problem:
        raise ConfigError(f"model={spec.model['name']}: {problem}")


def render_all(task: Task, examples: list[Example], spec: RunSpec) -> dict[str, RenderedPrompt]:
    """Render every prompt with the tokenizer alone and refuse contexts the model cannot hold."""
    check_model_support(spec)
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
        if spec.policy.evicts:
            reference = reference_length(spec.stage, len(prompt.input_ids), len(prompt.suffix_ids), new_tokens)
            budget_tokens = resolve_budget(spec.budget, reference)
            if budget_tokens < spec.policy.scope.min_budget():
                raise ConfigError(
                    f"example {ex.id}: budget={spec.budget} is {budget_tokens} tokens of its {reference}, below the "
                    f"{spec.policy.scope.min_budget()} tokens policy {spec.policy.name!r} always protects; raise the "
                    "budget or lower policy.scope.n_sink / window"
                )
        rendered[ex.id] = prompt
    return rendered


def _policy_pass(
    lm: LoadedModel, spec: RunSpec, prompt: RenderedPrompt, settings: DecodeSettings, **extra: Any
) -> Generation:
    """The run's policy over one prompt, exactly as the timed run does it (teacher forcing uses it too)."""
    return generate(
        lm.model,
        lm.tokenizer,
        prompt.input_ids,
        spec.policy,
        spec.budget,
        spec.stage,
        settings,
        suffix_ids=prompt.suffix_ids,
        stride=spec.stride,
        **extra,
    )


def wants_fidelity(task: Task, spec: RunSpec) -> bool:
    """Fidelity to the full cache is scored when the run asks (``fidelity=true``), when the task's
    config does (``task.fidelity``: on by default for summarisation and LongBench), and always
    for tasks scored by fidelity alone."""
    return bool(spec.fidelity or spec.task_cfg.get("fidelity") or task.primary_metric.startswith("fidelity_"))


def fidelity_metrics(
    lm: LoadedModel,
    task: Task,
    spec: RunSpec,
    ex: Example,
    prompt: RenderedPrompt,
    settings: DecodeSettings,
    prediction: str,
    store: ReferenceStore,
) -> dict[str, Any]:
    """Score a prediction against the full cache's output for the same prompt and settings (generated
    once and shared through ``store``), then teacher-force that output through the run's policy for
    next-token agreement and KL (see kvbench.metrics.fidelity for exactly which KL)."""
    key = reference_key("generate", lm, spec, ex.id, prompt_hash(prompt.input_ids, prompt.suffix_ids), settings)
    ref = store.get_or_create(
        key, lambda: generated_reference(lm, prompt.input_ids, prompt.suffix_ids, settings, spec.stride)
    )
    forced = _policy_pass(lm, spec, prompt, settings, forced_tokens=ref.tokens, return_logits=True)
    return {
        "metrics": {
            "fidelity_rougeL": fidelity_rouge_l(prediction, task.postprocess(ref.text, ex)),
            "fidelity_top1": top1_agreement(forced.logits, ref.tokens),
            "fidelity_kl": kl_divergence(ref.summary, forced.logits),
            "fidelity_topk_mass": topk_mass(ref.summary),
        },
        "fidelity_reference": store.path(key).name,
        "fidelity_reference_tokens": len(ref.tokens),
    }


def _generation_fields(g: Generation) -> dict[str, Any]:
    return {
        # Decoded in a batch of ``batch_size`` (its decode timings are the batch's steps; decode_tokens_per_s is
        # this sequence's own share, batch_decode_tokens_per_s the whole batch's).
        "batch_size": g.batch_size,
        "budget_tokens": g.budget_tokens,
        "budget_achieved": g.budget_achieved,
        "budget_achieved_per_layer": g.budget_achieved_per_layer,
        "kept_tokens": g.kept_tokens,
        "seen_tokens": g.seen_tokens,
        "kv_resident_bytes": g.kv_resident_bytes,
        "kv_resident_peak_bytes": g.kv_resident_peak_bytes,
        # Hybrid models: the full-attention layers (the budget's) and the sliding layers (their window) apart.
        "budget_achieved_full": g.budget_achieved_full,
        "budget_achieved_sliding": g.budget_achieved_sliding,
        "kv_resident_bytes_full": g.kv_resident_bytes_full,
        "kv_resident_bytes_sliding": g.kv_resident_bytes_sliding,
        "kv_capacity_bytes": g.kv_capacity_bytes,
        "peak_memory_prefill_bytes": g.peak_memory_prefill_bytes,
        "peak_memory_bytes": g.peak_memory_bytes,
        "peak_memory_kind": g.peak_memory_kind,
        **g.timings(),
        "prompt_tokens": g.prompt_tokens,
        "new_tokens": len(g.tokens),
        "stop_reason": g.stop_reason,
    }


def run_example(
    lm: LoadedModel,
    task: Task,
    spec: RunSpec,
    ex: Example,
    prompt: RenderedPrompt,
    references: ReferenceStore | None = None,
) -> dict[str, Any]:
    """One example's row. A task's own ``evaluate`` comes first (perplexity); otherwise generate with
    the policy, score, and add fidelity to the full cache when asked for. Full-cache references live
    in ``references`` (default: see kvbench.fidelity.default_reference_dir)."""
    store = references or store_at(default_reference_dir())
    custom = task.evaluate(lm, spec, ex, prompt, store)
    if custom is None:
        decode = example_settings(task, spec, ex)
        return generation_row(lm, task, spec, ex, prompt, _policy_pass(lm, spec, prompt, decode), decode, store)
    custom = dict(custom)
    metrics = dict(custom.pop("metrics"))
    g = custom.pop("generation", None)
    return _row(task, metrics, g, prompt, custom)


def example_settings(task: Task, spec: RunSpec, ex: Example) -> DecodeSettings:
    settings = task.generation(ex)
    return spec.decode_settings(settings.max_new_tokens, settings.stop_strings)


def generation_row(
    lm: LoadedModel,
    task: Task,
    spec: RunSpec,
    ex: Example,
    prompt: RenderedPrompt,
    g: Generation,
    decode: DecodeSettings,
    store: ReferenceStore,
) -> dict[str, Any]:
    """The row of a generation: scored, with fidelity to the full cache when asked for (its passes run alone)."""
    prediction = task.postprocess(g.text, ex)
    metrics = task.score(prediction, ex)
    extra: dict[str, Any] = {}
    if wants_fidelity(task, spec):
        fidelity = fidelity_metrics(lm, task, spec, ex, prompt, decode, prediction, store)
        metrics.update(fidelity.pop("metrics"))
        extra.update(fidelity)
    extra.update(prediction=prediction, references=ex.references)
    return _row(task, metrics, g, prompt, extra)


def _row(
    task: Task, metrics: dict[str, Any], g: Generation | None, prompt: RenderedPrompt, extra: dict[str, Any]
) -> dict[str, Any]:
    return {
        "status": "ok",
        "primary_metric": task.primary_metric,
        "score": metrics.get(task.primary_metric),
        **{f"metric.{k}": v for k, v in metrics.items()},
        **(_generation_fields(g) if g is not None else {}),
        "truncated": prompt.truncated,
        **extra,
    }


def example_rows(
    lm: LoadedModel,
    task: Task,
    spec: RunSpec,
    todo: list[Example],
    rendered: dict[str, RenderedPrompt],
    references: ReferenceStore,
) -> Iterator[tuple[Example, dict[str, Any]]]:
    """Each example's row as it is done: one at a time, or ``batch_size`` decoded together (a task with its own
    evaluation runs alone). A failure becomes that example's error row (a batch's: every unfinished one's)."""
    batched = spec.batch_size > 1 and type(task).evaluate is Task.evaluate
    if not batched:
        for ex in todo:
            try:
                yield ex, run_example(lm, task, spec, ex, rendered[ex.id], references)
            except Exception as err:  # one failing example must not end the sweep
                yield ex, error_row(err)
        return
    settings = [example_settings(task, spec, ex) for ex in todo]
    requests = [Request(rendered[ex.id].input_ids, rendered[ex.id].suffix_ids, s) for ex, s in zip(todo, settings)]
    done: set[int] = set()
    try:
        run = BatchRun(
            lm.model, lm.tokenizer, requests, spec.policy, spec.budget, spec.stage, spec.batch_size, spec.stride
        )
        while True:
            more = run.step()
            for i, seq in enumerate(run.sequences):
                if seq.generation is not None and i not in done:
                    done.add(i)
                    ex = todo[i]
                    try:
                        yield (
                            ex,
                            generation_row(
                                lm, task, spec, ex, rendered[ex.id], seq.generation, settings[i], references
                            ),
                        )
                    except Exception as err:
                        yield ex, error_row(err)
            if not more:
                return
    except Exception as err:
        for i, ex in enumerate(todo):
            if i not in done:
                yield ex, error_row(err)


def error_row(err: Exception) -> dict[str, Any]:
    if isinstance(err, torch.cuda.OutOfMemoryError):
        torch.cuda.empty_cache()
    log.warning("example failed: %s: %s", type(err).__name__, err)
    return {"status": "error", "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc(limit=4)}


def run_cell(cfg: DictConfig, cell_dir: Path, sweep: str, *, skip_busy: bool = False) -> dict[str, Any]:
    """Validate, then run every example not already in ``rows.jsonl``; errors become rows.

    Everything that can be checked runs before the model loads: the config (``validate``), the cell's
    recorded config (a rerun must match it), then every prompt, rendered with the tokenizer alone.
    ``skip_busy``: when another process is running this very cell (the budgets of a full-cache cell
    share one directory), leave it to that process instead of failing.
    """
    spec = validate(cfg)
    task = build_task(spec.task_cfg)
    identity = {
        "model": spec.model["name"],
        "task": spec.task_id,
        "policy": spec.policy.name,
        "budget": 1.0 if not spec.policy.evicts else spec.budget,
        "stage": spec.stage,
        "batch_size": spec.batch_size,
        "run_dir": os.path.relpath(cell_dir, cfg.results_dir),
        "sweep": sweep,
    }
    resolved = {k: v for k, v in OmegaConf.to_container(cfg, resolve=True).items() if k != "hydra"}
    references = store_at(Path(cfg.results_dir) / ".references")
    try:
        with CellResults(cell_dir) as results:
            return _fill_cell(results, task, spec, identity, resolved, cell_dir, sweep, references)
    except CellBusy:
        if not skip_busy:
            raise
        log.info("cell %s is being run by another process; leaving it to that one", cell_dir)
        return {**identity, "skipped": "busy"}


def _fill_cell(
    results: CellResults,
    task: Task,
    spec: RunSpec,
    identity: dict[str, Any],
    resolved: dict[str, Any],
    cell_dir: Path,
    sweep: str,
    references: ReferenceStore,
) -> dict[str, Any]:
    results.claim(resolved, evicts=spec.policy.evicts)
    results.clear_error()
    if results.is_complete():
        log.info("cell %s is complete; skipping", cell_dir)
        if spec.capacity.get("memory_gib"):
            return json.loads(results.summary_path.read_text(encoding="utf-8"))
        return summarize(results.rows(), len(results.rows()))
    examples = task.examples()
    if spec.capacity.get("memory_gib"):
        return _fill_capacity_cell(results, task, spec, identity, resolved, cell_dir, sweep, examples)
    done = results.finished_ids()
    todo = [ex for ex in examples if ex.id not in done]
    tracker = None
    try:
        if todo:
            rendered = render_all(task, todo, spec)
            lm = get_model(spec.model)
            origin = provenance(lm.device, lm.dtype)
            tracker = Tracker(
                spec.tracking.get("wandb", {}),
                cell_path_name(identity),
                cell_dir,
                resolved,
                sweep,
                tags=[spec.policy.name, spec.stage, spec.task_id, spec.model["name"]],
            )
            progress = tqdm(total=len(todo), desc=f"{spec.policy.name} {spec.stage} budget={spec.budget}", leave=False)
            for ex, fields in example_rows(lm, task, spec, todo, rendered, references):
                row = {**identity, "example_id": ex.id, **fields, **origin}
                results.append(row)
                tracker.log_example(row)
                progress.update()
            progress.close()
        rows = results.rows()
        summary = {**identity, **summarize(rows, len(examples))}
        results.write_summary(summary)
        if tracker is not None:
            tracker.finish(summary, rows)
        return summary
    finally:
        if tracker is not None:
            tracker.abort()  # a no-op after finish; marks the run failed when the cell stopped early


def _fill_capacity_cell(
    results: CellResults,
    task: Task,
    spec: RunSpec,
    identity: dict[str, Any],
    resolved: dict[str, Any],
    cell_dir: Path,
    sweep: str,
    examples: list[Example],
) -> dict[str, Any]:
    """``experiment=capacity``: the largest batch under the memory cap, by real runs of the task's prompts (a
    row per probed batch size); a resumed cell reuses the probes it already has."""
    cap, limit = float(spec.capacity["memory_gib"]), int(spec.capacity.get("max_batch") or 1024)
    done = {int(r["capacity_batch"]): r for r in results.rows() if r.get("kind") == "capacity"}
    rendered = render_all(task, examples, spec)
    lm = get_model(spec.model)
    origin = provenance(lm.device, lm.dtype)
    requests = [
        Request(rendered[ex.id].input_ids, rendered[ex.id].suffix_ids, example_settings(task, spec, ex))
        for ex in examples
    ]
    eos = lm.model.generation_config.eos_token_id
    lm.model.generation_config.eos_token_id = None  # every probe decodes its full length: comparable steps
    try:
        best, probes = capacity_rows(
            lm.model, requests, spec.policy, spec.budget, spec.stage, cap, limit, spec.stride, done
        )
    finally:
        lm.model.generation_config.eos_token_id = eos
    for found in probes:
        results.append(
            {
                **identity,
                "example_id": f"batch={found['batch']}",
                "kind": "capacity",
                "status": "ok",
                "capacity_batch": found["batch"],
                "capacity_memory_gib": cap,
                **found,
                **origin,
            }
        )
    rows = [r for r in results.rows() if r.get("kind") == "capacity"]
    at_best = next((r for r in rows if r["capacity_batch"] == best), {})
    summary = {
        **identity,
        "n_expected": len(rows),
        "n_ok": len(rows),
        "n_error": 0,
        "max_batch": best,
        "capacity_memory_gib": cap,
        "decode_tokens_per_s_at_max_batch": at_best.get("decode_tokens_per_s"),
    }
    results.write_summary(summary)
    log.info("cell %s: largest batch under %.3g GiB is %d", cell_dir, cap, best)
    return summary


def cell_path_name(identity: dict[str, Any]) -> str:
    return f"{identity['model']}|{identity['task']}|{identity['policy']}|{identity['stage']}|{identity['budget']}"


CONFIG_DIR = str(Path(__file__).resolve().parent.parent / "configs")


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")
def main(cfg: DictConfig) -> None:
    """One cell. Alone (``kvbench-run ...``), a cell that cannot run exits with status 2 and one message;
    in a sweep (``-m``, any launcher) it writes the message to ``<cell>/error.txt`` and the sweep goes on
    (the table at the end of the sweep lists such cells)."""
    hc = HydraConfig.get()
    cell_dir = Path(hc.runtime.output_dir)
    multirun = hc.mode == RunMode.MULTIRUN
    try:
        summary = run_cell(cfg, cell_dir, str(cfg.sweep_name), skip_busy=multirun)
        log.info("done: %s", {k: v for k, v in summary.items() if not k.startswith("mean.") or "score" in k})
    except (ConfigError, CellBusy, CellConflict) as err:
        message = f"kvbench: {err}"
        print(message, file=sys.stderr)
        if not multirun:
            sys.exit(2)
        write_error(cell_dir, message)
    except Exception:
        if not multirun:
            raise
        log.error("cell %s failed:\n%s", cell_dir, traceback.format_exc())
        write_error(cell_dir, traceback.format_exc())


if __name__ == "__main__":
    main()
