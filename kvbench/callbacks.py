"""Hydra callbacks: a summary table printed when a sweep ends, and the cells that could not run."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from kvbench.results import SUMMARY, failed_cells

COLUMNS = [
    ("policy", "policy"),
    ("budget", "budget"),
    ("stage", "stage"),
    ("task", "task"),
    ("n_ok", "n"),
    ("n_error", "errors"),
    ("mean.score", "score"),
    ("mean.budget_achieved", "achieved"),
    ("mean.budget_achieved_full", "achieved_full"),
    ("mean.kv_resident_bytes", "kv_bytes"),
    ("mean.kv_resident_bytes_full", "kv_bytes_full"),
    ("mean.ttft_s", "ttft_s"),
    ("mean.decode_tokens_per_s", "decode_tok/s"),
]
# Shown only for hybrid models (sliding and full-attention layers), where they differ from the overall ones.
HYBRID_ONLY = ("mean.budget_achieved_full", "mean.kv_resident_bytes_full")
# Clock slack between this process and the ones that ran the cells (submitit, shared filesystems).
CLOCK_SLACK_S = 5.0


def summary_table(sweep_dir: Path) -> str:
    """One line per finished cell under ``sweep_dir``, read from the cells' summary.json files."""
    import pandas as pd

    records = []
    for path in sorted(Path(sweep_dir).rglob(SUMMARY)):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError):
            continue
    if not records:
        return f"no finished cells under {sweep_dir}"
    frame = pd.DataFrame(records)
    hybrid = "mean.kv_resident_bytes_sliding" in frame.columns
    keep = [(src, dst) for src, dst in COLUMNS if src in frame.columns and (hybrid or src not in HYBRID_ONLY)]
    frame = frame[[src for src, _ in keep]].rename(columns=dict(keep))
    metrics = {r.get("primary_metric") for r in records if r.get("primary_metric")}
    if "score" in frame and len(metrics) == 1:
        frame = frame.rename(columns={"score": metrics.pop()})
    frame = frame.sort_values(
        [c for c in ("task", "stage", "policy", "budget") if c in frame.columns], key=lambda s: s.astype(str)
    )
    return frame.to_string(index=False, float_format=lambda v: f"{v:.4g}")


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
