"""The questions of one context (``task.ask=each``: rows ``<context>/<question>``, later questions
``prefill_shared``) are resampled together: every interval of the report is a bootstrap over contexts."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from kvbench.report.aggregate import cell_stats
from kvbench.report.declared import policy_facts
from kvbench.report.leaderboard import mean_points, paired_over_tasks
from kvbench.report.load import load_rows
from kvbench.report.paired import paired_differences


def rows_of(policy: str, budget: float, contexts: dict[str, list[float]], task: str = "a", shared: bool = True):
    """One row per question, as the runner writes a shared-context cell."""
    return [
        {
            "model": "m",
            "task": task,
            "policy": policy,
            "budget": budget,
            "stage": "prefill",
            "example_id": f"{context}/{q}",
            "status": "ok",
            "primary_metric": "accuracy",
            "score": score,
            "budget_achieved": budget,
            "prefill_shared": shared and q > 0,
        }
        for context, scores in contexts.items()
        for q, score in enumerate(scores)
    ]


def load(tmp_path: Path, rows: list[dict]) -> pd.DataFrame:
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return load_rows([tmp_path / "s"]).rows


def context_interval(sums: list[float], sizes: list[int]) -> tuple[float, float]:
    """The exact 95 % percentile interval of resampling contexts: every draw of k contexts with replacement, each
    resample's mean over its questions, weighted by how likely the draw is."""
    k = len(sums)
    draws = np.array(list(itertools.product(range(k), repeat=k)))
    means = np.asarray(sums)[draws].sum(axis=1) / np.asarray(sizes)[draws].sum(axis=1)
    order = np.argsort(means)
    cumulative = np.cumsum(np.full(len(draws), 1.0 / len(draws))[order])
    return float(means[order][np.searchsorted(cumulative, 0.025)]), float(
        means[order][np.searchsorted(cumulative, 0.975)]
    )


# Context c0: two questions, both right; context c1: four questions, all wrong. As rows (6 independent samples)
# the 95 % interval of the mean 1/3 is about [0, 0.67]; as the two contexts they are, every resample is c0 c0
# (mean 1), c0 c1 (1/3) or c1 c1 (0): the interval is [0, 1].
CONTEXTS = {"c0": [1.0, 1.0], "c1": [0.0, 0.0, 0.0, 0.0]}


def test_a_cells_interval_resamples_contexts(tmp_path: Path) -> None:
    rows = load(tmp_path, rows_of("h2o", 0.5, CONTEXTS))
    cell = cell_stats(rows, ["score"], 2000).set_index("quantity").loc["score"]
    assert cell["y"] == pytest.approx(1 / 3) and cell["n"] == 6
    assert context_interval([2.0, 0.0], [2, 4]) == (0.0, 1.0)
    assert (cell["ci_low"], cell["ci_high"]) == context_interval([2.0, 0.0], [2, 4])


def test_rows_that_share_no_context_stay_examples_of_their_own(tmp_path: Path) -> None:
    """The same ids without a shared prefill (an ordinary task whose ids hold a slash) are six examples."""
    rows = load(tmp_path, rows_of("h2o", 0.5, CONTEXTS, shared=False))
    cell = cell_stats(rows, ["score"], 2000).set_index("quantity").loc["score"]
    assert cell["ci_high"] < 0.9


def test_paired_and_leaderboard_intervals_resample_contexts(tmp_path: Path) -> None:
    """h2o - full: 0 on context c0's two questions, -1 on c1's four: the difference's interval is the contexts'."""
    full = {"c0": [1.0, 1.0], "c1": [1.0] * 4}
    rows = load(tmp_path, rows_of("full", 1.0, full) + rows_of("h2o", 0.5, CONTEXTS))
    expected = context_interval([0.0, -4.0], [2, 4])
    assert expected == (-1.0, 0.0)
    paired = paired_differences(rows, "score", {"a": "accuracy"}, "full", 2000).set_index("policy").loc["h2o"]
    assert paired["diff"] == pytest.approx(-2 / 3) and (paired["ci_low"], paired["ci_high"]) == expected
    board = paired_over_tasks(rows, "score", "full", policy_facts(rows), 2000).set_index("policy").loc["h2o"]
    assert (board["ci_low"], board["ci_high"]) == expected
    mean = mean_points(rows, "score", policy_facts(rows), 2000).set_index("policy").loc["h2o"]
    assert mean["y"] == pytest.approx(1 / 3) and (mean["ci_low"], mean["ci_high"]) == (0.0, 1.0)


def test_the_interval_matches_the_normal_one_of_context_means(tmp_path: Path) -> None:
    """60 contexts of 5 questions each, the questions of a context alike: the interval is the contexts' (about
    1.96 standard errors of the mean of 60 context means), not 300 rows' (sqrt(5) times narrower)."""
    levels = np.random.default_rng(0).uniform(0, 1, 60)
    rows = load(tmp_path, rows_of("h2o", 0.5, {f"c{i}": [float(v)] * 5 for i, v in enumerate(levels)}))
    cell = cell_stats(rows, ["score"], 4000).set_index("quantity").loc["score"]
    se = levels.std() / np.sqrt(len(levels))
    assert (cell["ci_high"] - cell["ci_low"]) / 2 == pytest.approx(1.96 * se, rel=0.1)
