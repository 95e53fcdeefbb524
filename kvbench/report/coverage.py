"""What a report says is absent or failed: cells of the sweep's grid with no rows (less those kvbench refuses to
run, named once on a line of their own), cells that could not run (their ``error.txt``, less the refusals), and
examples that failed."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import pandas as pd

from kvbench.config.validate import stage_refusal
from kvbench.report.aggregate import error_counts, missing_cells
from kvbench.report.labels import base_name
from kvbench.report.load import Loaded
from kvbench.report.style import display_name
from kvbench.report.tables import markdown_table
from kvbench.results.schema import CELL, POLICY, STAGE
from kvbench.results.writer import failed_cells


@dataclass
class Coverage:
    missing: pd.DataFrame  # grid cells with no rows, kvbench's refusals left out
    errors: pd.DataFrame  # cells with failed examples (aggregate.error_counts)
    failed: list[tuple[str, str]]  # (cell directory, first line of its error.txt)
    refused: list[tuple[str, str]]  # (policy, stage) pairs of the grid kvbench refuses to run


def coverage(rows: pd.DataFrame, roots: Sequence[Path], refused: Mapping[str, Sequence[str]]) -> Coverage:
    """``rows``: a sweep's example rows; ``refused``: policy -> the stages kvbench refuses it in."""
    stages = set(rows[STAGE])
    pairs = sorted({(p, s) for p in set(rows[POLICY]) for s in refused.get(p, ()) if s in stages})
    # A sweep over stages leaves the refusal in the refused cell's error.txt: that cell is named with the refused.
    refusals = [stage_refusal(base_name(policy), stage) for policy, stage in pairs]
    failed = []
    for root in roots:
        if root.is_dir():
            failed += [
                (str(path.relative_to(root)), headline)
                for path, headline in failed_cells(root)
                if not any(refusal in headline for refusal in refusals)
            ]
    return Coverage(missing_cells(rows, refused), error_counts(rows), failed, pairs)


def _named(cells: pd.DataFrame) -> pd.DataFrame:
    """``cells`` with each policy by its display name, as the figures and the other tables name it."""
    return cells.assign(**{POLICY: cells[POLICY].map(display_name)})


def coverage_markdown(loaded: Loaded, cover: Coverage) -> str:
    """The report section that says what is absent or failed."""
    lines = ["## Coverage", ""]
    missing, errors = cover.missing, cover.errors
    if missing.empty:
        lines.append("No missing cells: every policy × budget × task × model × stage seen has rows.")
    else:
        lines += [f"{len(missing)} missing cells (no rows at all):", "", markdown_table(_named(missing[CELL]))]
    if cover.refused:
        shown = ", ".join(f"{display_name(policy)} in stage={stage}" for policy, stage in cover.refused)
        lines += ["", f"Not expected (kvbench refuses to run them): {shown}."]
    lines.append("")
    if cover.failed:
        table = pd.DataFrame(cover.failed, columns=["cell", "error.txt"])
        lines += [f"{len(cover.failed)} cells could not run:", "", markdown_table(table), ""]
    if errors.empty:
        lines.append("No failed examples.")
    else:
        lines += [f"{int(errors['errors'].sum())} failed examples (excluded from statistics):", ""]
        lines.append(markdown_table(_named(errors[[*CELL, "ok", "errors", "first_error"]])))
    if loaded.bad_lines or loaded.duplicates:
        lines += ["", f"Skipped {loaded.bad_lines} unreadable lines and {loaded.duplicates} duplicate example rows."]
    return "\n".join(lines)


def log_coverage(log: TextIO, loaded: Loaded, cover: Coverage) -> None:
    print(
        f"kvbench-report: {len(loaded.rows)} rows from {len(loaded.files)} files "
        f"({loaded.bad_lines} unreadable lines, {loaded.duplicates} duplicates skipped)",
        file=log,
    )
    if not cover.missing.empty:
        print(f"kvbench-report: {len(cover.missing)} missing cells (model / task / stage / policy / budget):", file=log)
        for cell in cover.missing[CELL].itertuples(index=False):
            print("  " + " / ".join(cell), file=log)
    for cell, headline in cover.failed:
        print(f"kvbench-report: could not run: {cell}: {headline}", file=log)
    if not cover.errors.empty:
        errors = cover.errors
        print(f"kvbench-report: {int(errors['errors'].sum())} failed examples in {len(errors)} cells", file=log)
