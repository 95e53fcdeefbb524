"""What the memory buys, with what it costs: at a capacity experiment's memory cap, each policy × budget's decode
tokens/s at the largest batch that fit against its quality, so one figure shows which policy serves the most
tokens/s at a given quality.

The quality comes from the quality sweep's cell of the same model, task, policy, budget and stage (labels
included, kvbench.report.labels: a task run at another length is another task); the full cache's from any stage.
Both sweeps are given to one report: ``kvbench-report QUALITY_DIR CAPACITY_DIR``.
"""

from __future__ import annotations

from collections.abc import Iterator

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.transforms import Bbox

from kvbench.report.capacity import KEY, cap_title, capacity_cells
from kvbench.report.plots import legend_below
from kvbench.report.style import PAPER_RC, SINGLE_COLUMN_IN, is_baseline, policy_styles, sort_policies
from kvbench.results.schema import CAPACITY_MEMORY_GIB, DECODE_TOKENS_PER_S, MODEL, POLICY, STAGE, TASK

# Where a budget's label may sit beside its point (points), tried in turn until it overlaps no other label.
OFFSETS = ((5, 2), (5, -8), (-5, 2), (-5, -8), (0, 6), (0, -13), (9, -3), (-9, -3), (12, 8), (-12, 8))


def served_points(capacity_rows: pd.DataFrame, quality: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Capacity cells with the quality of their matching cell (``quality``: ``cell_stats`` of one quantity), and
    the capacity cells that have none."""
    cells = capacity_cells(capacity_rows)
    wanted = quality[[*KEY, "y", "ci_low", "ci_high"]]
    full = wanted[wanted[POLICY].map(is_baseline)].drop(columns=[STAGE, "budget_value"])
    full = full.groupby([MODEL, TASK, POLICY], as_index=False).first()
    evicting = cells[~cells[POLICY].map(is_baseline)].merge(wanted, on=KEY, how="left")
    baseline = cells[cells[POLICY].map(is_baseline)].merge(full, on=[MODEL, TASK, POLICY], how="left")
    merged = pd.concat([evicting, baseline], ignore_index=True)
    return merged.dropna(subset=["y"]), merged[merged["y"].isna()][KEY]


def _place_labels(fig: Figure, ax: Axes, points: list[tuple[float, float, str]]) -> None:
    """Each point's budget label at the first offset whose box stays in the panel and overlaps no point and no
    label placed before it;
    placed once the layout is final (labels are left out of the layout, so they do not move it)."""
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    pad = renderer.points_to_pixels(3.0)
    centres = ax.transData.transform([(x, y) for x, y, _ in points]) if points else np.empty((0, 2))
    taken = [Bbox.from_extents(cx - pad, cy - pad, cx + pad, cy + pad) for cx, cy in centres]
    for x, y, text in points:
        for dx, dy in OFFSETS:
            label = ax.annotate(
                text,
                (x, y),
                xytext=(dx, dy),
                textcoords="offset points",
                fontsize=6,
                ha="left" if dx > 0 else "right" if dx < 0 else "center",
                color="0.25",
                annotation_clip=False,
            )
            label.set_in_layout(False)
            box = label.get_window_extent(renderer)
            inside = ax.bbox.contains(box.x0, box.y0) and ax.bbox.contains(box.x1, box.y1)
            if (inside and not any(box.overlaps(other) for other in taken)) or (dx, dy) == OFFSETS[-1]:
                taken.append(box)
                break
            label.remove()


def served_figure(points: pd.DataFrame, title: str, ylabel: str) -> Figure:
    """Quality against decode tokens/s at the largest batch: a point per policy × budget (labelled by the budget),
    a policy's points joined, the full cache a star."""
    with matplotlib.rc_context(PAPER_RC):
        fig = Figure(figsize=(SINGLE_COLUMN_IN, 2.4), layout="constrained")
        ax = fig.subplots()
        ax.set_title(title)
        styles, handles, labels = policy_styles(points[POLICY]), [], []
        for policy in sort_policies(points[POLICY]):
            part, style = points[points[POLICY].eq(policy)].sort_values("budget_value"), styles[policy]
            (line,) = ax.plot(
                part[DECODE_TOKENS_PER_S],
                part["y"],
                marker=style.marker,
                ms=5 if is_baseline(policy) else 3.5,
                color=style.color,
                ls="none" if is_baseline(policy) else style.linestyle,
                lw=0.8,
                label=style.label,
                gid=policy,
            )
            handles.append(line)
            if not is_baseline(policy):
                labels += [
                    (r[DECODE_TOKENS_PER_S], r["y"], f"{r['budget_value'] * 100:g}%") for _, r in part.iterrows()
                ]
        ax.set_xlabel("decode tokens/s at the largest batch that fits")
        ax.set_ylabel(ylabel)
        ax.margins(x=0.12, y=0.15)
        legend_below(fig, handles)
        _place_labels(fig, ax, labels)
    return fig


def served_plots(points: pd.DataFrame, ylabel: str) -> Iterator[tuple[str, str, Figure]]:
    """(file stem, caption, figure) per model, task and stage with capacity cells that have a quality."""
    for (model, task, stage), group in points.groupby([MODEL, TASK, STAGE]):
        if group[POLICY].map(is_baseline).all():
            continue  # the full cache alone compares nothing
        tag = f"{model}_{task}_{stage}".replace("/", "-")
        title = cap_title(model, task, stage, float(group[CAPACITY_MEMORY_GIB].iat[0]))
        yield (
            f"served_quality_vs_tokens_per_s_{tag}",
            f"{ylabel} against decode tokens/s at the cap",
            served_figure(group, title, ylabel),
        )
