"""Needle-in-a-haystack heatmaps, as Kamradt drew them: the mean score by context length (x) and needle depth (y).

One figure per model, stage and policy: the full cache's heatmap first, then the policy's at each budget, then a
summary panel (the mean over depths against length, the full cache dashed), so that what eviction forgets shows as
the cells that change colour from the full cache's. A cell's length and depth are its ``task.context_tokens`` and
``task.depth`` settings; a row records only what differs from the task's defaults, so a missing one is the
default's. Each heatmap axis has the ``gid`` ``policy@budget`` and its image holds the means (depths down the rows,
lengths along the columns, both ascending); the summary axis has the ``gid`` ``summary``: tests read the numbers
back from the figure.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.image import AxesImage

from kvbench.report.labels import base_name
from kvbench.report.plots import save_figure
from kvbench.report.style import (
    PAPER_RC,
    WIDE_IN,
    display_name,
    is_baseline,
    policy_style,
    sort_policies,
    sort_stages,
)
from kvbench.results.schema import BUDGET, MODEL, POLICY, SCORE, SETTINGS, STAGE, TASK
from kvbench.tasks.niah import Niah

TASK_NAME = "niah"
LENGTH, DEPTH = "context_tokens", "depth"  # the task's options, and the columns ``niah_rows`` adds
FULL = "full"  # the budget part of the full cache's gid
SUMMARY = "summary"
CMAP = "RdYlGn"  # red (forgotten) to green (found), as the classic figure
LINE_COLORS = ("#1f77b4", "#ff7f0e", "#9467bd", "#8c564b", "#17becf", "#e377c2")  # the budgets in the summary
PANEL_IN, HEIGHT_IN = 1.45, 2.6
Panel = tuple[str, str, pd.DataFrame]  # (title, gid, rows)


def niah_rows(rows: pd.DataFrame) -> pd.DataFrame:
    """The rows of NIAH cells, with their ``context_tokens`` and ``depth`` (the task's default where the row's
    settings do not name it). A failed example has no score, so it counts nowhere."""
    if rows.empty or TASK not in rows:
        return rows.iloc[0:0].assign(**{LENGTH: [], DEPTH: []})
    out = rows[rows[TASK].map(base_name).eq(TASK_NAME)].copy()
    settings = out[SETTINGS] if SETTINGS in out else pd.Series([{}] * len(out), index=out.index, dtype=object)
    for option in (LENGTH, DEPTH):
        default = float(getattr(Niah, option))
        out[option] = [float(s.get(f"task.{option}", default)) if isinstance(s, Mapping) else default for s in settings]
    return out


def grid(cells: pd.DataFrame) -> tuple[list[float], list[float], np.ndarray]:
    """(lengths, depths, means): the mean score of each (depth, length), NaN where no row ran; depths are the
    matrix's rows, lengths its columns, both ascending."""
    lengths, depths = sorted(set(cells[LENGTH])), sorted(set(cells[DEPTH]))
    matrix = np.full((len(depths), len(lengths)), np.nan)
    for (depth, length), value in cells.groupby([DEPTH, LENGTH])[SCORE].mean().items():
        matrix[depths.index(depth), lengths.index(length)] = value
    return lengths, depths, matrix


def _ticks(values: list[float]) -> list[str]:
    return [f"{v:g}" for v in values]


def _heatmap(ax: Axes, panel: Panel, limits: tuple[float, float]) -> AxesImage:
    title, gid, cells = panel
    lengths, depths, matrix = grid(cells)
    image = ax.imshow(matrix, cmap=CMAP, vmin=limits[0], vmax=limits[1], aspect="auto", interpolation="nearest")
    ax.set_gid(gid)
    ax.set_title(title)
    ax.set_xticks(range(len(lengths)), _ticks(lengths), rotation=90)
    ax.set_yticks(range(len(depths)), _ticks(depths))
    ax.set_xlabel("context (tokens)")
    ax.grid(False)
    return image


def _summary(ax: Axes, panels: list[Panel], metric: str, limits: tuple[float, float]) -> None:
    """The mean over depths (each depth weighted alike) against length: the full cache dashed, a line per budget."""
    colors = iter(LINE_COLORS * len(panels))
    for title, gid, cells in panels:
        lengths, _, matrix = grid(cells)
        policy = gid.rsplit("@", 1)[0]
        full = is_baseline(policy)
        ax.plot(
            lengths,
            np.nanmean(matrix, axis=0),
            linestyle="--" if full else "-",
            marker=policy_style(policy).marker,
            color="black" if full else next(colors),
            label=title,
            gid=gid,
        )
    ax.set_gid(SUMMARY)
    ax.set_title("mean over depths")
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel(metric)
    margin = 0.05 * (limits[1] - limits[0])
    ax.set_ylim(limits[0] - margin, limits[1] + margin)  # the colour bar's range
    ax.legend(loc="lower left", frameon=False)


def _panels(rows: pd.DataFrame, policy: str) -> list[Panel]:
    """The full cache's panel (when it ran), then ``policy``'s at each budget in budget order."""
    panels = [(policy_style(p).label, f"{p}@{FULL}", rows[rows[POLICY].eq(p)]) for p in sort_policies(rows[POLICY])]
    panels = [panel for panel in panels if is_baseline(panel[1].rsplit("@", 1)[0])]
    if is_baseline(policy):
        return [panel for panel in panels if panel[1] == f"{policy}@{FULL}"]
    own = rows[rows[POLICY].eq(policy)]
    for budget in own.drop_duplicates(BUDGET).sort_values(["budget_kind", "budget_value"])[BUDGET]:
        panels.append((f"{policy_style(policy).label}, {budget}", f"{policy}@{budget}", own[own[BUDGET].eq(budget)]))
    return panels


def heatmap_figure(rows: pd.DataFrame, model: str, stage: str, policy: str, metric: str = "exact match") -> Figure:
    """The full cache's heatmap, ``policy``'s at each of its budgets, and the summary panel; ``rows`` as
    ``niah_rows`` returns them. Colours run from 0 to 1 (to the largest score where scores pass 1)."""
    here = rows[rows[MODEL].eq(model) & rows[STAGE].eq(stage)]
    panels = _panels(here, policy)
    limits = (min(0.0, float(here[SCORE].min())), max(1.0, float(here[SCORE].max())))
    with matplotlib.rc_context(PAPER_RC):
        width = max(WIDE_IN, PANEL_IN * (len(panels) + 1.5))
        fig = Figure(figsize=(width, HEIGHT_IN), layout="constrained")
        axes = list(fig.subplots(1, len(panels) + 1, squeeze=False)[0])
        images = [_heatmap(ax, panel, limits) for ax, panel in zip(axes, panels)]
        axes[0].set_ylabel("needle depth (% of haystack)")
        fig.colorbar(images[0], ax=axes[: len(panels)], label=metric, shrink=0.9)
        _summary(axes[-1], panels, metric, limits)
        fig.suptitle(f"Needle in a haystack: {model}, {stage}, {policy_style(policy).label}")
    return fig


def heatmap_figures(rows: pd.DataFrame, out_dir: Path, metric: str = "exact match") -> list[str]:
    """Save a heatmap figure per model, stage and policy of the NIAH rows (the full cache alone when no other
    policy ran); returns report.md's image lines, none without NIAH rows."""
    cells = niah_rows(rows)
    lines: list[str] = []
    for model in sorted(set(cells[MODEL])):
        for stage in sort_stages(cells.loc[cells[MODEL].eq(model), STAGE]):
            here = cells[cells[MODEL].eq(model) & cells[STAGE].eq(stage)]
            named = sort_policies(here[POLICY])
            for policy in [p for p in named if not is_baseline(p)] or named:
                stem = "".join(c if c.isalnum() or c in "_.-" else "_" for c in f"niah_{model}_{stage}_{policy}")
                save_figure(heatmap_figure(here, model, stage, policy, metric), out_dir, stem)
                lines.append(f"![needle in a haystack, {model}, {stage}, {display_name(policy)}]({stem}.png)")
    return lines
