"""The leaderboard's numbers (kvpress's figure): quality against compression ratio, per task and averaged over
tasks, and each policy's paired difference from a baseline.

The ratio is 1 / budget: the share of the prompt a cell keeps (stage prefill and both), of prompt +
max_new_tokens in stage=decode (kvbench.budget). A cell whose budget is only a cap (a threshold allocation keeps
what scores well, kvbench.report.declared) is placed at the ratio it achieved (``budget_achieved``), as is a
budget given in tokens. The mean over tasks weighs tasks alike; its interval resamples examples within each task
(a stratified bootstrap), so only cells run on every task of their model are averaged.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Mapping

import numpy as np
import pandas as pd

from kvbench.report.aggregate import N_BOOT
from kvbench.report.declared import PolicyFacts
from kvbench.report.paired import baseline_rows, stratified_bootstrap
from kvbench.report.style import is_baseline
from kvbench.results.schema import BUDGET, BUDGET_ACHIEVED, EXAMPLE_ID, MODEL, POLICY, STAGE, STATUS, STATUS_OK, TASK

MEAN_TASK = "mean over tasks"
GROUP = [MODEL, STAGE, POLICY, BUDGET]
COLUMNS = [MODEL, TASK, STAGE, POLICY, BUDGET, "ratio", "y", "ci_low", "ci_high", "n"]


def kept_fraction(cells: pd.DataFrame, facts: Mapping[str, PolicyFacts]) -> pd.Series:
    """The share of the reference a cell keeps: the budget asked for, or the one achieved (mean of the rows'
    ``budget_achieved``) where the budget is a cap or a token count."""
    asked = cells["budget_kind"].eq(0) & ~cells[POLICY].map(lambda p: facts.get(p, PolicyFacts()).thresholded)
    achieved = pd.to_numeric(cells.get(BUDGET_ACHIEVED, pd.Series(np.nan, index=cells.index)), errors="coerce")
    return cells["budget_value"].where(asked, achieved).astype(float)


def _ok(rows: pd.DataFrame, column: str) -> pd.DataFrame:
    ok = rows[rows[STATUS].eq(STATUS_OK)]
    return ok.assign(_value=pd.to_numeric(ok[column], errors="coerce")).dropna(subset=["_value"])


def _rng(seed: int, key: tuple) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32("\x1f".join(map(str, key)).encode())])


def _complete(ok: pd.DataFrame) -> Iterator[tuple[tuple, pd.DataFrame, list[str]]]:
    """Each evicting (model, stage, policy, budget) run on every task its model has, with those tasks."""
    tasks = {model: sorted(part[TASK].unique()) for model, part in ok.groupby(MODEL)}
    for key, block in ok[~ok[POLICY].map(is_baseline)].groupby(GROUP, sort=False):
        if sorted(block[TASK].unique()) == tasks[key[0]]:
            yield key, block, tasks[key[0]]


def task_points(rows: pd.DataFrame, column: str, facts: Mapping[str, PolicyFacts], stats: pd.DataFrame) -> pd.DataFrame:
    """Per task cell: the ratio it is placed at and ``cell_stats``'s mean and interval (``stats``: one quantity)."""
    cells = stats[~stats[POLICY].map(is_baseline)].copy()
    ok = _ok(rows, column)
    achieved = ok.groupby([MODEL, TASK, STAGE, POLICY, BUDGET])[BUDGET_ACHIEVED].mean() if len(ok) else None
    if achieved is not None and len(cells):
        cells[BUDGET_ACHIEVED] = [
            achieved.get(tuple(k), np.nan) for k in cells[[MODEL, TASK, STAGE, POLICY, BUDGET]].values
        ]
    cells["ratio"] = 1.0 / kept_fraction(cells, facts)
    return cells.reindex(columns=COLUMNS)


def mean_points(
    rows: pd.DataFrame, column: str, facts: Mapping[str, PolicyFacts], n_boot: int = N_BOOT, seed: int = 0
) -> pd.DataFrame:
    """Per (model, stage, policy, budget) run on every task: the mean over tasks of the task means, its stratified
    bootstrap interval and the ratio (kept fraction averaged over tasks)."""
    ok, records = _ok(rows, column), []
    for key, block, tasks in _complete(ok):
        strata = [block.loc[block[TASK].eq(t), "_value"].to_numpy() for t in tasks]
        mean, low, high = stratified_bootstrap(strata, _rng(seed, key), n_boot)
        per_task = block.groupby(TASK).first().assign(**{BUDGET_ACHIEVED: block.groupby(TASK)[BUDGET_ACHIEVED].mean()})
        fraction = kept_fraction(per_task.assign(**{POLICY: key[2]}), facts).mean()
        records.append(
            dict(zip(GROUP, key))
            | {
                TASK: MEAN_TASK,
                "ratio": 1.0 / fraction,
                "y": mean,
                "ci_low": low,
                "ci_high": high,
                "n": int(len(block)),
            }
        )
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
            means = source.groupby(TASK)["_value"].mean()
            for task, value in means.items():
                records.append({MODEL: model, TASK: task, STAGE: stage, POLICY: policy, "y": value})
            if sorted(means.index) == tasks:
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
        strata = []
        for task in tasks:
            mine = block[block[TASK].eq(task)].drop_duplicates(EXAMPLE_ID).set_index(EXAMPLE_ID)["_value"]
            same = ok[ok[MODEL].eq(key[0]) & ok[TASK].eq(task) & ok[STAGE].eq(key[1]) & ok[BUDGET].eq(key[3])]
            base = baseline_rows(same if len(same) else ok[ok[MODEL].eq(key[0]) & ok[TASK].eq(task)], ok, baseline)
            base = base.drop_duplicates(EXAMPLE_ID).set_index(EXAMPLE_ID)["_value"]
            shared = mine.index.intersection(base.index)
            strata.append((mine[shared] - base[shared]).to_numpy(dtype=float))
        if any(len(s) == 0 for s in strata):
            continue
        diff, low, high = stratified_bootstrap(strata, _rng(seed, (*key, baseline)), n_boot)
        records.append(
            dict(zip(GROUP, key))
            | {
                "baseline": baseline,
                "diff": diff,
                "ci_low": low,
                "ci_high": high,
                "n": sum(map(len, strata)),
                "tasks": len(tasks),
            }
        )
    return pd.DataFrame.from_records(records, columns=[*GROUP, "baseline", "diff", "ci_low", "ci_high", "n", "tasks"])
