"""A cell is everything that changes its rows: each value of an ablation sweep is a cell of its own, in a directory
that says what it changes of its named defaults; each resumes, is refused when its config changed under it, and
the report tells them apart."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pandas as pd
import pytest
import yaml
from conftest import CONFIG_DIR
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from kvbench.report.build import build_report
from kvbench.runner import example
from kvbench.runner.paths import MAX_SEGMENT, segment

pytest_plugins = ["sweeping"]  # the sweep_in_process fixture


def cell_dir(*overrides: str) -> str:
    """The directory Hydra would give the cell of ``overrides`` (below the sweep)."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return str(compose("config", overrides=list(overrides), return_hydra_config=True).hydra.sweep.subdir)


@pytest.mark.parametrize(
    "overrides, path",
    [
        (["policy=h2o", "budget=0.25"], "smollm2-135m/retrieval/h2o/prefill/budget=0.25"),
        (["policy=full", "budget=0.3", "stage=decode"], "smollm2-135m/retrieval/full/decode/budget=full"),
        (
            ["task=longbench", "task.subset=qasper", "policy=snapkv"],
            "smollm2-135m/longbench-qasper/snapkv/prefill/budget=0.5",
        ),
        (["model=gemma3-270m", "policy=profiled/snapkv"], "gemma3-270m/retrieval/snapkv_profiled/prefill/budget=0.5"),
        (["policy=window", "batch_size=4"], "smollm2-135m/retrieval/window/prefill/budget=0.5/batch=4"),
        # A decode schedule and a policy per phase are policy settings; the smallest ratios are budgets like any.
        (
            ["policy=snapkv", "policy.decode=h2o", "policy.interval=8", "stage=both"],
            "smollm2-135m/retrieval/snapkv/interval=8,decode=h2o/both/budget=0.5",
        ),
        (["policy=h2o", "budget=0.03125"], "smollm2-135m/retrieval/h2o/prefill/budget=0.03125"),
        # Settings given at their defaults, and the keys that say where results go or how they are tracked.
        (
            ["policy=h2o", "policy.quantize=none", "policy.scope.window=0.5", "task.n=10"],
            "smollm2-135m/retrieval/h2o/prefill/budget=0.5",
        ),
        (
            [
                "results_dir=elsewhere",
                "sweep_name=s",
                "print_table=false",
                "tracking.wandb.mode=offline",
                "model.cache_dir=/c",
            ],
            "smollm2-135m/retrieval/full/prefill/budget=full",
        ),
    ],
)
def test_a_cell_at_its_named_defaults_keeps_the_plain_path(overrides, path):
    assert cell_dir(*overrides) == path


def test_what_a_cell_changes_follows_the_name_it_changes():
    assert cell_dir(
        "model=tiny-llama",
        "model.dtype=bfloat16",
        "task=retrieval",
        "task.n=4",
        "policy=h2o",
        "policy.scope.window=0.75",
        "policy.quantize=int8",
        "+policy.score.unused=1",
        "stage=both",
        "max_new_tokens=8",
        "sampling.temperature=0.5",
    ) == (
        "tiny-llama/dtype=bfloat16/retrieval/n=4/h2o/scope.window=0.75,quantize=int8,score.unused=1/both/budget=0.5/"
        "max_new_tokens=8,sampling.temperature=0.5"
    )
    # However a setting is given (a preset, the command line), the cell is the same.
    smoke = ["model=tiny-llama", "task.n=2", "task.context_tokens=192", "task.max_new_tokens=6", "policy=window"]
    assert cell_dir("experiment=smoke", "policy=window") == cell_dir(*smoke)
    assert cell_dir(*smoke) == "tiny-llama/retrieval/n=2,context_tokens=192,max_new_tokens=6/window/prefill/budget=0.5"


def test_a_policy_from_another_config_directory_is_measured_against_its_own_file(tmp_path):
    (tmp_path / "policy").mkdir()
    (tmp_path / "policy" / "mine.yaml").write_text(
        "name: mine\nscore: none\nscope:\n  kind: sinks_window\n  window: 4\n"
    )
    found = f"hydra.searchpath=[file://{tmp_path}]"
    assert cell_dir(found, "policy=mine") == "smollm2-135m/retrieval/mine/prefill/budget=0.5"
    assert (
        cell_dir(found, "policy=mine", "policy.scope.window=8")
        == "smollm2-135m/retrieval/mine/scope.window=8/prefill/budget=0.5"
    )


def test_a_long_or_odd_change_is_shortened_and_hashed():
    assert segment({"path": "a.jsonl", "n": 3}) == "path=a.jsonl,n=3"
    odd = segment({"path": "/data/qa/a.jsonl"})
    assert odd.startswith("path=_data_qa_a.jsonl~") and odd == segment({"path": "/data/qa/a.jsonl"})
    assert odd != segment({"path": "/data/qa_a.jsonl"})  # the readable part alike, the hash not
    long = {f"option_{i}": 0.125 for i in range(12)}
    shortened = segment(long)
    assert len(shortened) <= MAX_SEGMENT and shortened.startswith("option_0=0.125,option_1=0.125")
    assert shortened != segment({**long, "option_11": 0.25})
    assert segment({"depths": [0.1, 0.9]}) != segment({"depths": [0.1, 0.5]})


def write_prompts(path: Path, prefix: str) -> Path:
    lines = [
        {"id": f"{prefix}{i}", "prompt": f"Item {i} of list {prefix}: say it.", "reference": "it"} for i in range(2)
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_an_ablation_sweep_runs_every_cell_resumes_and_the_report_tells_them_apart(
    tmp_path, monkeypatch, sweep_in_process
):
    """policy.scope.window x policy.quantize x two task.path files: twelve cells, each with its rows."""
    a, b = write_prompts(tmp_path / "a.jsonl", "a"), write_prompts(tmp_path / "b.jsonl", "b")
    grid = [
        "model=tiny-llama",
        "task=jsonl",
        f"task.path={a},{b}",
        "task.max_new_tokens=3",
        "policy=h2o",
        "policy.scope.window=0.5,0.75",
        "policy.quantize=none,int8,fp8",
        "budget=0.5",
    ]
    calls = []
    real = example.generation_outcome
    monkeypatch.setattr(example, "generation_outcome", lambda *a, **k: calls.append(a[3].id) or real(*a, **k))
    code, _, err = sweep_in_process(*grid, sweep_name="ablation")
    assert code == 0, err[-3000:]
    sweep = tmp_path / "ablation"
    variants = ["", "quantize=int8", "quantize=fp8", "scope.window=0.75"]
    variants += ["scope.window=0.75,quantize=int8", "scope.window=0.75,quantize=fp8"]
    tasks = [segment({"path": str(path), "max_new_tokens": 3}) for path in (a, b)]
    expected = {
        "/".join(part for part in ("tiny-llama/jsonl", task, "h2o", variant, "prefill/budget=0.5") if part)
        for task in tasks
        for variant in variants
    }
    done = {str(p.parent.relative_to(sweep)) for p in sweep.rglob("summary.json")}
    assert done == expected and len(calls) == 24
    for name in expected:
        rows = [json.loads(line) for line in (sweep / name / "rows.jsonl").read_text().splitlines()]
        assert [r["status"] for r in rows] == ["ok", "ok"]
        settings = rows[0]["settings"]
        assert settings["task.path"] in (str(a), str(b)) and settings["task.max_new_tokens"] == 3
        assert ("policy.scope.window" in settings) == ("scope.window=0.75" in name)
        assert ("policy.quantize" in settings) == ("quantize=" in name)
    # The quantised cells hold less KV than the others: the values really ran.
    bytes_of = {
        name: json.loads((sweep / name / "summary.json").read_text())["mean.kv_resident_bytes"] for name in done
    }
    plain, int8 = sorted(n for n in done if "quantize" not in n)[0], sorted(n for n in done if "int8" in n)[0]
    assert bytes_of[int8] < bytes_of[plain]

    # Each cell resumes: a rerun skips the finished ones and completes the one that lost a row.
    cut = sweep / sorted(expected)[3]
    (cut / "summary.json").unlink()
    kept = (cut / "rows.jsonl").read_text().splitlines(keepends=True)[:1]
    (cut / "rows.jsonl").write_text("".join(kept))
    calls.clear()
    code, _, err = sweep_in_process(*grid, sweep_name="ablation")
    assert code == 0 and len(calls) == 1, err[-3000:]
    assert json.loads((cut / "summary.json").read_text())["n_ok"] == 2

    # The same directory with a changed config (as if h2o's default n_sink had changed since) is refused.
    recorded = yaml.safe_load((cut / "config.yaml").read_text())
    recorded["policy"]["scope"]["n_sink"] = 1
    (cut / "config.yaml").write_text(yaml.safe_dump(recorded, sort_keys=False))
    calls.clear()
    code, _, err = sweep_in_process(*grid, sweep_name="ablation")
    assert code == 1 and calls == [] and "1 cell(s) could not run" in err
    assert "holds results of a different config (policy.scope.n_sink: 1 -> 0)" in (cut / "error.txt").read_text()

    # The report keeps the twelve cells apart and names each by what it changes.
    build_report([sweep], tmp_path / "report", n_boot=50, log=io.StringIO())
    cells = pd.read_csv(tmp_path / "report" / "cells.csv")
    quality = cells[cells["quantity"].eq("score")]
    assert len(quality) == 12 and set(quality["n"]) == {2}
    assert set(quality["task"]) == {f"jsonl (path={a})", f"jsonl (path={b})"}
    assert set(quality["policy"]) == {
        "h2o",
        "h2o (quantize=int8)",
        "h2o (quantize=fp8)",
        "h2o (window=0.75)",
        "h2o (window=0.75, quantize=int8)",
        "h2o (window=0.75, quantize=fp8)",
    }
    report = (tmp_path / "report" / "report.md").read_text()
    assert "Every cell changes these of its named defaults: `task.max_new_tokens=3`." in report
    assert "| H2O (window=0.75, quantize=int8) |" in report  # the display name, as in the figures


def test_a_budget_of_one_in_thirty_two_runs_and_is_reported(tmp_path, sweep_in_process):
    """32:1 on a 256-token prompt: every policy's cell runs, its rows hold ⌈prompt / 32⌉ tokens, the report shows it."""
    grid = ["model=tiny-llama", "task.n=1", "task.context_tokens=256", "task.max_new_tokens=3"]
    code, _, err = sweep_in_process(*grid, "policy=window,streamingllm,h2o", "budget=0.03125", sweep_name="ratios")
    assert code == 0, err[-3000:]
    rows = [json.loads(p.read_text()) for p in sorted((tmp_path / "ratios").rglob("rows.jsonl"))]
    assert len(rows) == 3
    for row in rows:
        assert row["status"] == "ok" and row["budget"] == 0.03125 and "budget=0.03125" in row["run_dir"]
        assert row["budget_tokens"] == -(-row["prompt_tokens"] // 32)
        assert row["kept_tokens"] == row["budget_tokens"] + row["new_tokens"] - 1
    build_report([tmp_path / "ratios"], tmp_path / "report", n_boot=20, log=io.StringIO())
    assert "| 3.125% |" in (tmp_path / "report" / "report.md").read_text()  # the budget column, in percent
