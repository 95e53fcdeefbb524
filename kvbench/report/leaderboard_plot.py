"""The leaderboard figure and table: quality against compression ratio on a log2 axis labelled 2×, 4×, ... 32×, a
line per policy, the full cache dashed, a panel per task and one for the mean over tasks; and the paired
differences from a baseline, as markdown."""

from __future__ import annotations

import math
from collections.abc import Mapping

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

from kvbench.report.declared import PolicyFacts
from kvbench.report.leaderboard import MEAN_TASK, baseline_levels, mean_points, paired_over_tasks, task_points
from kvbench.report.plots import LegendHandles, finish_panels, panel_grid, policy_line
from kvbench.report.style import PAPER_RC, display_name, policy_styles, sort_policies, sort_stages
from kvbench.report.tables import markdown_table
from kvbench.results.schema import BUDGET, MODEL, POLICY, STAGE, TASK
from kvbench.stages import Stage

LOWEST, HIGHEST = 2.0, 32.0  # the ratios every leaderboard shows, 1/2 to 1/32 of the cache


def ratio_label(stage: str) -> str:
    """What the ratio divides: the prompt, or in stage=decode the prompt with the tokens generated."""
    kept = "(prompt + max_new_tokens)\n÷ KV kept" if stage == Stage.decode.value else "prompt ÷ KV kept"
    return f"compression ratio\n({kept})"


def _ratio_axis(ax, ratios: pd.Series) -> None:
    ratios = pd.to_numeric(ratios, errors="coerce").astype(float)  # object-typed when cells mix row versions
    finite = ratios[np.isfinite(ratios)]
    low = min(LOWEST, float(finite.min())) if len(finite) else LOWEST
    high = max(HIGHEST, float(finite.max())) if len(finite) else HIGHEST
    ax.set_xscale("log", base=2)
    ax.set_xlim(low / 1.25, high * 1.25)
    ticks = [2.0**k for k in range(math.floor(math.log2(low)), math.ceil(math.log2(high)) + 1)]
    ax.xaxis.set_major_locator(FixedLocator([t for t in ticks if low / 1.25 <= t <= high * 1.25]))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}×"))


def leaderboard_figure(points: pd.DataFrame, levels: pd.DataFrame, stage: str, ylabel: str) -> Figure:
    """``points``: ``task_points`` and ``mean_points`` together; ``levels``: ``baseline_levels``."""
    staged = points[points[STAGE].eq(stage)].dropna(subset=["ratio", "y"])
    models = sorted(points[MODEL].unique())
    tasks = sorted(t for t in points[TASK].unique() if t != MEAN_TASK)
    tasks += [MEAN_TASK] if points[TASK].eq(MEAN_TASK).any() else []
    base = levels[levels[STAGE].eq(stage)]
    with matplotlib.rc_context(PAPER_RC):
        fig, axes = panel_grid(models, tasks, None)
        handles: LegendHandles = {}
        styles = policy_styles([*staged[POLICY], *base[POLICY]])
        for (i, model), (j, task) in ((m, t) for m in enumerate(models) for t in enumerate(tasks)):
            ax = axes[i, j]
            for row in base[base[MODEL].eq(model) & base[TASK].eq(task)].itertuples():
                style = styles[row.policy]
                handles.setdefault(row.policy, ax.axhline(row.y, ls="--", color=style.color, lw=1.0, label=style.label))
            panel = staged[staged[MODEL].eq(model) & staged[TASK].eq(task)]
            for policy in sort_policies(panel[POLICY]):
                cells, style = panel[panel[POLICY].eq(policy)].sort_values("ratio"), styles[policy]
                handles.setdefault(policy, policy_line(ax, cells["ratio"], cells, style, policy, elinewidth=0.6))
            _ratio_axis(ax, staged["ratio"])
        finish_panels(fig, axes, models, ratio_label(stage), ylabel, handles)
    return fig


def _signed(value: float) -> str:
    return f"{value:+.3f}"


def leaderboard_markdown(paired: pd.DataFrame, points: pd.DataFrame) -> str:
    """Per model and stage: policies × budgets, each cell the mean over tasks of (policy − baseline) and its
    stratified paired interval; a cell placed by its achieved budget also says the ratio it reached."""
    parts = []
    means = points[points[TASK].eq(MEAN_TASK)].set_index([MODEL, STAGE, POLICY, BUDGET])["ratio"]
    for (model, stage), block in paired.groupby([MODEL, STAGE], sort=True):
        texts = []
        for r in block.itertuples():
            ratio = means.get((model, stage, r.policy, r.budget), np.nan)
            text = f"{_signed(r.diff)} [{_signed(r.ci_low)}, {_signed(r.ci_high)}]"
            texts.append(text + (f" at {ratio:.3g}×" if np.isfinite(ratio) else ""))
        wide = block.assign(text=texts).pivot_table(index=POLICY, columns=BUDGET, values="text", aggfunc="first")
        order = sorted(wide.columns, key=lambda b: -_ratio_of(b))
        wide = wide.reindex(index=sort_policies(block[POLICY]), columns=order).fillna("–")
        wide = wide.rename(index=display_name).reset_index()
        against, tasks = display_name(block["baseline"].iat[0]), block["tasks"].iat[0]
        heading = f"**{model} · {stage}** − {against}, mean over {tasks} tasks"
        parts.append(f"{heading}\n\n{markdown_table(wide)}")
    return "\n\n".join(parts)


def _ratio_of(budget: str) -> float:
    """A budget column's nominal ratio, for ordering (token budgets last)."""
    return 100.0 / float(budget[:-1]) if budget.endswith("%") else -1.0


def leaderboard_section(
    rows: pd.DataFrame,
    column: str,
    facts: Mapping[str, PolicyFacts],
    quality: pd.DataFrame,
    baseline: str | None,
    ylabel: str,
    n_boot: int,
    seed: int,
) -> tuple[list[tuple[str, Figure]], list[str], pd.DataFrame]:
    """The leaderboard's figures (file stem, figure), report.md's lines and the paired table (for a CSV)."""
    points = pd.concat(
        [task_points(rows, column, facts, quality, n_boot, seed), mean_points(rows, column, facts, n_boot, seed)],
        ignore_index=True,
    ).dropna(subset=["ratio"])
    levels = baseline_levels(rows, column)
    figures = [
        (f"leaderboard_{stage}", leaderboard_figure(points, levels, stage, ylabel))
        for stage in sort_stages(points[STAGE])
    ]
    lines = [
        "## Leaderboard: quality against compression ratio",
        "",
        "x: compression ratio = 1 / the KV budget, a share of the prompt (stage prefill, both) or of prompt + "
        "max_new_tokens (stage decode); a threshold allocation's cells (the budget only caps them) and token "
        "budgets are placed at the ratio they achieved. Error bars: 95 % bootstrap over examples; the mean over "
        "tasks weighs tasks alike and resamples examples within each task (stratified), over cells run on every "
        "task." + (" The dashed line is the full cache." if len(levels) else ""),
        "",
        "\n\n".join(f"![leaderboard, {stem.removeprefix('leaderboard_')}]({stem}.png)" for stem, _ in figures),
    ]
    paired = pd.DataFrame()
    if baseline is not None:
        paired = paired_over_tasks(rows, column, baseline, facts, n_boot, seed)
        shown = display_name(baseline)
        lines += [
            "",
            f"Mean over tasks of (policy − {shown}) per example, with its 95 % paired bootstrap interval "
            f"({n_boot} resamples of the examples both ran, within each task), per budget asked for; the ratio the "
            "cell reached follows.",
            "",
            leaderboard_markdown(paired, points) or f"No cell was run on every task beside {shown}.",
        ]
    return figures, lines, paired
