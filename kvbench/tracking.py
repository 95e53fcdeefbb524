"""An optional Weights & Biases run per cell: the resolved config, one table row per example, the summary."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

MODES = ("online", "offline", "disabled")
TABLE_COLUMNS = ("example_id", "status", "score", "budget_achieved", "kv_resident_bytes", "ttft_s",
                 "decode_tokens_per_s", "prediction")


def check_credentials(mode: str) -> str | None:
    """Why online logging cannot work here, or None. Checked before any model loads."""
    if mode not in MODES:
        return f"tracking.wandb.mode={mode!r} is unknown; choose one of {', '.join(MODES)}"
    if mode != "online":
        return None
    if os.environ.get("WANDB_API_KEY"):
        return None
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    if netrc.exists() and "api.wandb.ai" in netrc.read_text(errors="ignore"):
        return None
    return ("tracking.wandb.mode=online needs credentials: run `wandb login` or set WANDB_API_KEY, "
            "or use tracking.wandb.mode=offline")


class Tracker:
    """No-op when disabled, so the runner never branches on it."""

    def __init__(self, settings: dict[str, Any], run_name: str, run_dir: Path, config: dict[str, Any], group: str):
        self.run = None
        self.rows: list[list[Any]] = []
        if settings.get("mode", "disabled") == "disabled":
            return
        import wandb

        self.run = wandb.init(
            project=settings.get("project") or "kvbench",
            entity=settings.get("entity"),
            group=settings.get("group") or group,
            name=run_name,
            mode=settings["mode"],
            dir=str(run_dir),
            config=config,
            reinit="finish_previous",
        )

    def log_example(self, row: dict[str, Any]) -> None:
        if self.run is None:
            return
        self.rows.append([row.get(c) for c in TABLE_COLUMNS])
        numeric = {k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        self.run.log(numeric)

    def finish(self, summary: dict[str, Any]) -> None:
        if self.run is None:
            return
        import wandb

        self.run.log({"examples": wandb.Table(columns=list(TABLE_COLUMNS), data=self.rows)})
        for key, value in summary.items():
            if isinstance(value, (int, float, str)):
                self.run.summary[key] = value
        self.run.finish()
