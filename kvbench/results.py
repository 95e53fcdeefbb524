"""One directory per cell: ``config.yaml``, ``rows.jsonl`` (appended and flushed per example) and
``summary.json`` (written atomically when the cell completes).

A crash can at worst leave a torn last line; it is cut off before anything new is appended, so a
rerun resumes after the last finished example and never duplicates or corrupts a row.
"""
from __future__ import annotations

import fcntl
import json
import math
import os
from pathlib import Path
from typing import Any, Iterator

ROWS = "rows.jsonl"
SUMMARY = "summary.json"


class CellBusy(RuntimeError):
    """Another process is writing this cell right now."""


def read_rows(path: Path) -> list[dict[str, Any]]:
    """Every complete row of a rows.jsonl; a torn or unparsable line is skipped."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
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
        self.rows_path = self.dir / ROWS
        self.summary_path = self.dir / SUMMARY
        self._lock_file = None

    def __enter__(self) -> "CellResults":
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock_file = (self.dir / ".lock").open("w")
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as err:
            self._lock_file.close()
            raise CellBusy(f"{self.dir} is being written by another process") from err
        repair_tail(self.rows_path)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._lock_file is not None:
            fcntl.flock(self._lock_file, fcntl.LOCK_UN)
            self._lock_file.close()

    def rows(self) -> list[dict[str, Any]]:
        return read_rows(self.rows_path)

    def finished_ids(self) -> set[str]:
        return {str(r["example_id"]) for r in self.rows() if "example_id" in r}

    def is_complete(self) -> bool:
        return self.summary_path.exists()

    def append(self, row: dict[str, Any]) -> None:
        line = json.dumps(_clean(row), ensure_ascii=False, allow_nan=False)
        with self.rows_path.open("a", encoding="utf-8") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())

    def write_summary(self, summary: dict[str, Any]) -> None:
        atomic_write(self.summary_path, json.dumps(_clean(summary), indent=2, ensure_ascii=False))

    def write_config(self, yaml_text: str) -> None:
        atomic_write(self.dir / "config.yaml", yaml_text)


def summarize(rows: list[dict[str, Any]], expected: int) -> dict[str, Any]:
    """Means of every numeric field over successful rows, with counts."""
    ok = [r for r in rows if r.get("status") == "ok"]
    summary: dict[str, Any] = {"n_expected": expected, "n_ok": len(ok), "n_error": len(rows) - len(ok)}
    for key in sorted({k for r in ok for k, v in r.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}):
        values = [r[key] for r in ok if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
        if values:
            summary[f"mean.{key}"] = sum(values) / len(values)
    for key in ("model", "task", "policy", "budget", "stage", "primary_metric"):
        if rows and key in rows[0]:
            summary[key] = rows[0][key]
    return summary


def iter_cells(root: str | os.PathLike) -> Iterator[Path]:
    """Every cell directory (one holding rows.jsonl) under ``root``."""
    for path in sorted(Path(root).rglob(ROWS)):
        yield path.parent
