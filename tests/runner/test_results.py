"""The results writer: append-only rows that survive a crash, the cell lock, the cell's pinned config,
error files and the end-of-sweep report. No model here; every test takes milliseconds."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import fields, replace

import pytest

from kvbench.callbacks import failure_report, summary_table
from kvbench.results.schema import (
    KIND_EXAMPLE,
    CellIdentity,
    Failure,
    Measures,
    Outcome,
    Provenance,
    Row,
    Summary,
    Timings,
)
from kvbench.results.writer import (
    CellBusy,
    CellConflict,
    CellResults,
    config_differences,
    failed_cells,
    read_rows,
    repair_tail,
    semantic_config,
    summarize,
    write_error,
)

CONFIG = {
    "model": {"name": "tiny-llama"},
    "policy": {"name": "window"},
    "task": {"name": "retrieval", "n": 4},
    "budget": 0.5,
    "stage": "prefill",
    "results_dir": "/r",
    "sweep_name": "s",
    "print_table": True,
    "tracking": {"wandb": {"mode": "disabled"}},
}


CELL = CellIdentity("tiny-llama", "retrieval", "window", 0.5, "prefill", 1, "s/cell", "s")
ORIGIN = Provenance("0" * 40, {"python": "3.11"}, "cpu", "float32", "kvbench(sdpa)")
MEASURES = Measures(
    **{f.name: 0 for f in fields(Measures) if f.name not in ("timings", "budget_achieved_per_layer")},
    budget_achieved_per_layer=[0.5, 0.5],
    timings=Timings(**{f.name: None for f in fields(Timings)}),
)


def row(i: int, status: str = "ok", score: float | None = None, **measured) -> Row:
    """Example ``e<i>``: ok with score ``i`` (or ``score``), or failed."""
    if status == "error":
        return Row(CELL, f"e{i}", KIND_EXAMPLE, Failure("RuntimeError: x", "Traceback ..."), ORIGIN)
    value = float(i) if score is None else score
    outcome = Outcome("accuracy", value, {"accuracy": value}, replace(MEASURES, **measured), truncated=False)
    return Row(CELL, f"e{i}", KIND_EXAMPLE, outcome, ORIGIN)


def test_torn_last_line_is_cut_and_appends_resume_cleanly(tmp_path):
    with CellResults(tmp_path) as cell:
        cell.append(row(0))
        cell.append(row(1))
    # A kill in the middle of a write leaves part of a line and no newline.
    with (tmp_path / "rows.jsonl").open("a") as f:
        f.write('{"example_id": "e2", "status": "o')
    assert [r["example_id"] for r in read_rows(tmp_path / "rows.jsonl")] == ["e0", "e1"]
    with CellResults(tmp_path) as cell:
        assert cell.finished_ids() == {"e0", "e1"}
        cell.append(row(2))
    text = (tmp_path / "rows.jsonl").read_text()
    assert text.endswith("\n")
    assert [json.loads(line)["example_id"] for line in text.splitlines()] == ["e0", "e1", "e2"]


def test_repair_tail_keeps_a_clean_file_and_empties_a_single_torn_line(tmp_path):
    clean = tmp_path / "a.jsonl"
    clean.write_text('{"x": 1}\n')
    repair_tail(clean)
    assert clean.read_text() == '{"x": 1}\n'
    torn = tmp_path / "b.jsonl"
    torn.write_text('{"x": ')
    repair_tail(torn)
    assert torn.read_text() == ""
    repair_tail(tmp_path / "missing.jsonl")  # nothing to do


def test_rows_are_strict_json_and_flushed_per_row(tmp_path):
    with CellResults(tmp_path) as cell:
        cell.append(row(0, score=math.nan, budget_achieved_per_layer=[math.inf, 1.0]))
        # Flushed and fsynced: another reader sees it before the cell closes.
        assert read_rows(tmp_path / "rows.jsonl")[0]["score"] is None
    line = (tmp_path / "rows.jsonl").read_text().strip()
    assert "NaN" not in line and "Infinity" not in line
    assert json.loads(line)["budget_achieved_per_layer"] == [None, 1.0]


def test_an_unparsable_line_is_skipped_not_fatal(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"example_id": "e0"}\nnot json\n{"example_id": "e1"}\n')
    assert [r["example_id"] for r in read_rows(path)] == ["e0", "e1"]


def test_a_cell_is_locked_while_it_runs(tmp_path):
    with CellResults(tmp_path):
        with pytest.raises(CellBusy, match="being written by another process"):
            CellResults(tmp_path).__enter__()
    with CellResults(tmp_path):  # released on exit
        pass


def test_the_lock_dies_with_its_process(tmp_path):
    """flock is released by the kernel when the holder is SIGKILLed: no stale lock after a crash."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, sys, time; f = open(sys.argv[1], 'w'); "
            "fcntl.flock(f, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(60)",
            str(tmp_path / ".lock"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(CellBusy):
            CellResults(tmp_path).__enter__()
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=10)
        with CellResults(tmp_path):
            pass
    finally:
        if holder.poll() is None:
            holder.kill()


def test_the_cell_config_is_pinned(tmp_path):
    with CellResults(tmp_path) as cell:
        cell.claim(CONFIG)
        cell.append(row(0))
    # Where results go and how they are tracked may change; what a row means may not.
    moved = {**CONFIG, "results_dir": "/elsewhere", "tracking": {"wandb": {"mode": "offline"}}}
    pinned = (tmp_path / "config.yaml").read_bytes()
    with CellResults(tmp_path) as cell:
        cell.claim(moved)
    assert (tmp_path / "config.yaml").read_bytes() == pinned  # the rows' config is never rewritten
    changed = {**CONFIG, "task": {"name": "retrieval", "n": 8}, "stage": "decode"}
    with CellResults(tmp_path) as cell, pytest.raises(CellConflict) as err:
        cell.claim(changed)
    message = str(err.value)
    assert "holds results of a different config (stage: 'prefill' -> 'decode'; task.n: 4 -> 8)" in message
    assert "choose another sweep_name, or delete the cell directory" in message
    # A key a newer kvbench added (absent from the old config) is not a conflict.
    with CellResults(tmp_path) as cell:
        cell.claim({**CONFIG, "policy": {"name": "window", "allocation": "uniform"}})


def test_the_full_cache_ignores_the_budget(tmp_path):
    full = {**CONFIG, "policy": {"name": "full"}}
    with CellResults(tmp_path) as cell:
        cell.claim(full, budgeted=False)
        cell.append(row(0))
    with CellResults(tmp_path) as cell:
        cell.claim({**full, "budget": 0.25}, budgeted=False)
    assert "budget" not in semantic_config(full, budgeted=False)
    assert semantic_config(full)["budget"] == 0.5 and "results_dir" not in semantic_config(full)
    cached = semantic_config({**full, "model": {"name": "m", "cache_dir": "/c", "dtype": "auto"}})
    assert cached["model"] == {"name": "m", "dtype": "auto"}  # where weights are cached is not what a row means


def test_config_without_rows_can_be_replaced(tmp_path):
    with CellResults(tmp_path) as cell:
        cell.claim(CONFIG)
    with CellResults(tmp_path) as cell:  # nothing was written under the old config yet
        cell.claim({**CONFIG, "stage": "decode"})


def test_config_differences_lists_dotted_keys():
    assert config_differences({"a": {"b": 1, "c": 2}, "d": 3}, {"a": {"b": 1, "c": 5}, "d": 3}) == ["a.c: 2 -> 5"]
    assert config_differences({"a": 1}, {"a": 1, "new": 2}) == []


def test_summary_counts_errors_and_averages_ok_rows():
    rows = [r.to_json() for r in (row(0), row(1), row(2, status="error"))]
    summary = summarize(CELL, rows, expected=4)
    assert (summary.n_expected, summary.n_ok, summary.n_error) == (4, 2, 1)
    assert summary.means["score"] == 0.5 and summary.means["metric.accuracy"] == 0.5
    assert summary.primary_metric == "accuracy" and "budget_achieved_per_layer" not in summary.means
    written = summary.to_json()
    assert written["mean.score"] == 0.5 and written["policy"] == "window" and written["n_ok"] == 2


def test_error_files_are_found_and_cleared(tmp_path):
    write_error(tmp_path / "a", "kvbench: budget=2.0 is out of range")
    write_error(tmp_path / "b", "Traceback (most recent call last):\n  File x\nRuntimeError: boom\n")
    found = dict((p.name, why) for p, why in failed_cells(tmp_path))
    assert found == {"a": "kvbench: budget=2.0 is out of range", "b": "RuntimeError: boom"}
    assert failed_cells(tmp_path, since=time.time() + 60) == []
    report = failure_report(tmp_path)
    assert report.startswith("2 cell(s) could not run") and "a: kvbench: budget=2.0 is out of range" in report
    with CellResults(tmp_path / "a") as cell:
        cell.clear_error()
    assert [p.name for p, _ in failed_cells(tmp_path)] == ["b"]
    assert failure_report(tmp_path / "a") == ""


def test_summary_table_reads_every_finished_cell(tmp_path):
    for policy, budget, score in [("window", 0.5, 0.25), ("random", 0.25, 0.75), ("full", 1.0, 1.0)]:
        cell = tmp_path / policy / str(budget)
        with CellResults(cell) as c:
            identity = replace(CELL, policy=policy, budget=budget)
            means = {"score": score, "kv_resident_bytes": 3 * 2**20 * budget, "ttft_s": budget}
            c.write_summary(Summary(identity, "accuracy", 2, 2, 0, means))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "summary.json").write_text("{")  # half-written by hand: skipped
    table = summary_table(tmp_path)
    lines = table.splitlines()
    assert "accuracy" in lines[0] and "KV MiB" in lines[0] and "TTFT ms" in lines[0]
    assert [line.split()[0] for line in lines[1:4]] == ["full", "random", "window"]
    assert lines[2].split()[-2:] == ["0.75", "250"] and lines[3].split()[-2:] == ["1.5", "500"]  # MiB, ms
    assert lines[1].split()[1] == "full"  # the full cache's budget: not 1, which would read as one token
    assert lines[-1] == f"Figures and tables with intervals: kvbench-report {tmp_path} --out {tmp_path / 'report'}"
    assert summary_table(tmp_path / "empty").startswith("no finished cells")
