"""The capacity experiment's figures and table: what the memory a policy saves buys.

Rows of ``experiment=capacity`` cells (``kind`` "capacity", one per probed batch size) give, per model, task,
stage, policy and budget, the largest batch that fit the cap and the decode tokens/s there.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure

from kvbench.report.plots import save_figure
from kvbench.report.style import SINGLE_COLUMN_IN, is_baseline, policy_style, sort_policies
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


def capacity_cells(rows: pd.DataFrame) -> pd.DataFrame:
    """Per cell: the largest batch that fit and the batch's decode tokens/s at it."""
    fit = rows[rows[FITS].astype(bool)]
    best = fit.sort_values(CAPACITY_BATCH).groupby(KEY, as_index=False).last()
    best = best.rename(columns={CAPACITY_BATCH: MAX_BATCH})
    return best[KEY + [MAX_BATCH, DECODE_TOKENS_PER_S, CAPACITY_MEMORY_GIB]]


def _budget_axis(fig: Figure, cells: pd.DataFrame, column: str, label: str) -> None:
    ax = fig.subplots()
    for policy in sort_policies(cells[POLICY].unique()):
        part = cells[cells[POLICY].eq(policy)].sort_values("budget_value")
        style = policy_style(policy)
        if is_baseline(policy):
            ax.axhline(float(part[column].iloc[0]), color=style.color, linestyle="--", label=policy)
            continue
        ax.plot(part["budget_value"] * 100, part[column], marker=style.marker, color=style.color, label=policy)
    ax.set_xlabel("KV budget (% of the prompt)")
    ax.set_ylabel(label)
    ax.legend()


def capacity_figures(rows: pd.DataFrame, out_dir: Path) -> list[str]:
    """Three figures (PNG + PDF) and a table; returns report.md's lines for them."""
    cells = capacity_cells(rows)
    lines, gib = [], sorted(cells[CAPACITY_MEMORY_GIB].unique())
    for (model, task, stage), group in cells.groupby([MODEL, TASK, STAGE]):
        tag = f"{model}_{task}_{stage}".replace("/", "-")
        for column, stem, label in (
            (DECODE_TOKENS_PER_S, "capacity_tokens_per_s_vs_budget", "decode tokens/s at the largest batch"),
            (MAX_BATCH, "capacity_max_batch_vs_budget", "largest batch that fits"),
        ):
            fig = Figure(figsize=(SINGLE_COLUMN_IN, 2.4), layout="constrained")
            _budget_axis(fig, group, column, label)
            fig.suptitle(f"{model}, {task}, {stage}: cap {gib[0]:g} GiB")
            save_figure(fig, out_dir, f"{stem}_{tag}")
            lines.append(f"![{label}]({stem}_{tag}.png)")
        fig = Figure(figsize=(SINGLE_COLUMN_IN, 2.4), layout="constrained")
        ax = fig.subplots()
        probes = rows[rows[MODEL].eq(model) & rows[TASK].eq(task) & rows[STAGE].eq(stage) & rows[FITS].astype(bool)]
        for (policy, budget), part in probes.groupby([POLICY, "budget_value"]):
            part = part.sort_values(CAPACITY_BATCH)
            style = policy_style(policy)
            ax.plot(
                part[CAPACITY_BATCH],
                part[DECODE_TOKENS_PER_S],
                marker=style.marker,
                color=style.color,
                linestyle="--" if is_baseline(policy) else "-",
                label=policy if is_baseline(policy) else f"{policy} {budget * 100:g}%",
            )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel("decode tokens/s")
        ax.legend(fontsize=6)
        save_figure(fig, out_dir, f"capacity_tokens_per_s_vs_batch_{tag}")
        lines.append(f"![decode tokens/s against batch](capacity_tokens_per_s_vs_batch_{tag}.png)")
    table = cells.assign(budget=(cells["budget_value"] * 100).map(lambda v: f"{v:g}%"))
    lines += [
        "",
        "| model | task | stage | policy | budget | largest batch | decode tokens/s there |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    lines += [
        f"| {r.model} | {r.task} | {r.stage} | {r.policy} | {r.budget} | {r.max_batch} | {r.decode_tokens_per_s:.1f} |"
        for r in table.itertuples()
    ]
    return lines
