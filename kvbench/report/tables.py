"""Policy x budget tables of the quality metric, as CSV (for tools) and markdown (for readers).

Markdown names each policy by its display name (``style.display_name``), as the figures do; the CSV keeps the
config names, the key that joins it with the rows.

Markdown bolds the best policy per budget column, respecting lower-is-better metrics; the full
cache is the reference row and is never bolded.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import pandas as pd

from kvbench.report.style import (
    direction,
    display_name,
    is_baseline,
    lower_is_better,
    metric_label,
    sort_policies,
    sort_stages,
)
from kvbench.results.schema import BUDGET, MODEL, POLICY, SCORE, STAGE, TASK

BLOCK = [MODEL, TASK, STAGE]


def format_value(value: float) -> str:
    """Three decimals for ordinary scores, three significant digits for tiny or huge values."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if value == 0 or 1e-3 <= abs(value) < 1e4:
        return f"{value:.3f}"
    return f"{value:.3g}"


def markdown_table(frame: pd.DataFrame) -> str:
    """A GitHub-flavoured markdown table of ``frame`` with its cells already as text."""

    def cell(value: object) -> str:
        return str(value).replace("|", "\\|").replace("\n", " ")

    lines = [
        "| " + " | ".join(cell(c) for c in frame.columns) + " |",
        "|" + "|".join("---" for _ in frame.columns) + "|",
    ]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in frame.itertuples(index=False)]
    return "\n".join(lines)


def _budget_columns(stats: pd.DataFrame) -> list[str]:
    budgets = stats[[BUDGET, "budget_kind", "budget_value"]].drop_duplicates(BUDGET)
    return budgets.sort_values(["budget_kind", "budget_value", BUDGET])[BUDGET].tolist()


def _block(stats: pd.DataFrame) -> pd.DataFrame:
    """Policies (rows, table order) x budgets (columns, ascending) of mean ``y`` for one block."""
    wide = stats.pivot_table(index=POLICY, columns=BUDGET, values="y", aggfunc="first", dropna=False)
    return wide.reindex(index=sort_policies(stats[POLICY]), columns=_budget_columns(stats))


def _blocks(stats: pd.DataFrame) -> list[tuple[tuple[str, str, str], pd.DataFrame]]:
    stage_rank = {s: i for i, s in enumerate(sort_stages(stats[STAGE]))}
    groups = dict(list(stats.groupby(BLOCK)))
    return [(key, groups[key]) for key in sorted(groups, key=lambda k: (k[0], k[1], stage_rank[k[2]]))]


def quality_csv(stats: pd.DataFrame, metric_names: Mapping[str, str]) -> pd.DataFrame:
    """All blocks stacked: model, task, stage, metric, policy, then one column per budget."""
    frames = []
    for (model, task, stage), cells in _blocks(stats):
        block = _block(cells).reset_index()
        block.insert(0, "metric", metric_names.get(task, SCORE))
        for i, (name, value) in enumerate(zip(BLOCK, (model, task, stage))):
            block.insert(i, name, value)
        frames.append(block)
    if not frames:
        return pd.DataFrame(columns=[*BLOCK, "metric", POLICY])
    columns = [*BLOCK, "metric", POLICY, *_budget_columns(stats)]
    return pd.concat(frames, ignore_index=True).reindex(columns=columns)


def _bold_best(block: pd.DataFrame, lower: bool) -> pd.DataFrame:
    """Text cells, the best non-baseline value of each column (and its displayed ties) in bold."""
    text = block.apply(lambda column: column.map(format_value))
    contenders = block[~block.index.map(is_baseline)]
    for column in block.columns:
        values = contenders[column].dropna()
        if values.empty:
            continue
        best = format_value(values.min() if lower else values.max())
        winners = values.index[values.map(format_value).eq(best)]
        text.loc[winners, column] = "**" + best + "**"
    return text


def quality_markdown(stats: pd.DataFrame, metric_names: Mapping[str, str]) -> str:
    """One markdown table per model, task and stage, best value per budget in bold."""
    parts = []
    for (model, task, stage), cells in _blocks(stats):
        metric = metric_names.get(task, SCORE)
        text = _bold_best(_block(cells), lower_is_better(metric)).rename(index=display_name).reset_index()
        heading = f"**{model} · {task} · {stage}** — {metric_label(metric)} ({direction(metric)})"
        parts.append(f"{heading}\n\n{markdown_table(text)}")
    return "\n\n".join(parts)
