"""Cells that differ in a setting are named apart, drawn apart and never averaged together."""

from __future__ import annotations

import json

import pandas as pd

from kvbench.report.aggregate import cell_stats, missing_cells
from kvbench.report.labels import label_cells, shared_settings
from kvbench.report.load import load_rows
from kvbench.report.style import is_baseline, policy_style, sort_policies


def cell_rows(policy: str, settings: dict, score: float, batch: int = 1, task: str = "jsonl") -> list[dict]:
    return [
        {
            "model": "m",
            "task": task,
            "policy": policy,
            "budget": 1.0 if policy == "full" else 0.5,
            "stage": "prefill",
            "batch_size": batch,
            "settings": settings,
            "example_id": str(i),
            "status": "ok",
            "score": score,
            "budget_achieved": 0.5,
        }
        for i in range(3)
    ]


def test_labels_name_what_sets_cells_apart_and_leave_out_what_all_share():
    shared = {"task.n": 3}
    rows = pd.DataFrame(
        cell_rows("h2o", shared, 0.1)
        + cell_rows("h2o", {**shared, "policy.scope.window": 0.75, "policy.quantize": "int8"}, 0.2)
        + cell_rows("snapkv", {**shared, "policy.score.window": 16, "policy.scope.window": 16}, 0.3)
        + cell_rows("h2o", {**shared, "task.path": "b.jsonl", "max_new_tokens": 8}, 0.4, batch=2)
    )
    assert shared_settings(rows) == [("task.n", "3")]
    labelled = label_cells(rows).drop_duplicates(["task", "policy"])
    assert labelled[["task", "policy"]].values.tolist() == [
        ["jsonl", "h2o"],
        # window is two keys here, so each keeps the part that tells them apart
        ["jsonl", "h2o (scope.window=0.75, quantize=int8)"],
        ["jsonl", "snapkv (score.window=16, scope.window=16)"],
        ["jsonl (path=b.jsonl)", "h2o (max_new_tokens=8, batch 2)"],
    ]
    # Rows from before settings were recorded keep their names.
    old = pd.DataFrame(cell_rows("h2o", {}, 0.1)).drop(columns="settings")
    assert label_cells(old)["policy"].unique().tolist() == ["h2o"]
    # ... and a rerun of their sweep, which records what all its cells share, names its cells as they were.
    rerun = pd.DataFrame(cell_rows("h2o", {"task.n": 5}, 0.1))
    both = label_cells(pd.concat([old, rerun], ignore_index=True))
    assert both[["task", "policy"]].drop_duplicates().values.tolist() == [["jsonl", "h2o"]]


def test_variants_are_aggregated_apart_and_styled_as_their_policy(tmp_path):
    for name, settings, score in [("a", {}, 0.25), ("b", {"policy.quantize": "int8"}, 0.75), ("c", {}, 1.0)]:
        policy = "full" if name == "c" else "h2o"
        lines = [
            json.dumps(r)
            for r in cell_rows(policy, {**settings, "policy.quantize": "fp8"} if name == "c" else settings, score)
        ]
        (tmp_path / name).mkdir()
        (tmp_path / name / "rows.jsonl").write_text("\n".join(lines) + "\n")
    rows = load_rows([tmp_path]).rows
    stats = cell_stats(rows, ["score"], n_boot=20)
    assert dict(zip(stats["policy"], stats["y"])) == {
        "h2o": 0.25,
        "h2o (quantize=int8)": 0.75,
        "full (quantize=fp8)": 1.0,
    }
    # A quantised full cache is a reference, not an evicting policy missing its budgets.
    assert missing_cells(rows).empty
    assert is_baseline("full (quantize=fp8)") and not is_baseline("h2o (quantize=int8)")
    assert sort_policies(stats["policy"]) == ["full (quantize=fp8)", "h2o", "h2o (quantize=int8)"]
    base, variant = policy_style("h2o"), policy_style("h2o (quantize=int8)")
    assert variant.label == "H2O (quantize=int8)" and variant.marker == base.marker and variant.color != base.color
    assert policy_style("h2o (quantize=int8)") == variant  # the same everywhere
