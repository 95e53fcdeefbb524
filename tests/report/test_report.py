"""kvbench.report: the plotted numbers, tables and report files, checked without looking at pixels."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from matplotlib.container import ErrorbarContainer
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from kvbench.metrics.registry import register_metric
from kvbench.policies.base import Score
from kvbench.policies.parts import register_score
from kvbench.policies.state import TokenState
from kvbench.report.aggregate import (
    bootstrap,
    cell_stats,
    error_counts,
    missing_cells,
    pareto_mask,
    quality_column,
    with_full_baseline,
)
from kvbench.report.cli import main
from kvbench.report.load import budget_label, load_rows
from kvbench.report.plots import FRONTIER, budget_figure, pareto_figure
from kvbench.report.style import lower_is_better, policy_style
from kvbench.report.tables import quality_markdown

SYSTEMS = {
    "kv_resident_bytes": 1 << 20,
    "kv_capacity_bytes": 1 << 22,
    "peak_memory_bytes": 1 << 30,
    "prefill_s": 0.2,
    "ttft_s": 0.25,
    "decode_ms_mean": 20.0,
    "decode_ms_p50": 19.0,
    "decode_ms_p95": 25.0,
    "decode_tokens_per_s": 50.0,
    "prefill_tokens_per_s": 5000.0,
}


def row(
    policy: str,
    budget: float | int,
    score: float,
    example: str = "0",
    achieved: float | None = None,
    model: str = "m",
    task: str = "retrieval",
    stage: str = "prefill",
    metric: str = "exact_match",
    **extra: object,
) -> dict:
    """One ok result row shaped like the runner's, with the score also under ``metric.<metric>``."""
    record = {
        "model": model,
        "task": task,
        "policy": policy,
        "budget": budget,
        "stage": stage,
        "example_id": example,
        "run_dir": "run",
        "status": "ok",
        "primary_metric": metric,
        "score": score,
        f"metric.{metric}": score,
        "budget_tokens": 100,
        "budget_achieved": achieved if achieved is not None else (budget if budget <= 1 else 0.5),
        "prompt_tokens": 200,
        "new_tokens": 8,
        **SYSTEMS,
    }
    record.update(extra)
    return record


def error_row(policy: str, budget: float, example: str, **identity: str) -> dict:
    base = {"model": "m", "task": "retrieval", "stage": "prefill", **identity}
    return {
        **base,
        "policy": policy,
        "budget": budget,
        "example_id": example,
        "run_dir": "run",
        "status": "error",
        "error": "CUDA out of memory",
    }


def write_rows(directory: Path, rows: list[dict], torn: bool = False) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "rows.jsonl"
    text = "".join(json.dumps(r) + "\n" for r in rows)
    path.write_text(text + ('{"model": "m", "task": "retr' if torn else ""))
    return path


def stats_of(root: Path, metric: str | None = None) -> tuple[pd.DataFrame, str, dict[str, str]]:
    rows = load_rows([root]).rows
    column, names = quality_column(rows, metric)
    stats = with_full_baseline(cell_stats(rows, [column, "kv_resident_bytes", "decode_ms_mean"]))
    return stats, column, names


def policy_line(fig: Figure, policy: str, panel: int = 0) -> Line2D:
    (line,) = [ln for ln in fig.axes[panel].get_lines() if ln.get_gid() == policy]
    return line


def policy_bars(fig: Figure, policy: str, panel: int = 0) -> ErrorbarContainer:
    containers = fig.axes[panel].containers
    (bars,) = [c for c in containers if isinstance(c, ErrorbarContainer) and c.lines[0].get_gid() == policy]
    return bars


def test_line_is_mean_score_against_mean_achieved_budget_sorted(tmp_path: Path) -> None:
    rows = [  # larger budget written first: the line must still run left to right
        row("h2o", 0.5, 1.0, "0", achieved=0.40),
        row("h2o", 0.5, 0.0, "1", achieved=0.50),
        row("h2o", 0.2, 0.2, "0", achieved=0.10),
        row("h2o", 0.2, 0.6, "1", achieved=0.30),
        row("h2o", 0.2, 0.7, "2", achieved=0.20),
    ]
    write_rows(tmp_path / "sweep", rows)
    stats, column, _ = stats_of(tmp_path / "sweep")
    quality = stats[stats["quantity"].eq(column)]
    line = policy_line(budget_figure(quality, "prefill", "exact_match"), "h2o")
    np.testing.assert_allclose(line.get_xydata(), [[20.0, 0.5], [45.0, 0.5]])
    assert sorted(quality["n"]) == [2, 3]


def test_error_bars_are_the_bootstrap_interval(tmp_path: Path) -> None:
    scores = [0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0]
    write_rows(tmp_path / "s", [row("snapkv", 0.25, s, str(i)) for i, s in enumerate(scores)])
    stats, column, _ = stats_of(tmp_path / "s")
    cell = stats[stats["quantity"].eq(column)].iloc[0]
    assert cell["y"] == pytest.approx(np.mean(scores))
    assert cell["ci_low"] < cell["y"] < cell["ci_high"]
    fig = budget_figure(stats[stats["quantity"].eq(column)], "prefill", "exact_match")
    (segment,) = policy_bars(fig, "snapkv").lines[2][0].get_segments()
    np.testing.assert_allclose(segment, [[25.0, cell["ci_low"]], [25.0, cell["ci_high"]]])


def test_bootstrap_contains_mean_shrinks_and_collapses_on_constant_data() -> None:
    sample = np.random.default_rng(1).normal(0.5, 0.2, size=2000)
    mean_s, low_s, high_s, n_s = bootstrap(sample[:20], np.random.default_rng(0))
    mean_l, low_l, high_l, n_l = bootstrap(sample, np.random.default_rng(0))
    assert low_s[0] <= mean_s[0] <= high_s[0] and low_l[0] <= mean_l[0] <= high_l[0]
    assert (high_l - low_l)[0] < (high_s - low_s)[0] / 4
    assert (n_s[0], n_l[0]) == (20, 2000)
    mean_c, low_c, high_c, _ = bootstrap(np.full(7, 0.3), np.random.default_rng(0))
    assert low_c[0] == mean_c[0] == high_c[0]
    again = bootstrap(sample[:20], np.random.default_rng(0))
    assert (again[1][0], again[2][0]) == (low_s[0], high_s[0])


def test_full_cache_is_a_dashed_line_in_every_stage(tmp_path: Path) -> None:
    rows = [row("full", 1.0, 0.8, "0"), row("full", 1.0, 1.0, "1")]
    rows += [row("h2o", 0.5, 0.4, "0", stage=stage) for stage in ("prefill", "decode")]
    write_rows(tmp_path / "s", rows)
    stats, column, _ = stats_of(tmp_path / "s")
    for stage in ("prefill", "decode"):
        fig = budget_figure(stats[stats["quantity"].eq(column)], stage, "exact_match")
        full = policy_line(fig, "full")
        assert full.get_linestyle() == "--"
        np.testing.assert_allclose(full.get_ydata(), [0.9, 0.9])
        assert not [c for c in fig.axes[0].containers if c.lines[0].get_gid() == "full"]
    assert missing_cells(load_rows([tmp_path / "s"]).rows).empty


def test_policy_keeps_its_colour_and_roco_is_emphasised(tmp_path: Path) -> None:
    policies = ["h2o", "roco", "my_new_policy"]
    rows = [row(p, b, 0.5, stage=s) for p in policies for b in (0.2, 0.5) for s in ("prefill", "decode")]
    write_rows(tmp_path / "s", rows)
    stats, column, _ = stats_of(tmp_path / "s")
    figures = [
        budget_figure(stats[stats["quantity"].eq(column)], "prefill", "q"),
        budget_figure(stats[stats["quantity"].eq("kv_resident_bytes")], "decode", "bytes"),
    ]
    colours = [{p: policy_line(f, p).get_color() for p in policies} for f in figures]
    markers = [{p: policy_line(f, p).get_marker() for p in policies} for f in figures]
    assert colours[0] == colours[1] and markers[0] == markers[1]
    assert len(set(colours[0].values())) == 3
    assert colours[0]["my_new_policy"] == policy_style("my_new_policy").color
    lines = {p: policy_line(figures[0], p) for p in policies}
    assert lines["roco"].get_linewidth() > max(lines[p].get_linewidth() for p in ("h2o", "my_new_policy"))
    assert lines["roco"].get_zorder() > max(lines[p].get_zorder() for p in ("h2o", "my_new_policy"))


def test_a_new_policy_named_after_its_score_is_labelled_as_the_score_declares(tmp_path: Path) -> None:
    @register_score("keydiff_like")
    class KeyDiffLike(Score):
        label = "KeyDiff-like"

        def __call__(self, state: TokenState) -> torch.Tensor:
            return state.positions.float()

    write_rows(tmp_path / "s", [row(p, 0.5, 0.5) for p in ("keydiff_like", "my_new_policy")])
    stats, column, _ = stats_of(tmp_path / "s")
    figure = budget_figure(stats[stats["quantity"].eq(column)], "prefill", "q")
    legends = [*figure.legends, *(ax.get_legend() for ax in figure.axes if ax.get_legend())]
    assert {t.get_text() for legend in legends for t in legend.get_texts()} >= {"KeyDiff-like", "my_new_policy"}


def test_markdown_bolds_best_per_column_in_the_metric_direction(tmp_path: Path) -> None:
    rows = []
    for task, metric, values in (("xsum", "rougeL", (0.3, 0.6)), ("fid", "fidelity_kl", (0.1, 0.7))):
        for policy, value in zip(("h2o", "snapkv"), values):
            rows += [row(policy, b, value + b, task=task, metric=metric) for b in (0.25, 0.5)]
        rows.append(row("full", 1.0, 0.0 if metric.endswith("kl") else 1.0, task=task, metric=metric))
    write_rows(tmp_path / "s", rows)
    stats, column, names = stats_of(tmp_path / "s")
    markdown = quality_markdown(stats[stats["quantity"].eq(column)], names)
    fid, xsum = markdown.split("**m · xsum · prefill**")
    assert "| SnapKV | **0.850** | **1.100** | – |" in xsum and "| H2O | 0.550 | 0.800 | – |" in xsum
    # fidelity_kl: lower is better
    assert "| H2O | **0.350** | **0.600** | – |" in fid and "| SnapKV | 0.950 | 1.200 | – |" in fid
    assert "| Full cache | – | – | 1.000 |" in xsum and "| Full cache | – | – | 0.000 |" in fid  # never bold


def test_direction_and_label_come_from_the_metric_registry(tmp_path: Path) -> None:
    """A declared lower-is-better metric whose name says nothing of it is bolded at its minimum and headed by its
    label; an undeclared name, even one ending in "loss", is read as higher-is-better and the heading says so."""
    register_metric("tokens_wasted", higher_is_better=False, label="Tokens wasted")
    rows = []
    for task, metric in (("a", "tokens_wasted"), ("b", "undeclared_loss")):
        for policy, value in (("h2o", 0.2), ("snapkv", 0.7)):
            rows += [row(policy, b, value + b, task=task, metric=metric) for b in (0.25, 0.5)]
    write_rows(tmp_path / "s", rows)
    stats, column, names = stats_of(tmp_path / "s")
    declared, undeclared = quality_markdown(stats[stats["quantity"].eq(column)], names).split("**m · b · prefill**")
    assert declared.startswith("**m · a · prefill** — Tokens wasted (lower is better)")
    assert "| H2O | **0.450** | **0.700** |" in declared and "| SnapKV | 0.950 | 1.200 |" in declared
    assert "undeclared_loss (higher is better: assumed, 'undeclared_loss' is not a declared metric)" in undeclared
    assert "| SnapKV | **0.950** | **1.200** |" in undeclared and "| H2O | 0.450 | 0.700 |" in undeclared
    assert (lower_is_better("tokens_wasted"), lower_is_better("undeclared_loss")) == (True, False)


def test_report_headings_use_declared_labels(tmp_path: Path) -> None:
    write_rows(tmp_path / "s", [row("h2o", b, 0.5, task="xsum", metric="rougeL") for b in (0.25, 0.5)])
    stats, column, names = stats_of(tmp_path / "s")
    markdown = quality_markdown(stats[stats["quantity"].eq(column)], names)
    assert markdown.startswith("**m · xsum · prefill** — ROUGE-L (higher is better)")


def test_torn_last_line_is_skipped(tmp_path: Path) -> None:
    write_rows(tmp_path / "s", [row("h2o", 0.5, 0.1, str(i)) for i in range(3)], torn=True)
    loaded = load_rows([tmp_path / "s"])
    assert len(loaded.rows) == 3 and loaded.bad_lines == 1


def test_retried_example_keeps_its_ok_row(tmp_path: Path) -> None:
    write_rows(tmp_path / "a", [error_row("h2o", 0.5, "0")])
    write_rows(tmp_path / "b", [row("h2o", 0.5, 0.7, "0")])
    loaded = load_rows([tmp_path, tmp_path / "a"])  # the same file reached twice is read once
    assert len(loaded.files) == 2 and loaded.duplicates == 1
    assert loaded.rows["status"].tolist() == ["ok"]


def test_two_sweep_directories_are_merged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_rows(tmp_path / "sweep1" / "cell", [row("h2o", b, 0.3) for b in (0.2, 0.5)] + [row("full", 1.0, 0.9)])
    write_rows(tmp_path / "sweep2" / "x" / "cell", [row("tova", b, 0.4) for b in (0.2, 0.5)])
    monkeypatch.chdir(tmp_path)
    assert main(["sweep1", "sweep2", "--bootstrap", "50"]) == 0
    table = pd.read_csv(tmp_path / "report" / "quality_table.csv")
    assert table["policy"].tolist() == ["full", "h2o", "tova"]
    assert table.columns.tolist()[-3:] == ["20%", "50%", "100%"]
    assert "No missing cells" in (tmp_path / "report" / "report.md").read_text()


def test_partial_sweep_lists_missing_cells_and_counts_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = [
        row(p, b, 0.5, str(i))
        for p in ("h2o", "snapkv")
        for b in (0.2, 0.5)
        for i in range(3)
        if (p, b) != ("snapkv", 0.5)
    ]
    rows += [error_row("h2o", 0.2, "3"), row("h2o", 0.2, 0.5, "0", task="xsum", metric="rougeL")]
    write_rows(tmp_path / "sweep", rows)
    assert main([str(tmp_path / "sweep"), "--bootstrap", "50"]) == 0
    report = (tmp_path / "sweep" / "report" / "report.md").read_text()
    coverage = report.split("## Coverage")[1]
    for cell in (
        "| m | retrieval | prefill | SnapKV | 50% |",
        "| m | xsum | prefill | H2O | 50% |",
        "| m | xsum | prefill | SnapKV | 20% |",
        "| m | xsum | prefill | SnapKV | 50% |",
    ):
        assert cell in coverage
    assert "4 missing cells" in coverage
    assert "dashed line" not in report  # no full-cache cell, so no dashed line to explain
    assert "| m | retrieval | prefill | H2O | 20% | 3 | 1 | CUDA out of memory |" in coverage
    assert "m / retrieval / prefill / snapkv / 50%" in capsys.readouterr().err
    rows_read = load_rows([tmp_path / "sweep"]).rows
    assert error_counts(rows_read)[["ok", "errors"]].values.tolist() == [[3, 1]]
    counts = cell_stats(rows_read, ["score"]).set_index(["task", "policy", "budget"])["n"]
    assert counts[("retrieval", "h2o", "20%")] == 3


def test_cli_writes_png_pdf_csv_and_markdown(tmp_path: Path) -> None:
    rows = [row(p, b, 0.1 * i + b, str(i)) for p in ("h2o", "roco") for b in (0.2, 0.5) for i in range(4)]
    write_rows(tmp_path / "sweep", rows + [row("full", 1.0, 0.9)])
    out = tmp_path / "out"
    assert main([str(tmp_path / "sweep"), "--out", str(out), "--bootstrap", "100"]) == 0
    report = (out / "report.md").read_text()
    for stem in (
        "quality_vs_budget_prefill",
        "kv_resident_vs_budget_prefill",
        "peak_memory_vs_budget_prefill",
        "decode_tokens_per_s_vs_budget_prefill",
        "ttft_vs_budget_prefill",
        "pareto_memory_prefill",
        "pareto_latency_prefill",
    ):
        assert (out / f"{stem}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert (out / f"{stem}.pdf").read_bytes()[:5] == b"%PDF-"
        assert f"]({stem}.png)" in report
    assert "| RoCo |" in report and (out / "quality_table.md").exists()
    assert "the dashed line is the full cache" in report
    assert set(pd.read_csv(out / "quality_table.csv")["policy"]) == {"full", "h2o", "roco"}
    assert set(pd.read_csv(out / "cells.csv")["quantity"]) >= {"score", "kv_resident_bytes", "ttft_s"}


def test_metric_option_plots_another_metric(tmp_path: Path) -> None:
    write_rows(tmp_path / "s", [row("h2o", 0.5, 1.0, str(i), **{"metric.fidelity_top1": 0.25 * i}) for i in range(3)])
    stats, column, names = stats_of(tmp_path / "s", metric="fidelity_top1")
    assert column == "metric.fidelity_top1" and names == {"retrieval": "fidelity_top1"}
    assert stats.loc[stats["quantity"].eq(column), "y"].tolist() == [pytest.approx(0.25)]
    assert main([str(tmp_path / "s"), "--metric", "no_such_metric"]) == 2


def test_pareto_frontier_marks_non_dominated_points(tmp_path: Path) -> None:
    assert pareto_mask([1, 2, 3, 2], [0.5, 0.4, 0.9, 0.7]).tolist() == [True, False, True, True]
    assert pareto_mask([1, 2, 3], [0.5, 0.4, 0.9], higher_is_better=False).tolist() == [True, True, False]
    rows = [
        row("h2o", 0.5, 0.6, kv_resident_bytes=2 << 20),
        row("h2o", 0.2, 0.3, kv_resident_bytes=1 << 20),
        row("tova", 0.5, 0.5, kv_resident_bytes=2 << 20),
        row("full", 1.0, 0.9, kv_resident_bytes=4 << 20),
    ]
    write_rows(tmp_path / "s", rows)
    stats, column, _ = stats_of(tmp_path / "s")
    fig = pareto_figure(
        stats[stats["quantity"].eq(column)],
        stats[stats["quantity"].eq("kv_resident_bytes")],
        "prefill",
        "bytes",
        "exact_match",
        {"retrieval": True},
    )
    frontier = policy_line(fig, FRONTIER).get_xydata()
    np.testing.assert_allclose(frontier, [[1 << 20, 0.3], [2 << 20, 0.6], [4 << 20, 0.9]])
    np.testing.assert_allclose(policy_line(fig, "tova").get_xydata(), [[2 << 20, 0.5]])


def test_budget_labels_and_figure_sizes() -> None:
    assert [budget_label(b) for b in (0.5, 1.0, 0.125, 512, "0.25")] == ["50%", "100%", "12.5%", "512 tok", "25%"]
    stats = pd.DataFrame(
        [
            {
                "model": "m",
                "task": t,
                "stage": "prefill",
                "policy": "h2o",
                "budget": "50%",
                "x": 50.0,
                "y": 0.5,
                "ci_low": 0.4,
                "ci_high": 0.6,
                "n": 3,
            }
            for t in ("a", "b")
        ]
    )
    assert budget_figure(stats[stats["task"].eq("a")], "prefill", "q").get_figwidth() == pytest.approx(3.3)
    wide = budget_figure(stats, "prefill", "q")
    assert wide.get_figwidth() == pytest.approx(6.9)
    assert min(t.get_fontsize() for ax in wide.axes for t in ax.get_xticklabels()) >= 7
