"""The leaderboard (quality against compression ratio, the mean over tasks, paired differences from a baseline),
quality against tokens/s at a capacity cap, and the coverage section's refused and failed cells."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from kvbench.report.aggregate import cell_stats, quality_column
from kvbench.report.cli import main
from kvbench.report.declared import policy_facts
from kvbench.report.leaderboard import MEAN_TASK, mean_points, paired_over_tasks, task_points
from kvbench.report.leaderboard_plot import leaderboard_figure
from kvbench.report.load import load_rows
from kvbench.report.paired import stratified_bootstrap
from kvbench.report.served import served_points


def example(policy: str, budget: float, score: float, i: int, task: str, achieved: float, stage: str = "prefill"):
    return {
        "model": "m",
        "task": task,
        "policy": policy,
        "budget": budget,
        "stage": stage,
        "example_id": str(i),
        "status": "ok",
        "primary_metric": "accuracy",
        "score": score,
        "budget_achieved": achieved,
    }


def write(directory: Path, rows: list[dict]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return directory


# Two tasks of different sizes: a (4 examples) and b (2 examples).
SCORES = {
    "full": {"a": [1, 1, 1, 0], "b": [0.8, 0.6]},
    "h2o": {"a": [1, 0, 1, 0], "b": [0.4, 0.6]},
    "threshold": {"a": [0, 0, 1, 0], "b": [0.2, 0.2]},
}


def sweep(tmp_path: Path, stage: str = "prefill") -> pd.DataFrame:
    rows = []
    for policy, tasks in SCORES.items():
        budget = 1.0 if policy == "full" else 0.25
        achieved = {"full": 1.0, "h2o": 0.3, "threshold": 0.125}[policy]  # h2o's 0.3: its window's overshoot
        for task, scores in tasks.items():
            rows += [example(policy, budget, s, i, task, achieved, stage) for i, s in enumerate(scores)]
    return load_rows([write(tmp_path / "s", rows)]).rows


def test_stratified_bootstrap_averages_task_means_and_matches_the_normal_interval() -> None:
    mean, low, high = stratified_bootstrap([np.array([1, 0, 1, 1.0]), np.array([0.2, 0.4])], np.random.default_rng(0))
    assert mean == pytest.approx((0.75 + 0.3) / 2)  # tasks weigh alike, not examples (pooled: 3.6 / 6 = 0.6)
    assert low <= mean <= high
    sample = np.random.default_rng(1)
    a, b = sample.normal(0.0, 1.0, 400), sample.normal(5.0, 3.0, 100)
    mean, low, high = stratified_bootstrap([a, b], np.random.default_rng(2), n_boot=4000)
    se = np.sqrt(a.var() / len(a) + b.var() / len(b)) / 2  # the plug-in standard error of (mean a + mean b) / 2
    assert (high - low) / 2 == pytest.approx(1.96 * se, rel=0.08)
    assert (low + high) / 2 == pytest.approx((a.mean() + b.mean()) / 2, abs=0.2 * se)


def test_cells_sit_at_the_ratio_asked_for_and_threshold_cells_where_they_achieved(tmp_path: Path) -> None:
    rows = sweep(tmp_path)
    column, _ = quality_column(rows, None)
    stats = cell_stats(rows, [column], 200)
    facts = policy_facts(rows)
    assert facts["threshold"].thresholded and not facts["h2o"].thresholded
    points = pd.concat([task_points(rows, column, facts, stats), mean_points(rows, column, facts, 200)])
    ratio = points.set_index(["task", "policy"])["ratio"]
    assert ratio[("a", "h2o")] == pytest.approx(4.0)  # asked 1/4; its achieved 0.3 is not where it is placed
    assert ratio[("a", "threshold")] == pytest.approx(8.0)  # a cap: placed at the 1/8 it kept
    means = points[points["task"].eq(MEAN_TASK)].set_index("policy")["y"]
    assert means["h2o"] == pytest.approx((0.5 + 0.5) / 2)
    assert means["threshold"] == pytest.approx((0.25 + 0.2) / 2)
    fig = leaderboard_figure(points, pd.DataFrame(columns=["model", "task", "stage", "policy", "y"]), "prefill", "q")
    (line,) = [ln for ln in fig.axes[2].get_lines() if ln.get_gid() == "threshold"]
    np.testing.assert_allclose(line.get_xydata(), [[8.0, 0.225]])
    assert fig.axes[2].get_xscale() == "log"
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()][:5] == ["2×", "4×", "8×", "16×", "32×"]
    assert "prompt ÷" in fig.axes[0].get_xlabel() and "max_new_tokens" not in fig.axes[0].get_xlabel()


def test_decode_ratio_is_not_called_a_share_of_the_prompt(tmp_path: Path) -> None:
    rows = sweep(tmp_path, stage="decode")
    column, _ = quality_column(rows, None)
    points = task_points(rows, column, policy_facts(rows), cell_stats(rows, [column], 50))
    fig = leaderboard_figure(points, pd.DataFrame(columns=["model", "task", "stage", "policy", "y"]), "decode", "q")
    assert "(prompt + max_new_tokens)\n÷" in fig.axes[0].get_xlabel()


def test_paired_mean_over_tasks_is_the_mean_of_each_tasks_paired_difference(tmp_path: Path) -> None:
    rows = sweep(tmp_path)
    column, _ = quality_column(rows, None)
    table = paired_over_tasks(rows, column, "full", policy_facts(rows), 500).set_index("policy")
    # h2o - full: task a mean([0, -1, 0, 0]) = -0.25; task b mean([-0.4, 0]) = -0.2
    assert table.loc["h2o", "diff"] == pytest.approx((-0.25 - 0.2) / 2)
    assert table.loc["threshold", "diff"] == pytest.approx((mean_diff([0, 0, 1, 0], [1, 1, 1, 0]) - 0.5) / 2)
    assert table.loc["h2o", "n"] == 6 and table.loc["h2o", "tasks"] == 2
    assert table.loc["h2o", "ci_low"] <= table.loc["h2o", "diff"] <= table.loc["h2o", "ci_high"]


def mean_diff(mine: list[float], base: list[float]) -> float:
    return float(np.mean(np.subtract(mine, base)))


def grid_sweep(tmp_path: Path) -> pd.DataFrame:
    """Task a (two examples) and two grids: NIAH at 2 lengths × 3 depths and a RULER subset at 2 lengths, each cell
    of one or two examples, recorded as a sweep records them (``settings``: what each cell changes)."""
    rows = []
    for policy, shift in (("full", 0.0), ("h2o", -0.5)):
        budget = 1.0 if policy == "full" else 0.25
        rows += [example(policy, budget, 1.0 + shift, i, "a", budget) for i in range(2)]
        for length in (1024, 2048):
            for depth in (0, 50, 100):
                score = float(depth == 50 or policy == "full")  # h2o finds the needle at depth 50 only
                cell = example(policy, budget, score, 0, "niah", budget)
                rows.append(cell | {"settings": {"task.context_tokens": length, "task.depth": depth}})
            score = 1.0 if policy == "full" else 0.0 if length == 1024 else 1.0
            for i in range(2 if length == 1024 else 1):
                cell = example(policy, budget, score, i, "ruler/vt", budget)
                rows.append(cell | {"settings": {"task.context_tokens": length}})
    return load_rows([write(tmp_path / "g", rows)]).rows


def test_a_grid_of_lengths_and_depths_is_one_task_of_the_leaderboard(tmp_path: Path) -> None:
    rows = grid_sweep(tmp_path)
    column, _ = quality_column(rows, None)
    facts = policy_facts(rows)
    points = pd.concat(
        [task_points(rows, column, facts, cell_stats(rows, [column], 100)), mean_points(rows, column, facts, 100)]
    ).set_index(["task", "policy"])
    assert sorted(points.index.get_level_values("task").unique()) == sorted(["a", "niah", "ruler/vt", MEAN_TASK])
    # h2o: a 0.5; NIAH 2 of 6 cells 1/3; RULER vt mean over its lengths (0 at 1024, 1 at 2048) 0.5
    assert points.loc[("niah", "h2o"), "y"] == pytest.approx(1 / 3)
    assert points.loc[("ruler/vt", "h2o"), "y"] == pytest.approx(0.5)  # lengths alike, not the 3 examples (1/3)
    assert points.loc[(MEAN_TASK, "h2o"), "y"] == pytest.approx((0.5 + 1 / 3 + 0.5) / 3)
    table = paired_over_tasks(rows, column, "full", facts, 100).set_index("policy")
    assert table.loc["h2o", "tasks"] == 3
    assert table.loc["h2o", "diff"] == pytest.approx((-0.5 - 2 / 3 - 0.5) / 3)


def test_report_has_the_leaderboard_and_its_table_against_the_chosen_baseline(tmp_path: Path) -> None:
    sweep(tmp_path)
    assert main([str(tmp_path / "s"), "--out", str(tmp_path / "r"), "--bootstrap", "50", "--baseline", "h2o"]) == 0
    report = (tmp_path / "r" / "report.md").read_text()
    assert "leaderboard_prefill.png" in report and (tmp_path / "r" / "leaderboard_prefill.png").exists()
    assert "(policy − H2O)" in report and "at 8×" in report
    assert main([str(tmp_path / "s"), "--out", str(tmp_path / "r"), "--baseline", "nope"]) == 2


def test_coverage_leaves_out_refused_cells_and_lists_cells_that_could_not_run(tmp_path: Path) -> None:
    rows = [example(p, 0.5, 1.0, 0, "a", 0.5, s) for p, s in [("h2o", "prefill"), ("h2o", "decode")]]
    rows += [example("snapkv", 0.5, 1.0, 0, "a", 0.5, "prefill")]  # snapkv cannot run in stage=decode
    rows += [example("tova", 0.5, 1.0, 0, "a", 0.5, "prefill")]  # tova can: its decode cell is missing
    root = write(tmp_path / "s", rows)
    (root / "m" / "a" / "tova" / "decode" / "budget=0.5").mkdir(parents=True)
    (root / "m" / "a" / "tova" / "decode" / "budget=0.5" / "error.txt").write_text("Traceback ...\nOSError: disk\n")
    assert main([str(root), "--out", str(tmp_path / "r"), "--bootstrap", "20"]) == 0
    coverage = (tmp_path / "r" / "report.md").read_text().split("## Coverage")[1]
    assert "1 missing cells" in coverage and "| m | a | decode | TOVA | 50% |" in coverage
    assert "SnapKV in stage=decode" in coverage and "| m | a | decode | SnapKV" not in coverage
    assert "m/a/tova/decode/budget=0.5 | OSError: disk" in coverage


def test_a_refused_cell_that_left_an_error_txt_is_listed_once(tmp_path: Path) -> None:
    """A sweep over stages writes the refusal into the refused cell's error.txt (kvbench.run; the message is
    tests/runner/test_validation.py's): it is named with the refused cells, not again with those that could not
    run."""
    rows = [example(p, 0.5, 1.0, 0, "a", 0.5, s) for p, s in [("h2o", "prefill"), ("h2o", "decode")]]
    rows += [example("snapkv", 0.5, 1.0, 0, "a", 0.5, "prefill")]
    root = write(tmp_path / "s", rows)
    refused = root / "m" / "a" / "snapkv" / "decode" / "budget=0.5"
    refused.mkdir(parents=True)
    (refused / "error.txt").write_text(
        "kvbench: policy=snapkv cannot run in stage=decode; use stage in ['prefill', 'both']\n"
    )
    assert main([str(root), "--out", str(tmp_path / "r"), "--bootstrap", "20"]) == 0
    coverage = (tmp_path / "r" / "report.md").read_text().split("## Coverage")[1]
    assert coverage.count("snapkv") + coverage.count("SnapKV") == 1
    assert "SnapKV in stage=decode" in coverage and "could not run" not in coverage


def capacity_row(policy: str, budget: float, batch: int, fits: bool, tokens_per_s: float, stage: str = "prefill"):
    return {
        "model": "m",
        "task": "a",
        "policy": policy,
        "budget": budget,
        "stage": stage,
        "example_id": f"batch={batch}",
        "kind": "capacity",
        "status": "ok",
        "batch": batch,
        "capacity_batch": batch,
        "fits": fits,
        "decode_tokens_per_s": tokens_per_s,
        "capacity_memory_gib": 0.0625,
    }


def test_served_points_take_the_largest_batch_that_fit_and_the_matching_quality(tmp_path: Path) -> None:
    quality = sweep(tmp_path)
    probes = [capacity_row("h2o", 0.25, 1, True, 10.0), capacity_row("h2o", 0.25, 2, True, 18.0)]
    probes += [capacity_row("h2o", 0.25, 4, False, 30.0), capacity_row("full", 1.0, 1, True, 9.0, "both")]
    probes += [capacity_row("h2o", 0.5, 2, True, 15.0)]  # no quality cell at 0.5
    capacity = load_rows([write(tmp_path / "c", probes)]).rows
    column, _ = quality_column(quality, None)
    points, unmatched = served_points(capacity, cell_stats(quality, [column], 50))
    found = points.set_index(["policy", "budget_value"])
    assert found.loc[("h2o", 0.25), "decode_tokens_per_s"] == 18.0  # batch 4 did not fit
    assert found.loc[("h2o", 0.25), "y"] == pytest.approx(np.mean([1, 0, 1, 0]))  # task a only
    assert found.loc[("full", 1.0), "y"] == pytest.approx(np.mean([1, 1, 1, 0]))  # the full cache: any stage
    assert unmatched.values.tolist() == [["m", "a", "prefill", "h2o", 0.5]]


def test_the_ratio_axis_takes_ratios_of_object_dtype() -> None:
    """Cells written by different versions can leave the ratio column of dtype object; the axis still spans them."""
    import matplotlib.pyplot as plt

    from kvbench.report.leaderboard_plot import _ratio_axis

    fig, ax = plt.subplots()
    _ratio_axis(ax, pd.Series([4.0, None, 64.0], dtype=object))
    low, high = ax.get_xlim()
    assert low < 2 and 64 < high
    plt.close(fig)


def test_quest_cells_sit_at_the_share_of_keys_each_query_attends(tmp_path: Path) -> None:
    """Quest holds every token (budget_achieved 1.0) and attends its budget: a 64-token budget over 256 tokens is
    placed at 4×, where h2o holding a quarter is, not at the full cache's 1×."""
    rows = []
    for policy, achieved in (("quest", 1.0), ("h2o", 0.25)):
        for task, scores in SCORES["h2o"].items():
            for i, s in enumerate(scores):
                row = example(policy, 64, s, i, task, achieved, "decode")
                rows.append(row | {"budget_tokens": 64, "seen_tokens": 256})
    rows = load_rows([write(tmp_path / "s", rows)]).rows
    column, _ = quality_column(rows, None)
    stats = cell_stats(rows, [column], 50)
    facts = policy_facts(rows)
    assert facts["quest"].sparse and not facts["h2o"].sparse
    assert stats.set_index("policy")["x"].to_dict() == {"quest": pytest.approx(25.0), "h2o": pytest.approx(25.0)}
    points = pd.concat([task_points(rows, column, facts, stats), mean_points(rows, column, facts, 50)])
    assert points["ratio"].to_numpy() == pytest.approx(4.0)
