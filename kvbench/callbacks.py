"""Hydra callbacks: a summary table printed when a sweep ends, and the cells that could not run."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from kvbench.results.schema import (
    BUDGET,
    BUDGET_ACHIEVED,
    BUDGET_ACHIEVED_FULL,
    DECODE_TOKENS_PER_S,
    KV_RESIDENT_BYTES,
    KV_RESIDENT_BYTES_FULL,
    KV_RESIDENT_BYTES_SLIDING,
    N_ERROR,
    N_OK,
    POLICY,
    PRIMARY_METRIC,
    SCORE,
    STAGE,
    TASK,
    TTFT_S,
    mean_column,
)
from kvbench.results.writer import SUMMARY_FILE, failed_cells

MIB = 1 << 20
# (summary column, heading, unit: the column is divided by it) of the table; the cell's identity under its own name.
COLUMNS = [
    (POLICY, POLICY, None),
    (BUDGET, BUDGET, None),
    (STAGE, STAGE, None),
    (TASK, TASK, None),
    (N_OK, "n", None),
    (N_ERROR, "errors", None),
    (mean_column(SCORE), SCORE, None),
    (mean_column(BUDGET_ACHIEVED), "achieved", None),
    (mean_column(BUDGET_ACHIEVED_FULL), "achieved_full", None),
    (mean_column(KV_RESIDENT_BYTES), "KV MiB", MIB),
    (mean_column(KV_RESIDENT_BYTES_FULL), "KV MiB full layers", MIB),
    (mean_column(TTFT_S), "TTFT ms", 1e-3),
    (mean_column(DECODE_TOKENS_PER_S), "decode tok/s", None),
]
# Shown only for hybrid models (sliding and full-attention layers), where they differ from the overall ones.
HYBRID_ONLY = (mean_column(BUDGET_ACHIEVED_FULL), mean_column(KV_RESIDENT_BYTES_FULL))
# Clock slack between this process and the ones that ran the cells (submitit, shared filesystems).
CLOCK_SLACK_S = 5.0


def summary_table(sweep_dir: Path) -> str:
    """One line per finished cell under ``sweep_dir``, read from the cells' summary.json files."""
    import pandas as pd

    from kvbench.report.labels import label_cells

    records = []
    for path in sorted(Path(sweep_dir).rglob(SUMMARY_FILE)):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError):
            continue
    if not records:
        return f"no finished cells under {sweep_dir}"
    raw = pd.DataFrame(records)
    if POLICY in raw and BUDGET in raw and raw[POLICY].eq("full").any():  # 1 would read as one token
        raw[BUDGET] = raw[BUDGET].astype(object).where(raw[POLICY].ne("full"), "full")
    frame = label_cells(raw)  # variants of one policy or task named apart
    hybrid = mean_column(KV_RESIDENT_BYTES_SLIDING) in frame.columns
    shown = [c for c in COLUMNS if c[0] in frame.columns]
    keep = [(src, dst, unit) for src, dst, unit in shown if hybrid or src not in HYBRID_ONLY]
    frame = frame[[src for src, _, _ in keep]]
    for src, _, unit in keep:
        if unit is not None:
            frame[src] = frame[src] / unit
    frame = frame.rename(columns={src: dst for src, dst, _ in keep})
    metrics = {r.get(PRIMARY_METRIC) for r in records if r.get(PRIMARY_METRIC)}
    if SCORE in frame and len(metrics) == 1:
        frame = frame.rename(columns={SCORE: metrics.pop()})
    frame = frame.sort_values(
        [c for c in (TASK, STAGE, POLICY, BUDGET) if c in frame.columns], key=lambda s: s.astype(str)
    )
    table = frame.to_string(index=False, float_format=lambda v: f"{v:.4g}")
    report = f"kvbench-report {sweep_dir} --out {Path(sweep_dir) / 'report'}"
    return f"{table}\n\nFigures and tables with intervals: {report}"


def failure_report(sweep_dir: Path, since: float | None = None) -> str:
    """The cells under ``sweep_dir`` that could not run (since ``since``), one line each, or ''."""
    failed = failed_cells(sweep_dir, since)
    if not failed:
        return ""
    lines = [f"{len(failed)} cell(s) could not run (details in each error.txt):"]
    lines += [
        f"  {path.relative_to(sweep_dir) if path.is_relative_to(sweep_dir) else path}: {why}" for path, why in failed
    ]
    return "\n".join(lines)


class SummaryTable(Callback):
    """Prints the sweep's table, then the cells of this sweep that failed. The sweep exits with status 1
    when any did (examples that failed are error rows, not failed cells, and do not count)."""

    def __init__(self) -> None:
        self.started: float | None = None

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.started = time.time() - CLOCK_SLACK_S

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if config.get("print_table", True):
            print(summary_table(sweep_dir))
        report = failure_report(sweep_dir, self.started)
        if report:
            print(report, file=sys.stderr)
            sys.exit(1)
