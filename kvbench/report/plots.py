"""Figures built from ``cell_stats`` frames; each function returns the Figure so tests can read it.

Figures are made with ``matplotlib.figure.Figure`` (no pyplot): no GUI backend is touched, no
global figure registry grows, and PNGs are rendered by Agg. Every data line carries the raw policy
name as its ``gid`` so tests and tools can find it without parsing labels.
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from kvbench.report.aggregate import pareto_mask
from kvbench.report.style import (
    PAPER_RC,
    SINGLE_COLUMN_IN,
    WIDE_IN,
    PolicyStyle,
    is_baseline,
    policy_styles,
    sort_policies,
)
from kvbench.results.schema import CELL, MODEL, POLICY, STAGE, TASK

X_LABEL = "KV budget achieved (%)"
FRONTIER = "pareto_frontier"
PANEL_HEIGHT_IN = 1.75
MIN_PANEL_IN = 1.6  # past five panels (WIDE_IN holds five), each panel's width
# Rough legend geometry at 7 pt: width of a handle plus padding, of one character, height of a row.
LEGEND_HANDLE_IN, LEGEND_CHAR_IN, LEGEND_ROW_IN = 0.55, 0.055, 0.15
# A line (Artist) or an error-bar container per policy: both make a legend entry; matplotlib's stubs accept
# only the first.
LegendHandles = dict[str, Any]


def panel_grid(models: list[str], tasks: list[str], titles: Mapping[str, str] | None) -> tuple[Figure, np.ndarray]:
    """A models x tasks grid of panels, single-column wide when there is only one panel column; past what a page's
    width holds (five panels; RULER's 13 subtasks and their mean are 14), the figure widens to ``MIN_PANEL_IN`` a
    panel, so that titles, ticks and labels keep their room."""
    width = SINGLE_COLUMN_IN if len(tasks) == 1 else WIDE_IN if len(tasks) <= 5 else MIN_PANEL_IN * len(tasks)
    fig = Figure(figsize=(width, PANEL_HEIGHT_IN * len(models) + 0.4), layout="constrained")
    axes = fig.subplots(len(models), len(tasks), squeeze=False)
    for j, task in enumerate(tasks):  # wrapped to the panel's width: a task's settings can make a long name
        title = (titles or {}).get(task, task)
        axes[0, j].set_title(textwrap.fill(title, width=max(24, 72 // len(tasks)), break_long_words=False))
    return fig, axes


def finish_panels(
    fig: Figure, axes: np.ndarray, models: list[str], xlabel: str, ylabel: str, handles: LegendHandles
) -> None:
    """Axis labels on the outer panels and one legend for the figure, in policy order."""
    for i, model in enumerate(models):
        axes[i, 0].set_ylabel(f"{model}\n{ylabel}" if len(models) > 1 else ylabel)
    for ax in axes[-1]:
        ax.set_xlabel(xlabel)
    for ax in axes.flat:
        if not ax.has_data():
            ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center", color="0.5")
    names = sort_policies(k for k in handles if k != FRONTIER) + ([FRONTIER] if FRONTIER in handles else [])
    legend_below(fig, [handles[n] for n in names])


def legend_below(fig: Figure, handles: list[Any], labels: list[str] | None = None) -> None:
    """One legend under the panels (never over data), in as many columns as the figure's width holds; the figure
    grows by its rows."""
    if not handles:
        return
    labels = labels or [str(h.get_label()) for h in handles]
    column_in = LEGEND_HANDLE_IN + LEGEND_CHAR_IN * max(map(len, labels))
    ncols = max(1, min(len(handles), int(fig.get_figwidth() // column_in)))
    fig.set_figheight(fig.get_figheight() + LEGEND_ROW_IN * -(-len(handles) // ncols))
    fig.legend(
        handles,
        labels,
        loc="outside lower center",
        ncols=ncols,
        frameon=False,
        handlelength=2.4,
        columnspacing=1.0,
    )


def _baseline_y(cells: pd.DataFrame) -> float:
    """The full cache's mean over all its examples (its cells are weighted by size)."""
    cells = cells.dropna(subset=["y"])
    return float(np.average(cells["y"], weights=cells["n"])) if len(cells) else float("nan")


def _draw_budget_panel(
    ax: Axes, panel: pd.DataFrame, handles: LegendHandles, styles: Mapping[str, PolicyStyle]
) -> None:
    for policy in sort_policies(panel[POLICY]):
        style = styles[policy]
        cells = panel[panel[POLICY].eq(policy)].dropna(subset=["x", "y"]).sort_values("x")
        if cells.empty:
            continue
        if is_baseline(policy):
            line = ax.axhline(
                _baseline_y(cells), ls="--", color=style.color, lw=1.0, label=style.label, gid=policy, zorder=1.5
            )
            handles.setdefault(policy, line)
            continue
        handles.setdefault(policy, policy_line(ax, cells["x"], cells, style, policy, elinewidth=0.7))


def budget_figure(stats: pd.DataFrame, stage: str, ylabel: str, titles: Mapping[str, str] | None = None) -> Figure:
    """One quantity against achieved budget: a line per policy, the full cache dashed, per model x task.

    ``stats`` is ``cell_stats`` restricted to one quantity; the grid spans every model and task in
    it so figures of different stages line up.
    """
    models, tasks = sorted(stats[MODEL].unique()), sorted(stats[TASK].unique())
    with matplotlib.rc_context(PAPER_RC):
        fig, axes = panel_grid(models, tasks, titles)
        handles: LegendHandles = {}
        staged = stats[stats[STAGE].eq(stage)]
        styles = policy_styles(staged[POLICY])
        for (i, model), (j, task) in ((m, t) for m in enumerate(models) for t in enumerate(tasks)):
            panel = staged[staged[MODEL].eq(model) & staged[TASK].eq(task)]
            _draw_budget_panel(axes[i, j], panel, handles, styles)
            axes[i, j].set_xlim(left=0)
        finish_panels(fig, axes, models, X_LABEL, ylabel, handles)
    return fig


def pareto_figure(
    quality: pd.DataFrame,
    cost: pd.DataFrame,
    stage: str,
    xlabel: str,
    ylabel: str,
    higher_is_better: Mapping[str, bool],
    titles: Mapping[str, str] | None = None,
) -> Figure:
    """Quality against a cost (memory, latency), every cell a point, Pareto-optimal ones on a frontier.

    ``quality`` and ``cost`` are ``cell_stats`` frames of one quantity each; ``higher_is_better``
    gives the quality direction per task. Lower cost is always better.
    """
    models, tasks = sorted(quality[MODEL].unique()), sorted(quality[TASK].unique())
    points = pd.merge(
        quality.loc[quality[STAGE].eq(stage), [*CELL, "y"]],
        cost.loc[cost[STAGE].eq(stage), [*CELL, "y"]].rename(columns={"y": "cost"}),
        on=CELL,
    ).dropna(subset=["y", "cost"])
    with matplotlib.rc_context(PAPER_RC):
        fig, axes = panel_grid(models, tasks, titles)
        handles: LegendHandles = {}
        styles = policy_styles(points[POLICY])
        for (i, model), (j, task) in ((m, t) for m in enumerate(models) for t in enumerate(tasks)):
            ax = axes[i, j]
            panel = points[points[MODEL].eq(model) & points[TASK].eq(task)]
            for policy in sort_policies(panel[POLICY]):
                style = styles[policy]
                cells = panel[panel[POLICY].eq(policy)].sort_values("cost")
                (line,) = ax.plot(
                    cells["cost"],
                    cells["y"],
                    ls="none",
                    marker=style.marker,
                    color=style.color,
                    label=style.label,
                    gid=policy,
                    zorder=style.zorder,
                )
                handles.setdefault(policy, line)
            if panel.empty:
                continue
            front = panel[pareto_mask(panel["cost"], panel["y"], higher_is_better.get(task, True))].sort_values("cost")
            (line,) = ax.plot(
                front["cost"],
                front["y"],
                drawstyle="steps-post",
                color="0.3",
                lw=0.8,
                marker="o",
                ms=7,
                mfc="none",
                mec="0.1",
                mew=0.7,
                label="Pareto frontier",
                gid=FRONTIER,
                zorder=1,
            )
            handles.setdefault(FRONTIER, line)
        finish_panels(fig, axes, models, xlabel, ylabel, handles)
    return fig


def save_figure(fig: Figure, out_dir: Path, stem: str) -> list[Path]:
    """Write ``stem``.png (300 dpi, for report.md) and ``stem``.pdf (vector, for the paper)."""
    paths = [out_dir / f"{stem}.png", out_dir / f"{stem}.pdf"]
    with matplotlib.rc_context(PAPER_RC):
        fig.savefig(paths[0], dpi=300)
        fig.savefig(paths[1])
    return paths


def policy_line(ax: Any, x: Any, cells: pd.DataFrame, style: Any, policy: str, elinewidth: float) -> Any:
    """One policy's points (``cells``' y with its interval) in its style, tagged with its name (``gid``)."""
    bars = ax.errorbar(
        x,
        cells["y"],
        yerr=np.vstack([cells["y"] - cells["ci_low"], cells["ci_high"] - cells["y"]]),
        color=style.color,
        marker=style.marker,
        lw=style.linewidth,
        ls=style.linestyle,
        elinewidth=elinewidth,
        capsize=1.5,
        zorder=style.zorder,
        label=style.label,
    )
    bars.lines[0].set_gid(policy)
    return bars
