"""Hydra callbacks: a summary table printed when a sweep ends."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

COLUMNS = [("policy", "policy"), ("budget", "budget"), ("stage", "stage"), ("task", "task"), ("n_ok", "n"),
           ("n_error", "errors"), ("mean.score", "score"), ("mean.budget_achieved", "achieved"),
           ("mean.kv_resident_bytes", "kv_bytes"), ("mean.ttft_s", "ttft_s"),
           ("mean.decode_tokens_per_s", "decode_tok/s")]


def summary_table(sweep_dir: Path) -> str:
    """One line per finished cell under ``sweep_dir``, read from the cells' summary.json files."""
    import pandas as pd

    records = [json.loads(p.read_text()) for p in sorted(sweep_dir.rglob("summary.json"))]
    if not records:
        return f"no finished cells under {sweep_dir}"
    frame = pd.DataFrame(records)
    keep = [(src, dst) for src, dst in COLUMNS if src in frame.columns]
    frame = frame[[src for src, _ in keep]].rename(columns=dict(keep))
    if "score" in frame and records[0].get("primary_metric"):
        frame = frame.rename(columns={"score": records[0]["primary_metric"]})
    frame = frame.sort_values([c for c in ("task", "stage", "policy", "budget") if c in frame.columns], key=lambda s: s.astype(str))
    return frame.to_string(index=False, float_format=lambda v: f"{v:.4g}")


class SummaryTable(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if config.get("print_table", True):
            print(summary_table(Path(config.hydra.sweep.dir)))
