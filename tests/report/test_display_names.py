"""One name per policy everywhere a reader sees it: the quality tables, the paired tables, the coverage section, the
figures' legends (the display names of kvbench.report.labels); and ``--baseline`` / ``--paired`` given either name."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvbench.report.aggregate import cell_stats, quality_column
from kvbench.report.cli import main
from kvbench.report.load import load_rows
from kvbench.report.plots import budget_figure


def row(policy: str, budget: float, score: float, example: str, stage: str = "prefill") -> dict:
    return {
        "model": "m",
        "task": "a",
        "policy": policy,
        "budget": budget,
        "stage": stage,
        "example_id": example,
        "status": "ok",
        "primary_metric": "accuracy",
        "score": score,
        "budget_achieved": budget,
    }


def sweep(tmp_path: Path) -> Path:
    """The full cache, snapkv (prompt only: refused in stage=decode) and h2o in both stages, one budget short."""
    rows = [row("full", 1.0, 1.0, e) for e in "abc"]
    rows += [row("snapkv", b, s, e) for b in (0.25, 0.5) for e, s in zip("abc", (1.0, 0.0, 1.0))]
    rows += [row("h2o", b, 0.0, e, stage) for b in (0.25, 0.5) for e in "abc" for stage in ("prefill", "decode")]
    rows = [r for r in rows if not (r["policy"] == "h2o" and r["stage"] == "decode" and r["budget"] == 0.5)]
    directory = tmp_path / "s"
    directory.mkdir()
    (directory / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return directory


def table_names(markdown: str) -> set[str]:
    """The first cell of every body row of every markdown table."""
    return {m.group(1) for m in re.finditer(r"^\| ([^|]+?) \|(?!---)", markdown, re.M)} - {"policy", "model"}


def test_tables_coverage_and_legends_name_policies_alike(tmp_path: Path) -> None:
    root = sweep(tmp_path)
    out = tmp_path / "r"
    assert main([str(root), "--out", str(out), "--bootstrap", "20", "--paired", "snapkv"]) == 0
    report = (out / "report.md").read_text()
    tables = (out / "quality_table.md").read_text()
    assert table_names(tables) == {"Full cache", "SnapKV", "H2O"}
    assert "## Paired differences against SnapKV" in report and "**m · a · prefill** − SnapKV" in report
    paired = report.split("## Paired differences")[1].split("## Coverage")[0]
    assert table_names(paired) == {"H2O"}
    coverage = report.split("## Coverage")[1]
    assert "SnapKV in stage=decode" in coverage and "| m | a | decode | H2O | 50% |" in coverage
    for raw in ("snapkv", "h2o", "full"):
        assert not re.search(rf"\| {raw} \||− {raw}\b|against {raw}\b|{raw} in stage", report)
    rows = load_rows([root]).rows
    column, _ = quality_column(rows, None)
    stats = cell_stats(rows, [column], 20)
    figure = budget_figure(stats[stats["quantity"].eq(column)], "prefill", "q")
    legends = [*figure.legends, *(ax.get_legend() for ax in figure.axes if ax.get_legend())]
    assert {t.get_text() for legend in legends for t in legend.get_texts()} == table_names(tables)


@pytest.mark.parametrize("given", ["snapkv", "SnapKV", "SNAPKV", "snapKV"])
def test_baseline_and_paired_take_either_name_in_any_case(tmp_path: Path, given: str) -> None:
    root, out = sweep(tmp_path), tmp_path / "r"
    assert main([str(root), "--out", str(out), "--bootstrap", "20", "--baseline", given, "--paired", given]) == 0
    report = (out / "report.md").read_text()
    assert "(policy − SnapKV)" in report and "## Paired differences against SnapKV" in report
    assert (out / "leaderboard_paired_snapkv.csv").exists() and (out / "paired_snapkv.csv").exists()


def test_an_unknown_baseline_is_one_error_listing_the_valid_names(tmp_path: Path, capsys) -> None:
    root, out = sweep(tmp_path), tmp_path / "r"
    assert main([str(root), "--out", str(out), "--baseline", "snap"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--baseline snap" in err
    for name in ("full (Full cache)", "h2o (H2O)", "snapkv (SnapKV)"):
        assert name in err
    assert not out.exists()
