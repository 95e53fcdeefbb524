"""The leaderboard's numbers (kvpress's figure): quality against compression ratio, per task and averaged over
tasks, and each policy's paired difference from a baseline.

The ratio is 1 / budget: the share of the prompt a cell keeps (stage prefill and both), of prompt +
max_new_tokens in stage=decode (kvbench.budget). A cell whose budget is only a cap (a threshold allocation keeps
what scores well, kvbench.report.declared) is placed at the ratio it achieved (``budget_achieved``), as is a
budget given in tokens. The mean over tasks weighs tasks alike; its interval resamples examples within each task
(a stratified bootstrap), so only cells run on every task of their model are averaged.

A task's context length and needle depth (``task.context_tokens``, ``task.depth``: NIAH's grid, RULER at several
lengths) are points of one task, not tasks of their own: the leaderboard's task is the task less them
(``board_tasks``), its score the mean over its length × depth cells (each alike, resampled within each), so that a
NIAH grid of 55 cells counts once in the mean over tasks. kvpress's leaderboard runs RULER at one length, the case
of a single cell; the quality tables and the NIAH heatmaps keep each length and depth apart.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import pandas as pd

from kvbench.report.aggregate import N_BOOT, context_codes, shares_context
from kvbench.report.declared import PolicyFacts, placed_share
from kvbench.report.labels import base_name, label_cells
from kvbench.report.paired import baseline_rows, stratified_bootstrap
from kvbench.report.style import is_baseline
from kvbench.results.schema import (
    BUDGET,
    BUDGET_ACHIEVED,
    EXAMPLE_ID,
    MODEL,
    POLICY,
    SETTINGS,
    STAGE,
    STATUS,
    STATUS_OK,
    TASK,
)

MEAN_TASK = "mean over tasks"
GROUP = [MODEL, STAGE, POLICY, BUDGET]
COLUMNS = [MODEL, TASK, STAGE, POLICY, BUDGET, "ratio", "y", "ci_low", "ci_high", "n"]
GRID_KEYS = ("task.context_tokens", "task.depth")  # a task's length and needle depth: points of its grid
BOARD = "_board_task"  # the column ``_ok`` adds: each row's task as the leaderboard counts it


def board_tasks(rows: pd.DataFrame) -> pd.Series:
    """Each row's task label less its context length and needle depth (``GRID_KEYS``), named as
    kvbench.report.labels names tasks: the task the leaderboard averages over."""
    if rows.empty or SETTINGS not in rows:
        return rows[TASK]

    def kept(settings: Any) -> Any:
        return {k: v for k, v in settings.items() if k not in GRID_KEYS} if isinstance(settings, Mapping) else settings

    return label_cells(rows.assign(**{TASK: rows[TASK].map(base_name), SETTINGS: rows[SETTINGS].map(kept)}))[TASK]


def kept_fraction(cells: pd.DataFrame, facts: Mapping[str, PolicyFacts]) -> pd.Series:
    """The share of the reference a cell keeps: the budget asked for, or the one achieved (mean of the rows'
    ``budget_achieved``) where the budget is a cap or a token count."""
    thresholded = cells[POLICY].map(lambda p: facts.get(p, PolicyFacts()).thresholded).astype(bool)
    asked = cells["budget_kind"].eq(0) & ~thresholded
    achieved = pd.to_numeric(cells.get(BUDGET_ACHIEVED, pd.Series(np.nan, index=cells.index)), errors="coerce")
    return cells["budget_value"].where(asked, achieved).astype(float)


def _ok(rows: pd.DataFrame, column: str) -> pd.DataFrame:
    rows = rows.assign(**{BOARD: board_tasks(rows)})
    ok = rows[rows[STATUS].eq(STATUS_OK)]
    return ok.assign(_value=pd.to_numeric(ok[column], errors="coerce")).dropna(subset=["_value"])


def _weights(block: pd.DataFrame) -> tuple[list[str], list[float]]:
    """``block``'s task cells in order and their weights: the tasks alike, a task's length × depth cells alike
    within it."""
    cells = block.drop_duplicates(TASK).set_index(TASK)[BOARD].sort_index()
    size = cells.value_counts()
    return list(cells.index), [1.0 / size[board] for board in cells]


def _point(key: tuple, block: pd.DataFrame, facts: Mapping[str, PolicyFacts], n_boot: int, seed: int) -> dict:
    """The weighted mean over ``block``'s task cells (one model, stage, policy, budget), its stratified interval,
    the ratio (kept fraction averaged alike) and the examples counted."""
    labels, weights = _weights(block)
    cells = [block[block[TASK].eq(t)] for t in labels]
    strata = [cell["_value"].to_numpy() for cell in cells]
    clusters = [context_codes(cell[EXAMPLE_ID], shares_context(cell)) for cell in cells]
    mean, low, high = stratified_bootstrap(strata, _rng(seed, key), n_boot, weights=weights, clusters=clusters)
    placed = block.assign(**{BUDGET_ACHIEVED: placed_share(block)}).groupby(TASK)[BUDGET_ACHIEVED].mean()
    per_task = block.groupby(TASK).first().assign(**{BUDGET_ACHIEVED: placed})
    fraction = np.average(kept_fraction(per_task.assign(**{POLICY: key[2]}), facts)[labels], weights=weights)
    return dict(zip(GROUP, key)) | {
        "ratio": 1.0 / fraction,
        "y": mean,
        "ci_low": low,
        "ci_high": high,
        "n": int(len(block)),
    }


def _rng(seed: int, key: tuple) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32("\x1f".join(map(str, key)).encode())])


def _complete(ok: pd.DataFrame) -> Iterator[tuple[tuple, pd.DataFrame, list[str]]]:
    """Each evicting (model, stage, policy, budget) run on every task its model has, with those tasks."""
    tasks = {model: sorted(part[TASK].unique()) for model, part in ok.groupby(MODEL)}
    for key, block in ok[~ok[POLICY].map(is_baseline)].groupby(GROUP, sort=False):
        if sorted(block[TASK].unique()) == tasks[key[0]]:
            yield key, block, tasks[key[0]]


def task_points(
    rows: pd.DataFrame,
    column: str,
    facts: Mapping[str, PolicyFacts],
    stats: pd.DataFrame,
    n_boot: int = N_BOOT,
    seed: int = 0,
) -> pd.DataFrame:
    """Per leaderboard task: the ratio it is placed at and its mean and interval; ``cell_stats``'s (``stats``: one
    quantity) for a task of one cell, the mean over its length × depth cells for a grid (``board_tasks``)."""
    cells = stats[~stats[POLICY].map(is_baseline)].copy()
    ok = _ok(rows, column)
    board = dict(zip(ok[TASK], ok[BOARD]))
    sizes = ok.groupby([MODEL, BOARD])[TASK].nunique()
    grids = {key for key, size in sizes.items() if size > 1}
    in_grid = [(m, board.get(t, t)) in grids for m, t in zip(cells[MODEL], cells[TASK])]
    cells = cells[~np.asarray(in_grid, dtype=bool)]
    placed = ok.assign(**{BUDGET_ACHIEVED: placed_share(ok)}) if len(ok) else ok
    achieved = placed.groupby([MODEL, TASK, STAGE, POLICY, BUDGET])[BUDGET_ACHIEVED].mean() if len(ok) else None
    if achieved is not None and len(cells):
        cells[BUDGET_ACHIEVED] = [
            achieved.get(tuple(k), np.nan) for k in cells[[MODEL, TASK, STAGE, POLICY, BUDGET]].values
        ]
    cells["ratio"] = 1.0 / kept_fraction(cells, facts)
    cells[TASK] = cells[TASK].map(lambda t: board.get(t, t))
    evicting = ok[~ok[POLICY].map(is_baseline)]
    grid_points = [
        _point(key, block, facts, n_boot, seed) | {TASK: key[4]}
        for key, block in evicting.groupby([*GROUP, BOARD], sort=False)
        if (key[0], key[4]) in grids and block[TASK].nunique() == sizes[(key[0], key[4])]
    ]
    return pd.concat([cells, pd.DataFrame.from_records(grid_points, columns=COLUMNS)], ignore_index=True).reindex(
        columns=COLUMNS
    )


def mean_points(
    rows: pd.DataFrame, column: str, facts: Mapping[str, PolicyFacts], n_boot: int = N_BOOT, seed: int = 0
) -> pd.DataFrame:
    """Per (model, stage, policy, budget) run on every task cell: the mean over tasks of the task means (a grid's
    cells alike within its task), its stratified bootstrap interval and the ratio (kept fraction averaged alike)."""
    ok = _ok(rows, column)
    records = [_point(key, block, facts, n_boot, seed) | {TASK: MEAN_TASK} for key, block, _ in _complete(ok)]
    return pd.DataFrame.from_records(records, columns=COLUMNS)


def baseline_levels(rows: pd.DataFrame, column: str) -> pd.DataFrame:
    """The full cache's level per model, task (and the mean over tasks) and stage: its mean in that stage, or in
    any stage it ran (without eviction the stage is moot)."""
    ok, records = _ok(rows, column), []
    for (model, policy), full in ok[ok[POLICY].map(is_baseline)].groupby([MODEL, POLICY]):
        tasks = sorted(ok.loc[ok[MODEL].eq(model), TASK].unique())
        for stage in sorted(ok.loc[ok[MODEL].eq(model), STAGE].unique()):
            own = full[full[STAGE].eq(stage)]
            source = own if len(own) else full[full[STAGE].eq(full[STAGE].iat[0])]
            cells = source.groupby(TASK)["_value"].mean()
            means = cells.groupby(source.groupby(TASK)[BOARD].first()).mean()  # a grid's cells alike
            for task, value in means.items():
                records.append({MODEL: model, TASK: task, STAGE: stage, POLICY: policy, "y": value})
            if sorted(cells.index) == tasks:
                records.append({MODEL: model, TASK: MEAN_TASK, STAGE: stage, POLICY: policy, "y": means.mean()})
    return pd.DataFrame.from_records(records, columns=[MODEL, TASK, STAGE, POLICY, "y"])


def paired_over_tasks(
    rows: pd.DataFrame,
    column: str,
    baseline: str,
    facts: Mapping[str, PolicyFacts],
    n_boot: int = N_BOOT,
    seed: int = 0,
) -> pd.DataFrame:
    """Per (model, stage, policy, budget) run on every task: the mean over tasks of the mean per-example difference
    from ``baseline`` (examples both ran), resampled within each task, and the pairs counted."""
    ok, records = _ok(rows, column), []
    for key, block, tasks in _complete(ok[~ok[POLICY].eq(baseline)]):
        strata, clusters = [], []
        for task in tasks:
            own = block[block[TASK].eq(task)]
            mine = own.drop_duplicates(EXAMPLE_ID).set_index(EXAMPLE_ID)["_value"]
            same = ok[ok[MODEL].eq(key[0]) & ok[TASK].eq(task) & ok[STAGE].eq(key[1]) & ok[BUDGET].eq(key[3])]
            base = baseline_rows(same if len(same) else ok[ok[MODEL].eq(key[0]) & ok[TASK].eq(task)], ok, baseline)
            base = base.drop_duplicates(EXAMPLE_ID).set_index(EXAMPLE_ID)["_value"]
            shared = mine.index.intersection(base.index)
            strata.append((mine[shared] - base[shared]).to_numpy(dtype=float))
            clusters.append(context_codes(shared, shares_context(own)))
        if any(len(s) == 0 for s in strata):
            continue
        rng, weights = _rng(seed, (*key, baseline)), _weights(block)[1]
        diff, low, high = stratified_bootstrap(strata, rng, n_boot, weights=weights, clusters=clusters)
        records.append(
            dict(zip(GROUP, key))
            | {
                "baseline": baseline,
                "diff": diff,
                "ci_low": low,
                "ci_high": high,
                "n": sum(map(len, strata)),
                "tasks": block[BOARD].nunique(),
            }
        )
    return pd.DataFrame.from_records(records, columns=[*GROUP, "baseline", "diff", "ci_low", "ci_high", "n", "tasks"])
