"""From example rows to cell statistics: the numbers every figure and table draws.

Kept free of matplotlib so tests can check the plotted data directly: ``cell_stats`` returns one
tidy row per model/task/stage/policy/budget/quantity with x (achieved budget, %), y (mean over
examples), a bootstrap interval and n.

The questions of one context (``task.ask=each``, RULER's multi-query subsets: rows ``<context>/<question>``) are not
independent samples: every interval resamples contexts, keeping all their questions (a cluster bootstrap), so it is
not too narrow; elsewhere a context is one example.
"""

from __future__ import annotations

import itertools
import warnings
import zlib
from collections.abc import Collection, Mapping, Sequence

import numpy as np
import pandas as pd

from kvbench.report.declared import placed_share
from kvbench.report.style import is_baseline, sort_policies, sort_stages
from kvbench.results.schema import (
    BUDGET,
    CELL,
    ERROR,
    EXAMPLE_ID,
    METRIC_PREFIX,
    MODEL,
    POLICY,
    PRIMARY_METRIC,
    SCORE,
    STAGE,
    STATUS,
    STATUS_OK,
    TASK,
    metric_column,
)

N_BOOT = 1000
LEVEL = 0.95
STATS_COLUMNS = [*CELL, "budget_kind", "budget_value", "quantity", "x", "y", "ci_low", "ci_high", "n"]


def quality_column(rows: pd.DataFrame, metric: str | None) -> tuple[str, dict[str, str]]:
    """The column holding the quality to plot and, per task, the metric's name.

    Without ``metric`` it is ``score`` (each task's primary metric, which may differ by task);
    otherwise ``metric`` itself or ``metric.<metric>``.
    """
    tasks = sorted(rows[TASK].unique()) if TASK in rows else []
    if metric is None:
        named = rows.dropna(subset=[PRIMARY_METRIC]) if PRIMARY_METRIC in rows else rows.iloc[:0]
        names = named.groupby(TASK)[PRIMARY_METRIC].agg(lambda s: s.mode().iat[0]) if len(named) else {}
        return SCORE, {task: str(names.get(task, SCORE)) for task in tasks}
    for column in (metric, metric_column(metric)):
        if column in rows and pd.to_numeric(rows[column], errors="coerce").notna().any():
            return column, {task: column.removeprefix(METRIC_PREFIX) for task in tasks}
    known = sorted(c.removeprefix(METRIC_PREFIX) for c in rows.columns if c.startswith(METRIC_PREFIX))
    raise ValueError(f"no values for metric {metric!r}; rows have: {', '.join(known) or 'none'}")


SHARED_PREFILL = "prefill_shared"  # a row's column: true when an earlier question of its context paid its prefill


def shares_context(rows: pd.DataFrame) -> bool:
    """Whether ``rows`` (one cell) ask several questions of one context: some question reused its context's
    prefill."""
    return SHARED_PREFILL in rows and bool(rows[SHARED_PREFILL].eq(True).any())


def context_codes(example_ids: Sequence[str], shared: bool) -> np.ndarray | None:
    """Each row's context as 0, 1, ...: its ``example_id`` less ``/<question>`` (docs/results.md) where the rows
    share contexts; None (each row its own) where they do not."""
    if not shared:
        return None
    return pd.factorize(pd.Series(list(example_ids), dtype=str).str.rsplit("/", n=1).str[0])[0]


def bootstrap(
    values: np.ndarray,
    rng: np.random.Generator,
    n_boot: int = N_BOOT,
    level: float = LEVEL,
    clusters: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Mean, percentile-bootstrap interval and count of each column of ``values`` (NaN = absent).

    ``clusters`` (each row's context, 0..k-1; default: each row its own) are what is resampled, each with all its
    rows: the cluster bootstrap of the mean over rows. All columns share one set of resamples, held as per-cluster
    multiplicities so memory stays n_boot x n whatever the number of columns. Deviations from the mean are
    resampled, so constant data gives an interval of exactly the mean; the interval is also widened to include
    the mean, which keeps error bars non-negative on degenerate data.
    """
    data = np.asarray(values, dtype=float)
    data = data.reshape(len(data), -1)
    present = ~np.isnan(data)
    count = present.sum(axis=0)
    n = len(data)
    if n == 0:
        empty = np.full(data.shape[1], np.nan)
        return empty, empty, empty, count
    k = n if clusters is None else int(np.max(clusters)) + 1
    with warnings.catch_warnings(), np.errstate(invalid="ignore", divide="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns give NaN, as intended
        mean = np.nanmean(data, axis=0)
        picks = rng.integers(0, k, size=(n_boot, k)) + k * np.arange(n_boot)[:, None]
        multiplicities = np.bincount(picks.ravel(), minlength=n_boot * k).reshape(n_boot, k)
        weights = (multiplicities if clusters is None else multiplicities[:, clusters]).astype(float)
        deviations = np.where(present, data - mean, 0.0)
        resampled = mean + (weights @ deviations) / (weights @ present)
        tail = (1 - level) / 2 * 100
        low, high = np.nanpercentile(resampled, [tail, 100 - tail], axis=0)
    return mean, np.fmin(low, mean), np.fmax(high, mean), count


def _achieved_percent(group: pd.DataFrame) -> float:
    """Mean achieved budget in %, or the requested fraction when the rows do not record it."""
    achieved = placed_share(group)
    if achieved.notna().any():
        return float(achieved.mean() * 100)
    first = group.iloc[0]
    return float(first["budget_value"] * 100) if first["budget_kind"] == 0 else float("nan")


def cell_stats(rows: pd.DataFrame, quantities: Sequence[str], n_boot: int = N_BOOT, seed: int = 0) -> pd.DataFrame:
    """Long table of per-cell statistics of ``quantities`` over the ``ok`` rows, resampling contexts.

    Each cell's generator is seeded from ``seed`` and the cell's identity, so a cell's interval
    does not change when other cells are added to the sweep.
    """
    present = [q for q in quantities if q in rows]
    ok = rows[rows[STATUS].eq(STATUS_OK)] if STATUS in rows else rows
    records = []
    for key, group in ok.groupby(CELL, sort=False):
        rng = np.random.default_rng([seed, zlib.crc32("\x1f".join(key).encode())])
        values = group[present].apply(pd.to_numeric, errors="coerce").to_numpy(dtype=float)
        clusters = context_codes(group[EXAMPLE_ID], shares_context(group))
        mean, low, high, count = bootstrap(values, rng, n_boot, clusters=clusters)
        base = dict(zip(CELL, key))
        base.update(
            budget_kind=group["budget_kind"].iat[0],
            budget_value=group["budget_value"].iat[0],
            x=_achieved_percent(group),
        )
        records += [
            {**base, "quantity": q, "y": mean[i], "ci_low": low[i], "ci_high": high[i], "n": int(count[i])}
            for i, q in enumerate(present)
        ]
    return pd.DataFrame.from_records(records, columns=STATS_COLUMNS)


def with_full_baseline(stats: pd.DataFrame) -> pd.DataFrame:
    """Copy the full-cache cells (each of its variants) into stages that lack them: without eviction the stage
    is moot."""
    full = stats[stats[POLICY].map(is_baseline)]
    stages = sort_stages(stats[STAGE].unique())
    copies = []
    for _, cells in full.groupby([MODEL, TASK, POLICY]):
        have = sort_stages(cells[STAGE].unique())
        source = cells[cells[STAGE].eq(have[0])]
        copies += [source.assign(stage=stage) for stage in stages if stage not in have]
    return pd.concat([stats, *copies], ignore_index=True) if copies else stats


def pareto_mask(cost: Sequence[float], quality: Sequence[float], higher_is_better: bool = True) -> np.ndarray:
    """True where no other point has lower-or-equal cost and better-or-equal quality (one strictly)."""
    cost_arr = np.asarray(cost, dtype=float)
    gain = np.asarray(quality, dtype=float) * (1 if higher_is_better else -1)
    mask = np.zeros(len(cost_arr), dtype=bool)
    best = -np.inf
    for i in np.lexsort((-gain, cost_arr)):
        if np.isfinite(cost_arr[i]) and np.isfinite(gain[i]) and gain[i] > best:
            mask[i] = True
            best = gain[i]
    return mask


def _sorted_cells(frame: pd.DataFrame) -> pd.DataFrame:
    """Cells in reading order: model, task, stage, policy (table order), budget."""
    policy_rank = {p: i for i, p in enumerate(sort_policies(frame[POLICY]))}
    stage_rank = {s: i for i, s in enumerate(sort_stages(frame[STAGE]))}
    return frame.sort_values(
        [MODEL, TASK, STAGE, POLICY, "budget_kind", "budget_value", BUDGET],
        key=lambda c: c.map(policy_rank) if c.name == POLICY else c.map(stage_rank) if c.name == STAGE else c,
    ).reset_index(drop=True)


def missing_cells(rows: pd.DataFrame, refused: Mapping[str, Collection[str]] | None = None) -> pd.DataFrame:
    """Cells of the grid (seen policies x budgets x tasks x models x stages) with no row at all.

    The full cache (each of its variants) needs one cell per model and task, at any budget and stage. A policy is
    not expected in the stages kvbench refuses it in (``refused``: policy -> stages, kvbench.report.declared).
    """
    refused = refused or {}
    columns = [*CELL, "budget_kind", "budget_value"]
    if rows.empty:
        return pd.DataFrame(columns=columns)
    evicting = rows[~rows[POLICY].map(is_baseline)]
    budgets = evicting[[BUDGET, "budget_kind", "budget_value"]].drop_duplicates().itertuples(index=False)
    budgets = list(budgets)
    present = set(rows[CELL].itertuples(index=False, name=None))
    models, tasks, stages = (sorted(rows[c].unique()) for c in (MODEL, TASK, STAGE))
    missing = [
        (model, task, stage, policy, budget, kind, value)
        for model, task, stage, policy, (budget, kind, value) in itertools.product(
            models, tasks, stages, sorted(evicting[POLICY].unique()), budgets
        )
        if (model, task, stage, policy, budget) not in present and stage not in refused.get(policy, ())
    ]
    for full, cells in rows[rows[POLICY].map(is_baseline)].groupby(POLICY):
        have_full = set(cells[[MODEL, TASK]].itertuples(index=False, name=None))
        missing += [
            (model, task, "any", full, "any", 3, np.inf)
            for model, task in itertools.product(models, tasks)
            if (model, task) not in have_full
        ]
    return _sorted_cells(pd.DataFrame(missing, columns=columns))


def error_counts(rows: pd.DataFrame) -> pd.DataFrame:
    """Per cell with at least one failed example: ok and error counts and the first message."""
    columns = [*CELL, "ok", "errors", "first_error"]
    if rows.empty or not rows[STATUS].ne(STATUS_OK).any():
        return pd.DataFrame(columns=columns)
    message = rows.get(ERROR, pd.Series("", index=rows.index)).fillna("").astype(str)
    frame = rows.assign(
        ok=rows[STATUS].eq(STATUS_OK),
        errors=rows[STATUS].ne(STATUS_OK),
        first_error=message.where(rows[STATUS].ne(STATUS_OK)).str.replace(r"\s+", " ", regex=True).str.slice(0, 120),
    )
    counts = frame.groupby(CELL, sort=False).agg(
        budget_kind=("budget_kind", "first"),
        budget_value=("budget_value", "first"),
        ok=("ok", "sum"),
        errors=("errors", "sum"),
        first_error=("first_error", "first"),
    )
    counts = counts[counts["errors"] > 0].reset_index()
    return _sorted_cells(counts)[columns]
