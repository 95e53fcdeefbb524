"""Where a cell's results go: a directory below the sweep that a rerun finds again."""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf

from kvbench.results.schema import CellIdentity


def cell_path(model: str, task: str, subset: Any, policy: str, stage: str, budget: Any, batch: Any = 1) -> str:
    """A cell's directory below the sweep (``${kvbench_cell:...}`` in configs/config.yaml): stable, so a rerun
    finds what it already wrote. The full cache ignores the budget, so all its budgets share one cell. A batched
    cell (its timings are a batch's) has a directory of its own."""
    task_id = f"{task}-{subset}" if subset not in (None, "None", "null", "") else task
    budget_id = "full" if policy == "full" else budget
    batched = f"/batch={batch}" if str(batch) not in ("1", "None") else ""
    return f"{model}/{task_id}/{policy}/{stage}/budget={budget_id}{batched}"


# Known to OmegaConf as soon as the runner is imported: Hydra resolves the cell's directory before any cell runs.
OmegaConf.register_new_resolver("kvbench_cell", cell_path, replace=True)


def run_name(cell: CellIdentity) -> str:
    """A cell's name in a tracker's list of runs."""
    return f"{cell.model}|{cell.task}|{cell.policy}|{cell.stage}|{cell.budget}"
