"""One cell (model × policy × budget × stage × task): validate, resume, run what is left, summarise.

Everything that can be checked runs before the model loads: the config (``validate``), the cell's recorded
config (a rerun must match it), then every prompt, rendered with the tokenizer alone. Each example's row (one per
question of a ``shared_context`` task) is appended as soon as it is done, so a killed cell resumes after its last
finished row; a failing example becomes an error row and the cell goes on.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from kvbench.config import RunSpec, validate
from kvbench.results.provenance import provenance
from kvbench.results.schema import KIND_EXAMPLE, SKIPPED, CellIdentity, Row, flatten
from kvbench.results.writer import CellBusy, CellResults, summarize
from kvbench.runner import model_cache
from kvbench.runner.capacity_cell import fill_capacity_cell
from kvbench.runner.example import check_protocol, example_outcomes
from kvbench.runner.fidelity.store import ReferenceStore, store_at
from kvbench.runner.paths import run_name
from kvbench.runner.prompts import render_all
from kvbench.runner.questions import row_ids
from kvbench.tasks.base import Task
from kvbench.tasks.protocol import SHARED_CONTEXT
from kvbench.tasks.registry import build_task
from kvbench.tracking import Tracker

log = logging.getLogger("kvbench")


def run_cell(
    cfg: DictConfig,
    cell_dir: Path,
    sweep: str,
    *,
    settings: dict[str, Any] | None = None,
    skip_busy: bool = False,
) -> dict[str, Any]:
    """Run every example not already in ``<cell_dir>/rows.jsonl``; returns the cell's summary.

    ``settings``: what the config changes of its named defaults (``kvbench.runner.paths.job_settings``), recorded
    in every row; none when not given.
    ``skip_busy``: when another process is running this very cell (the budgets of a full-cache cell share one
    directory), leave it to that process instead of failing.
    """
    spec = validate(cfg)
    task = build_task(spec.task_cfg, spec.model)
    check_protocol(task)
    cell = CellIdentity(
        model=spec.model["name"],
        task=spec.task_id,
        policy=spec.policy.name,
        budget=spec.budget if spec.policy.budgeted else 1.0,
        stage=spec.stage,
        batch_size=spec.batch_size,
        run_dir=os.path.relpath(cell_dir, cfg.results_dir),
        sweep=sweep,
        settings=dict(settings or {}),
    )
    container = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(container, dict)  # a composed config is a mapping
    resolved = {str(k): v for k, v in container.items() if k != "hydra"}
    references = store_at(Path(cfg.results_dir) / ".references")
    try:
        with CellResults(cell_dir) as results:
            results.claim(resolved, budgeted=spec.policy.budgeted)
            results.clear_error()
            if results.is_complete():
                log.info("cell %s is complete; skipping", cell_dir)
                return results.summary()
            if spec.capacity.get("memory_gib"):
                return fill_capacity_cell(results, task, spec, cell)
            return fill_cell(results, task, spec, cell, resolved, references)
    except CellBusy:
        if not skip_busy:
            raise
        log.info("cell %s is being run by another process; leaving it to that one", cell_dir)
        return {**flatten(cell), SKIPPED: "busy"}


def fill_cell(
    results: CellResults,
    task: Task,
    spec: RunSpec,
    cell: CellIdentity,
    resolved: dict[str, Any],
    references: ReferenceStore,
) -> dict[str, Any]:
    """The examples a cell still lacks, a row each, then its summary (tracked in wandb when configured)."""
    examples = task.examples()
    done = frozenset(results.finished_ids())
    shares = task.protocol.name == SHARED_CONTEXT.name
    expected = {ex.id: row_ids(ex, shares) for ex in examples}
    todo = [ex for ex in examples if not done.issuperset(expected[ex.id])]
    tracker = None
    try:
        if todo:
            rendered = render_all(task, todo, spec)
            lm = model_cache.get_model(spec.model)
            origin = provenance(lm.device, lm.dtype)
            tags = [spec.policy.name, spec.stage, spec.task_id, spec.model["name"]]
            wandb = spec.tracking.get("wandb", {})
            tracker = Tracker(wandb, run_name(cell), results.dir, resolved, cell.sweep, tags=tags)
            left = sum(len(set(expected[ex.id]) - done) for ex in todo)
            budget = "full" if not spec.policy.budgeted else spec.budget  # the full cache ignores the budget
            progress = tqdm(total=left, desc=f"{spec.policy.name} {spec.stage} budget={budget}", leave=False)
            for ex, outcome in example_outcomes(lm, task, spec, todo, rendered, references, done):
                row = Row(cell, ex.id, KIND_EXAMPLE, outcome, origin)
                results.append(row)
                tracker.log_example(row.to_json())
                progress.update()
            progress.close()
        rows = results.rows()
        summary = results.write_summary(summarize(cell, rows, sum(len(ids) for ids in expected.values())))
        if tracker is not None:
            tracker.finish(summary, rows)
        return summary
    finally:
        if tracker is not None:
            tracker.abort()  # a no-op after finish; marks the run failed when the cell stopped early
