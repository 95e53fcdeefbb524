"""Read every ``rows.jsonl`` under some result directories into one DataFrame.

Runs are killed mid-write and sweeps are split across directories, so reading must tolerate a
torn last line, the same file reached twice, and the same example recorded twice (a retry).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from kvbench.report.labels import label_cells
from kvbench.results.schema import BUDGET, CELL, EXAMPLE_ID, STATUS, STATUS_OK, upgrade
from kvbench.results.writer import ROWS_FILE

# An example within a cell (CELL: one point of a figure).
EXAMPLE = [*CELL, EXAMPLE_ID]


@dataclass
class Loaded:
    """The rows plus what reading them had to skip, for the report's provenance section."""

    rows: pd.DataFrame
    files: list[Path] = field(default_factory=list)
    bad_lines: int = 0
    duplicates: int = 0


def find_row_files(roots: Iterable[Path]) -> list[Path]:
    """Every ``rows.jsonl`` below ``roots`` (or a root that is such a file), each once."""
    found: dict[Path, Path] = {}
    for root in roots:
        candidates = [root] if root.is_file() else sorted(root.rglob(ROWS_FILE))
        for path in candidates:
            found.setdefault(path.resolve(), path)
    return list(found.values())


def _parse(path: Path) -> tuple[list[dict], int]:
    """The JSON objects of one file and the number of lines that were not one (torn writes)."""
    records, bad = [], 0
    with path.open(encoding="utf-8", errors="replace") as handle:
        for line in handle:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                bad += 1
                continue
            if isinstance(record, dict):
                records.append(upgrade(record))
            else:
                bad += 1
    return records, bad


def budget_label(value: object) -> str:
    """A column heading for a requested budget: fractions as percent, larger numbers as tokens."""
    number = pd.to_numeric(value, errors="coerce")
    if pd.isna(number):
        return str(value)
    if number <= 1:
        return f"{number * 100:.4g}%"
    return f"{number:.6g} tok"


def _budget_order(value: object) -> tuple[int, float]:
    number = pd.to_numeric(value, errors="coerce")
    if pd.isna(number):
        return 2, math.inf
    return (0 if number <= 1 else 1), float(number)


def _normalise(frame: pd.DataFrame) -> pd.DataFrame:
    """Identity columns as strings (model, task and policy labelled by what sets their cells apart), the budget as
    a label plus a sort key, status filled in."""
    for column in EXAMPLE:
        if column not in frame:
            frame[column] = "unknown"
        if column != BUDGET:
            frame[column] = frame[column].fillna("unknown").astype(str)
    raw_budget = frame[BUDGET]
    order = raw_budget.map(_budget_order)
    frame["budget_kind"] = order.map(lambda o: o[0])
    frame["budget_value"] = order.map(lambda o: o[1])
    frame[BUDGET] = raw_budget.map(budget_label)
    frame[STATUS] = frame.get(STATUS, pd.Series(STATUS_OK, index=frame.index)).fillna(STATUS_OK).astype(str)
    # Cells that differ in a setting or a batch size are named apart, so they are never averaged together.
    return label_cells(frame)


def load_rows(roots: Iterable[Path | str]) -> Loaded:
    """All rows below ``roots``; a retried example keeps its last ``ok`` row (else its last row)."""
    files = find_row_files(Path(r) for r in roots)
    records: list[dict] = []
    bad = 0
    for path in files:
        file_records, file_bad = _parse(path)
        records.extend(file_records)
        bad += file_bad
    if not records:
        return Loaded(pd.DataFrame(columns=[*EXAMPLE, STATUS]), files, bad)
    frame = _normalise(pd.DataFrame.from_records(records))
    before = len(frame)
    frame["_ok"] = frame[STATUS].eq(STATUS_OK)
    frame = (
        frame.reset_index(names="_seen")
        .sort_values(["_ok", "_seen"], kind="stable")
        .drop_duplicates(EXAMPLE, keep="last")
        .sort_values("_seen")
        .drop(columns=["_ok", "_seen"])
        .reset_index(drop=True)
    )
    return Loaded(frame, files, bad, before - len(frame))
