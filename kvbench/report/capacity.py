"""The capacity experiment's figures and table: what the memory a policy saves buys.

Rows of ``experiment=capacity`` cells (``kind`` "capacity", one per probed batch size) give, per model, task,
stage, policy and budget, the largest batch that fit the cap and the decode tokens/s there.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import matplotlib
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from kvbench.report.plots import legend_below, save_figure
from kvbench.report.style import (
    PAPER_RC,
    SINGLE_COLUMN_IN,
    budget_axis_label,
    is_baseline,
    memory_text,
    policy_styles,
    sort_policies,
)
from kvbench.results.schema import (
    CAPACITY_BATCH,
    CAPACITY_MEMORY_GIB,
    DECODE_TOKENS_PER_S,
    FITS,
    MAX_BATCH,
    MODEL,
    POLICY,
    STAGE,
    TASK,
)

KEY = [MODEL, TASK, STAGE, POLICY, "budget_value"]
HEIGHT_IN = 2.2


def capacity_cells(rows: pd.DataFrame) -> pd.DataFrame:
    """Per cell: the largest batch that fit and the batch's decode tokens/s at it."""
    fit = rows[rows[FITS].astype(bool)]
    best = fit.sort_values(CAPACITY_BATCH).groupby(KEY, as_index=False).last()
    best = best.rename(columns={CAPACITY_BATCH: MAX_BATCH})
    return best[KEY + [MAX_BATCH, DECODE_TOKENS_PER_S, CAPACITY_MEMORY_GIB]]


def cap_title(model: str, task: str, stage: str, gib: float) -> str:
    """Two short lines, so that a long model name is never cut: what ran, then under which cap."""
    return f"{model}\n{task}, stage {stage}, cap {memory_text(gib)}"


def _figure(title: str) -> tuple[Figure, Axes]:
    fig = Figure(figsize=(SINGLE_COLUMN_IN, HEIGHT_IN), layout="constrained")
    ax = fig.subplots()
    ax.set_title(title)
    return fig, ax


def budget_figure(cells: pd.DataFrame, column: str, label: str, title: str) -> Figure:
    """``column`` of one model, task and stage against the budget asked for: a line per policy, the full cache
    dashed."""
    with matplotlib.rc_context(PAPER_RC):
        fig, ax = _figure(title)
        styles, handles = policy_styles(cells[POLICY]), []
        for policy in sort_policies(cells[POLICY].unique()):
            part, style = cells[cells[POLICY].eq(policy)].sort_values("budget_value"), styles[policy]
            if is_baseline(policy):
                line = ax.axhline(float(part[column].iloc[0]), color=style.color, ls="--", label=style.label)
            else:
                (line,) = ax.plot(
                    part["budget_value"] * 100,
                    part[column],
                    marker=style.marker,
                    color=style.color,
                    ls=style.linestyle,
                    lw=style.linewidth,
                    label=style.label,
                    gid=policy,
                )
            handles.append(line)
        ax.set_xlabel(budget_axis_label(str(cells[STAGE].iat[0])))
        ax.set_ylabel(label)
        legend_below(fig, handles)
    return fig


def batch_figure(probes: pd.DataFrame, title: str) -> Figure:
    """Decode tokens/s against batch size, a line per policy and budget, up to the largest batch that fit."""
    with matplotlib.rc_context(PAPER_RC):
        fig, ax = _figure(title)
        styles, handles = policy_styles(probes[POLICY]), []
        for policy in sort_policies(probes[POLICY].unique()):
            style = styles[policy]
            for budget, part in probes[probes[POLICY].eq(policy)].groupby("budget_value"):
                part = part.sort_values(CAPACITY_BATCH)
                (line,) = ax.plot(
                    part[CAPACITY_BATCH],
                    part[DECODE_TOKENS_PER_S],
                    marker=style.marker,
                    color=style.color,
                    alpha=1.0 if is_baseline(policy) else 0.35 + 0.65 * float(budget),
                    ls="--" if is_baseline(policy) else style.linestyle,
                    label=style.label if is_baseline(policy) else f"{style.label} {float(budget) * 100:g}%",
                    gid=f"{policy}@{budget}",
                )
                handles.append(line)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel("decode tokens/s")
        legend_below(fig, handles)
    return fig


def capacity_plots(rows: pd.DataFrame) -> Iterator[tuple[str, str, Figure]]:
    """(file stem, caption, figure) of every capacity figure."""
    cells = capacity_cells(rows)
    for (model, task, stage), group in cells.groupby([MODEL, TASK, STAGE]):
        tag = f"{model}_{task}_{stage}".replace("/", "-")
        title = cap_title(model, task, stage, float(group[CAPACITY_MEMORY_GIB].iat[0]))
        for column, stem, label, caption in (
            (
                DECODE_TOKENS_PER_S,
                "capacity_tokens_per_s_vs_budget",
                "decode tokens/s",
                "decode tokens/s at the largest batch that fits",
            ),
            (MAX_BATCH, "capacity_max_batch_vs_budget", "largest batch that fits", "largest batch that fits"),
        ):
            yield f"{stem}_{tag}", caption, budget_figure(group, column, label, title)
        picked = rows[MODEL].eq(model) & rows[TASK].eq(task) & rows[STAGE].eq(stage) & rows[FITS].astype(bool)
        yield (
            f"capacity_tokens_per_s_vs_batch_{tag}",
            "decode tokens/s against batch",
            batch_figure(rows[picked], title),
        )


def capacity_figures(rows: pd.DataFrame, out_dir: Path) -> list[str]:
    """Three figures per model, task and stage (PNG + PDF) and a table; returns report.md's lines for them."""
    lines = []
    for stem, caption, fig in capacity_plots(rows):
        save_figure(fig, out_dir, stem)
        lines.append(f"![{caption}]({stem}.png)")
    cells = capacity_cells(rows)
    names = policy_styles(cells[POLICY])
    table = cells.assign(budget=(cells["budget_value"] * 100).map(lambda v: f"{v:g}%"))
    lines += [
        "",
        "| model | task | stage | cap | policy | budget | largest batch | decode tokens/s there |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    lines += [
        f"| {r.model} | {r.task} | {r.stage} | {memory_text(r.capacity_memory_gib)} | {names[r.policy].label} | "
        f"{r.budget} | {r.max_batch} | {r.decode_tokens_per_s:.1f} |"
        for r in table.itertuples()
    ]
    return lines
