"""One directory per cell: ``config.yaml``, ``rows.jsonl`` (appended and flushed per example) and
``summary.json`` (written atomically when the cell completes).

A crash can at worst leave a torn last line; it is cut off before anything new is appended, so a
rerun resumes after the last finished example and never duplicates or corrupts a row. A cell that
cannot run leaves ``error.txt`` (removed when it next runs). The cell's ``config.yaml`` pins what its
rows mean: a rerun with a different config refuses to mix its rows in.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
from pathlib import Path
from typing import Any, TextIO

from kvbench.results.schema import (
    EXAMPLE_ID,
    PRIMARY_METRIC,
    STATUS,
    STATUS_OK,
    CapacitySummary,
    CellIdentity,
    Row,
    Summary,
    upgrade,
)

ROWS_FILE = "rows.jsonl"
SUMMARY_FILE = "summary.json"
CONFIG_FILE = "config.yaml"
ERROR_FILE = "error.txt"
# Keys of the run config that say where results (or converted weights) go or how they are reported, not what a
# row means; dotted ones lie below a top-level key.
BOOKKEEPING_KEYS = ("results_dir", "sweep_name", "print_table", "tracking", "hydra", "model.cache_dir")


class CellBusy(RuntimeError):
    """Another process is writing this cell right now."""


class CellConflict(RuntimeError):
    """The cell directory holds results of a different config."""


def semantic_config(config: dict[str, Any], budgeted: bool = True) -> dict[str, Any]:
    """The part of a cell's resolved config that decides its rows. The full cache ignores the budget (its policy is
    not ``budgeted``), so all its budgets share one cell (see ``kvbench.runner.paths.cell_path``)."""
    out = {k: v for k, v in config.items() if k not in BOOKKEEPING_KEYS}
    for key in BOOKKEEPING_KEYS:
        group, _, inner = key.partition(".")
        if inner and isinstance(out.get(group), dict):
            out[group] = {k: v for k, v in out[group].items() if k != inner}
    if not budgeted:
        out.pop("budget", None)
    return out


def config_differences(old: Any, new: Any, prefix: str = "") -> list[str]:
    """Dotted keys present in both whose values differ, as ``key: old -> new``. A key only one side
    has is not a difference: it was added (or dropped) by a newer kvbench, whose default keeps the
    old behaviour."""
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[str] = []
        for key in sorted(set(old) & set(new), key=str):
            out.extend(config_differences(old[key], new[key], f"{prefix}.{key}" if prefix else str(key)))
        return out
    return [] if old == new else [f"{prefix}: {old!r} -> {new!r}"]


def read_rows(path: Path) -> list[dict[str, Any]]:
    """Every complete row of a rows.jsonl in the current shape (``schema.upgrade``); a torn or unparsable line
    is skipped."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(upgrade(json.loads(line)))
        except json.JSONDecodeError:
            continue
    return rows


def repair_tail(path: Path) -> None:
    """Cut a torn last line (a crash mid-write) so that appends start on a clean line."""
    if not path.exists():
        return
    data = path.read_bytes()
    keep = len(data)
    if data and not data.endswith(b"\n"):
        keep = data.rfind(b"\n") + 1
    if keep != len(data):
        with path.open("r+b") as f:
            f.truncate(keep)


def atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _clean(value: Any) -> Any:
    """JSON has no NaN/inf: store them as null so every reader agrees."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


class CellResults:
    """The results of one cell, held under an exclusive lock while it runs."""

    def __init__(self, cell_dir: str | os.PathLike):
        self.dir = Path(cell_dir)
        self.rows_path = self.dir / ROWS_FILE
        self.summary_path = self.dir / SUMMARY_FILE
        self.config_path = self.dir / CONFIG_FILE
        self._lock_file: TextIO | None = None

    def __enter__(self) -> CellResults:
        """Lock the cell (an advisory ``flock``, released by the kernel when the process dies, so a
        killed run never leaves a stale lock) and cut a torn last line."""
        self.dir.mkdir(parents=True, exist_ok=True)
        lock = (self.dir / ".lock").open("w")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as err:
            lock.close()
            raise CellBusy(
                f"{self.dir} is being written by another process; wait for it to finish or use another sweep_name"
            ) from err
        self._lock_file = lock
        repair_tail(self.rows_path)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._lock_file is not None:
            fcntl.flock(self._lock_file, fcntl.LOCK_UN)
            self._lock_file.close()
            self._lock_file = None

    def rows(self) -> list[dict[str, Any]]:
        return read_rows(self.rows_path)

    def finished_ids(self) -> set[str]:
        return {str(r[EXAMPLE_ID]) for r in self.rows() if EXAMPLE_ID in r}

    def is_complete(self) -> bool:
        return self.summary_path.exists()

    def append(self, row: Row) -> None:
        line = json.dumps(_clean(row.to_json()), ensure_ascii=False, allow_nan=False)
        with self.rows_path.open("a", encoding="utf-8") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())

    def write_summary(self, summary: Summary | CapacitySummary) -> dict[str, Any]:
        """Write summary.json; returns what was written."""
        data = _clean(summary.to_json())
        atomic_write(self.summary_path, json.dumps(data, indent=2, ensure_ascii=False))
        return data

    def summary(self) -> dict[str, Any]:
        """The summary.json of a complete cell."""
        return json.loads(self.summary_path.read_text(encoding="utf-8"))

    def write_config(self, yaml_text: str) -> None:
        atomic_write(self.config_path, yaml_text)

    def claim(self, config: dict[str, Any], budgeted: bool = True) -> None:
        """Record ``config`` as this cell's config, or raise ``CellConflict`` when the rows already here
        were made with a different one (a changed ``task.n`` or ``max_new_tokens``, say): mixing them
        would silently corrupt the cell. Bookkeeping keys (results_dir, tracking, ...) may change; a cell with
        rows keeps the config file they were made with, byte for byte."""
        import yaml

        if self.config_path.exists() and (self.rows_path.exists() or self.summary_path.exists()):
            old = yaml.safe_load(self.config_path.read_text(encoding="utf-8")) or {}
            diff = config_differences(semantic_config(old, budgeted), semantic_config(config, budgeted))
            if diff:
                shown = "; ".join(diff[:6]) + ("; ..." if len(diff) > 6 else "")
                raise CellConflict(
                    f"{self.dir} holds results of a different config ({shown}). Rerun with the old settings "
                    "to resume it, choose another sweep_name, or delete the cell directory to start it over"
                )
            return  # the config its rows were made with stays as it was written
        self.write_config(yaml.safe_dump(config, sort_keys=False, allow_unicode=True))

    def clear_error(self) -> None:
        (self.dir / ERROR_FILE).unlink(missing_ok=True)


def summarize(cell: CellIdentity, rows: list[dict[str, Any]], expected: int) -> Summary:
    """Means of every numeric column over successful rows, with counts."""
    ok = [r for r in rows if r.get(STATUS) == STATUS_OK]

    def number(value: Any) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    means = {}
    for key in sorted({k for r in ok for k, v in r.items() if number(v)}):
        values = [r[key] for r in ok if number(r.get(key))]
        means[key] = sum(values) / len(values)
    primary = next((r[PRIMARY_METRIC] for r in rows if r.get(PRIMARY_METRIC)), None)
    return Summary(cell, primary, expected, len(ok), len(rows) - len(ok), means)


def write_error(cell_dir: str | os.PathLike, message: str) -> None:
    """Why a cell could not run, for the sweep's end-of-run report and for the user."""
    path = Path(cell_dir)
    path.mkdir(parents=True, exist_ok=True)
    atomic_write(path / ERROR_FILE, message if message.endswith("\n") else message + "\n")


def failed_cells(root: str | os.PathLike, since: float | None = None) -> list[tuple[Path, str]]:
    """Cells under ``root`` holding an ``error.txt`` (written at or after ``since``), with its first line."""
    out = []
    for path in sorted(Path(root).rglob(ERROR_FILE)):
        try:
            if since is not None and path.stat().st_mtime < since:
                continue
            lines = path.read_text(encoding="utf-8", errors="replace").strip().splitlines()
        except OSError:
            continue
        out.append((path.parent, _headline(lines)))
    return out


def _headline(lines: list[str]) -> str:
    """A traceback's last line says what went wrong; a kvbench message is its first."""
    if not lines:
        return "(empty error.txt)"
    return lines[-1] if lines[0].startswith("Traceback") else lines[0]
