"""An optional Weights & Biases run per cell: the resolved config, one table row per example, the summary.

``tracking.wandb.mode`` is ``disabled`` by default, so nothing ever asks for a login. ``offline`` writes
the run under ``<cell dir>/wandb/`` (sync it later with ``wandb sync``); ``online`` needs credentials,
checked before any model loads. The results files stay the source of truth: a tracking failure is
logged and the cell goes on without it.
"""

from __future__ import annotations

import logging
import netrc
import os
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from kvbench.results.schema import (
    BUDGET_ACHIEVED,
    DECODE_TOKENS_PER_S,
    ERROR,
    EXAMPLE_ID,
    KV_RESIDENT_BYTES,
    PREDICTION,
    SCORE,
    STATUS,
    TTFT_S,
)

log = logging.getLogger("kvbench")

MODES = ("online", "offline", "disabled")
TABLE_COLUMNS = (
    EXAMPLE_ID,
    STATUS,
    SCORE,
    BUDGET_ACHIEVED,
    KV_RESIDENT_BYTES,
    TTFT_S,
    DECODE_TOKENS_PER_S,
    PREDICTION,
    ERROR,
)
INIT_TIMEOUT_S = 60


def _host() -> str:
    return urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or "api.wandb.ai"


def has_credentials() -> bool:
    """An API key in the environment or a ``wandb login`` entry in the netrc file."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    path = Path(os.environ.get("NETRC") or Path.home() / ".netrc")
    if not path.is_file():
        return False
    try:
        return netrc.netrc(str(path)).authenticators(_host()) is not None
    except (netrc.NetrcParseError, OSError):
        return _host() in path.read_text(errors="ignore")


def check_credentials(mode: str) -> str | None:
    """Why logging in ``mode`` cannot work here, or None. Checked before any model loads."""
    if mode not in MODES:
        return f"tracking.wandb.mode={mode!r} is unknown; choose one of {', '.join(MODES)}"
    if mode == "online" and not has_credentials():
        return (
            "tracking.wandb.mode=online needs credentials: run `wandb login` or set WANDB_API_KEY, "
            "or use tracking.wandb.mode=offline (then `wandb sync` the run later)"
        )
    return None


def check_settings(settings: dict[str, Any]) -> str | None:
    """Everything about ``tracking.wandb`` that can be checked without starting a run."""
    mode = settings.get("mode", "disabled")
    problem = check_credentials(mode)
    if problem or mode == "disabled":
        return problem
    for key in ("project", "entity", "group"):
        value = settings.get(key)
        if value is not None and (not isinstance(value, str) or not value.strip()):
            return f"tracking.wandb.{key}={value!r} must be a non-empty string or null"
    try:
        import wandb  # noqa: F401
    except ImportError:
        return "tracking.wandb.mode needs the wandb package: pip install wandb (or tracking.wandb.mode=disabled)"
    return None


def wandb_settings() -> Any:
    """No console capture (it fights Hydra's logging), no prompts, bounded waits."""
    import wandb

    return wandb.Settings(
        console="off", silent=True, init_timeout=INIT_TIMEOUT_S, disable_job_creation=True, save_code=False
    )


class Tracker:
    """No-op when disabled, so the runner never branches on it."""

    def __init__(
        self,
        settings: dict[str, Any],
        run_name: str,
        run_dir: Path,
        config: dict[str, Any],
        group: str,
        tags: list[str] | None = None,
    ):
        self.run = None
        mode = settings.get("mode", "disabled")
        if mode == "disabled":
            return
        os.environ.setdefault("WANDB_SILENT", "true")
        try:
            import wandb

            Path(run_dir).mkdir(parents=True, exist_ok=True)
            self.run = wandb.init(
                project=settings.get("project") or "kvbench",
                entity=settings.get("entity"),
                group=settings.get("group") or group,
                name=run_name,
                job_type="cell",
                tags=[str(t)[:64] for t in (tags or [])],
                mode=mode,
                dir=str(run_dir),
                config=config,
                reinit="finish_previous",
                settings=wandb_settings(),
            )
        except Exception as err:  # tracking must never cost the results
            log.error("wandb.init failed (%s: %s); this cell runs without tracking", type(err).__name__, err)
            self.run = None

    @property
    def directory(self) -> Path | None:
        """The run's own directory (``.../wandb/offline-run-*``), where its files are."""
        return Path(self.run.dir).parent if self.run is not None else None

    def log_example(self, row: dict[str, Any]) -> None:
        if self.run is None:
            return
        numeric = {k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        try:
            self.run.log(numeric)
        except Exception as err:
            log.warning("wandb log failed: %s", err)

    def finish(self, summary: dict[str, Any], rows: list[dict[str, Any]]) -> None:
        """The per-example table holds every row of the cell, those of earlier (resumed) runs too."""
        if self.run is None:
            return
        try:
            import wandb

            data = [[_cell(row.get(c)) for c in TABLE_COLUMNS] for row in rows]
            self.run.log({"examples": wandb.Table(columns=list(TABLE_COLUMNS), data=data)})
            self.run.summary.update(
                {k: v for k, v in summary.items() if isinstance(v, (int, float, str)) and not isinstance(v, bool)}
            )
        except Exception as err:
            log.warning("wandb summary failed: %s", err)
        finally:
            try:
                self.run.finish()
            except Exception as err:
                log.warning("wandb finish failed: %s", err)
            self.run = None

    def abort(self) -> None:
        """Close the run when the cell stops early, marking it failed."""
        if self.run is not None:
            try:
                self.run.finish(exit_code=1)
            except Exception:
                pass
            self.run = None


def _cell(value: Any) -> Any:
    """Table cells must be one type per column: numbers and strings as they are, anything else as text."""
    if value is None or isinstance(value, (int, float, str)) and not isinstance(value, bool):
        return value
    return str(value)
