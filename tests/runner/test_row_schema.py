"""The row schema: every column a cell writes is declared there, the names readers use are columns, and rows in
the shapes earlier versions wrote still load."""

from __future__ import annotations

import json

import pytest
from conftest import CONFIG_DIR, REPO
from hydra import compose, initialize_config_dir

from kvbench.report.load import load_rows
from kvbench.results import schema
from kvbench.results.schema import COLUMNS, MEAN_PREFIX, METRIC_PREFIX
from kvbench.results.writer import read_rows
from kvbench.runner import example
from kvbench.runner.cell import run_cell

# A row from before batching and capacity cells: no batch_size, no kind (results/example has such rows).
OLD_ROW = {
    "model": "smollm2-135m",
    "task": "retrieval",
    "policy": "h2o",
    "budget": 0.75,
    "stage": "prefill",
    "run_dir": "example/smollm2-135m/retrieval/h2o/prefill/budget=0.75",
    "sweep": "example",
    "example_id": "passkey-0",
    "status": "ok",
    "primary_metric": "accuracy",
    "score": 1.0,
    "metric.accuracy": 1.0,
    "budget_achieved": 0.75,
    "kv_resident_bytes": 35573760,
    "decode_tokens_per_s": 14.99,
}


def cfg(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose("config", overrides=overrides)


def undeclared(record: dict, prefix: str) -> set[str]:
    return {k for k in record if k not in COLUMNS and not k.startswith(prefix)}


def test_every_column_a_cell_writes_is_in_the_schema(tmp_path, monkeypatch):
    """Examples that ran (with fidelity: its columns too), one that failed, and a capacity cell's probes."""
    real = example.generation_outcome

    def second_fails(lm, task, spec, ex, *rest):
        if ex.id == "passkey-1":
            raise RuntimeError("synthetic failure")
        return real(lm, task, spec, ex, *rest)

    monkeypatch.setattr(example, "generation_outcome", second_fails)
    base = [
        "model=tiny-llama",
        "task.n=2",
        "task.context_tokens=96",
        "task.max_new_tokens=3",
        f"results_dir={tmp_path}",
    ]
    summary = run_cell(cfg(base + ["policy=window", "budget=0.5", "fidelity=true"]), tmp_path / "cell", "t")
    rows = read_rows(tmp_path / "cell" / "rows.jsonl")
    assert [r["status"] for r in rows] == ["ok", "error"]
    assert "metric.fidelity_kl" in rows[0] and "error" in rows[1]
    for row in rows:
        assert not undeclared(row, METRIC_PREFIX), undeclared(row, METRIC_PREFIX)
    assert not undeclared(summary, MEAN_PREFIX)
    assert not undeclared(json.loads((tmp_path / "cell" / "summary.json").read_text()), MEAN_PREFIX)

    capacity = ["capacity.memory_gib=64", "capacity.max_batch=2", "policy=h2o", "budget=0.5", "stage=both"]
    summary = run_cell(cfg(base + capacity), tmp_path / "capacity", "t")
    rows = read_rows(tmp_path / "capacity" / "rows.jsonl")
    assert [r["kind"] for r in rows] == ["capacity", "capacity"] and summary["max_batch"] == 2
    for record in [*rows, summary]:
        assert not undeclared(record, METRIC_PREFIX)


def test_the_names_readers_use_are_columns():
    values = {
        name: value
        for name, value in vars(schema).items()
        if name.isupper() and isinstance(value, str) and not name.startswith(("STATUS_", "KIND_"))
    }
    not_columns = {"METRIC_PREFIX", "MEAN_PREFIX", "SKIPPED"}
    assert {n: v for n, v in values.items() if n not in not_columns and v not in COLUMNS} == {}
    assert set(schema.CELL) <= COLUMNS


@pytest.mark.parametrize(
    "record, kind",
    [(OLD_ROW, "example"), ({**OLD_ROW, "kind": "capacity", "capacity_batch": 4, "fits": True}, "capacity")],
)
def test_rows_in_an_old_shape_load(tmp_path, record, kind):
    (tmp_path / "rows.jsonl").write_text(json.dumps(record) + "\n")
    (row,) = read_rows(tmp_path / "rows.jsonl")
    assert row["batch_size"] == 1 and row["kind"] == kind and row["score"] == 1.0
    loaded = load_rows([tmp_path]).rows
    assert loaded["policy"].tolist() == ["h2o"] and loaded["budget"].tolist() == ["75%"]


def test_the_committed_example_results_load():
    """results/example predates batch_size and kind; results/capacity_example has both."""
    rows = load_rows([REPO / "results" / "example"]).rows
    assert len(rows) and set(rows["kind"]) == {"example"} and set(rows["batch_size"]) == {1}
    assert not rows["policy"].str.contains("batch").any()
    capacity = load_rows([REPO / "results" / "capacity_example"]).rows
    assert len(capacity) and set(capacity["kind"]) == {"capacity"}
