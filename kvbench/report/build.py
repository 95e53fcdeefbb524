"""Put a report together: read rows, aggregate, write figures, tables and ``report.md``.

Partial sweeps are the normal case while a sweep runs, so gaps and failures are reported
(in report.md and on stderr) instead of stopping the report.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

import pandas as pd
from matplotlib.figure import Figure

from kvbench.report.aggregate import N_BOOT, cell_stats, quality_column, with_full_baseline
from kvbench.report.capacity import capacity_figures
from kvbench.report.coverage import coverage, coverage_markdown, log_coverage
from kvbench.report.declared import policy_facts
from kvbench.report.heatmap import heatmap_figures
from kvbench.report.labels import shared_settings
from kvbench.report.leaderboard_plot import leaderboard_section
from kvbench.report.load import load_rows
from kvbench.report.paired import paired_differences, paired_markdown
from kvbench.report.plots import budget_figure, pareto_figure, save_figure
from kvbench.report.served import served_plots, served_points
from kvbench.report.style import (
    display_name,
    is_baseline,
    lower_is_better,
    metric_label,
    resolve_policy,
    sort_policies,
    sort_stages,
)
from kvbench.report.tables import quality_csv, quality_markdown
from kvbench.results.schema import (
    DECODE_MS_MEAN,
    DECODE_TOKENS_PER_S,
    KIND,
    KIND_CAPACITY,
    KV_RESIDENT_BYTES,
    PEAK_MEMORY_BYTES,
    POLICY,
    SCORE,
    STAGE,
    STATUS,
    STATUS_OK,
    TTFT_S,
)

MIB, GIB = 2.0**-20, 2.0**-30

# (column, file stem, axis label, scale) of the systems figures against budget.
SYSTEMS = (
    (KV_RESIDENT_BYTES, "kv_resident_vs_budget", "resident KV (MiB)", MIB),
    (PEAK_MEMORY_BYTES, "peak_memory_vs_budget", "peak memory (GiB)", GIB),
    (DECODE_TOKENS_PER_S, "decode_tokens_per_s_vs_budget", "decode tokens/s", 1.0),
    (TTFT_S, "ttft_vs_budget", "time to first token (s)", 1.0),
)
# (cost column, file stem, axis label, scale) of the quality-vs-cost Pareto figures.
PARETO = (
    (KV_RESIDENT_BYTES, "pareto_memory", "resident KV (MiB)", MIB),
    (DECODE_MS_MEAN, "pareto_latency", "decode latency (ms/token)", 1.0),
)


def _quantity(stats: pd.DataFrame, column: str, scale: float = 1.0) -> pd.DataFrame:
    """The cells of one quantity, in display units."""
    frame = stats[stats["quantity"].eq(column)].copy()
    frame[["y", "ci_low", "ci_high"]] *= scale
    return frame


def _has_data(frame: pd.DataFrame, stage: str) -> bool:
    return bool(frame.loc[frame[STAGE].eq(stage), "y"].notna().any())


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def _write_figures(
    stats: pd.DataFrame, column: str, names: dict[str, str], stages: list[str], out_dir: Path
) -> dict[str, list[str]]:
    """Save every figure that has data; returns report.md image lines by section."""
    quality = _quantity(stats, column)
    single_metric = len(set(names.values())) == 1
    quality_label = metric_label(next(iter(names.values()))) if single_metric else SCORE
    titles = None if single_metric else {task: f"{task} ({metric_label(name)})" for task, name in names.items()}
    better = {task: not lower_is_better(name) for task, name in names.items()}
    sections: dict[str, list[str]] = {"Quality vs budget": [], "Memory and time vs budget": [], "Pareto fronts": []}

    def emit(section: str, stem: str, caption: str, fig: Figure) -> None:
        save_figure(fig, out_dir, _safe(stem))
        sections[section].append(f"![{caption}]({_safe(stem)}.png)")

    for stage in stages:
        if _has_data(quality, stage):
            fig = budget_figure(quality, stage, quality_label, titles)
            emit("Quality vs budget", f"quality_vs_budget_{stage}", f"{quality_label} vs budget, {stage}", fig)
        for name, stem, label, scale in SYSTEMS:
            frame = _quantity(stats, name, scale)
            if _has_data(frame, stage):
                fig = budget_figure(frame, stage, label)
                emit("Memory and time vs budget", f"{stem}_{stage}", f"{label} vs budget, {stage}", fig)
        for name, stem, label, scale in PARETO:
            cost = _quantity(stats, name, scale)
            if _has_data(quality, stage) and _has_data(cost, stage):
                fig = pareto_figure(quality, cost, stage, label, quality_label, better, titles)
                emit("Pareto fronts", f"{stem}_{stage}", f"{quality_label} vs {label}, {stage}", fig)
    return sections


def _served_lines(capacity_rows: pd.DataFrame, quality: pd.DataFrame, label: str, out_dir: Path) -> list[str]:
    """What the memory buys: quality against decode tokens/s at the cap, where the quality sweep has the cells."""
    points, unmatched = served_points(capacity_rows, quality)
    lines = ["", "### What the memory buys, with what it costs", ""]
    for stem, caption, fig in served_plots(points, label):
        save_figure(fig, out_dir, stem)
        lines.append(f"![{caption}]({stem}.png)")
    if len(unmatched):
        named = unmatched.assign(**{POLICY: unmatched[POLICY].map(display_name)})
        cells = ", ".join(" / ".join(map(str, cell)) for cell in named.itertuples(index=False))
        lines += ["", f"No quality cell of the same model, task, policy, budget and stage for: {cells}."]
    return lines


def _paired_section(
    rows: pd.DataFrame, column: str, names: dict[str, str], baseline: str, n_boot: int, seed: int, out_dir: Path
) -> list[str]:
    """report.md's lines comparing every policy with ``baseline`` example by example; writes the CSV beside."""
    table = paired_differences(rows, column, names, baseline, n_boot, seed)
    table.to_csv(out_dir / f"paired_{_safe(baseline)}.csv", index=False)
    shown = display_name(baseline)
    return [
        f"## Paired differences against {shown}",
        "",
        f"Each cell: the mean over examples of (policy − {shown}) in the quality metric, its 95 % paired "
        f"bootstrap interval ({n_boot} resamples of the examples both finished), then on how many examples the "
        "policy did better / worse, of the pairs.",
        "",
        paired_markdown(table) or "No examples in common.",
    ]


def build_report(
    roots: Sequence[Path],
    out_dir: Path,
    metric: str | None = None,
    n_boot: int = N_BOOT,
    seed: int = 0,
    log: TextIO | None = None,
    paired: Sequence[str] = (),
    baseline: str | None = None,
) -> Path:
    """Write every figure, the tables and ``report.md`` into ``out_dir``; returns report.md's path.

    ``paired``: baseline policies each other policy is compared with example by example (``report.paired``);
    ``baseline``: the policy the leaderboard's table compares with (default: the full cache, when it ran). Both
    take a policy's config name or its display name, in any case (``style.resolve_policy``).
    Progress, gaps and failures go to ``log`` (standard error by default).
    """
    log = log or sys.stderr
    loaded = load_rows(roots)
    rows = loaded.rows
    if rows.empty:
        raise ValueError(f"no rows.jsonl rows under {', '.join(map(str, roots))}")
    paired = [resolve_policy("--paired", name, rows[POLICY]) for name in paired]
    if baseline is not None:
        baseline = resolve_policy("--baseline", baseline, rows[POLICY])
    out_dir.mkdir(parents=True, exist_ok=True)
    is_capacity = rows[KIND].eq(KIND_CAPACITY)
    capacity_rows = rows[is_capacity]
    capacity = capacity_figures(capacity_rows, out_dir) if is_capacity.any() else []
    rows = rows[~is_capacity]
    if rows.empty:
        report = out_dir / "report.md"
        report.write_text("\n".join(["# kvbench report", "", "## Capacity", "", *capacity, ""]), encoding="utf-8")
        print(f"kvbench-report: wrote {report}", file=log)
        return report
    column, names = quality_column(rows, metric)
    quantities = [column, *(c for c, *_ in SYSTEMS), *(c for c, *_ in PARETO)]
    stats = with_full_baseline(cell_stats(rows, list(dict.fromkeys(quantities)), n_boot, seed))
    facts = policy_facts(rows)
    cover = coverage(rows, roots, {policy: fact.refused_stages for policy, fact in facts.items()})
    log_coverage(log, loaded, cover)

    sections = _write_figures(stats, column, names, sort_stages(rows[STAGE]), out_dir)
    sections["Needle in a haystack"] = heatmap_figures(rows, out_dir)
    quality = _quantity(stats, column)
    quality_label = metric_label(next(iter(names.values()))) if len(set(names.values())) == 1 else SCORE
    baseline = baseline or next((p for p in sort_policies(rows[POLICY]) if is_baseline(p)), None)
    board_figures, board, board_paired = leaderboard_section(
        rows, column, facts, quality, baseline, quality_label, n_boot, seed
    )
    for stem, fig in board_figures:
        save_figure(fig, out_dir, stem)
    if len(board_paired):
        board_paired.to_csv(out_dir / f"leaderboard_paired_{_safe(str(baseline))}.csv", index=False)
    if is_capacity.any():
        capacity += _served_lines(capacity_rows, quality, quality_label, out_dir)
    tables_md = quality_markdown(quality, names)
    quality_csv(quality, names).to_csv(out_dir / "quality_table.csv", index=False)
    (out_dir / "quality_table.md").write_text(tables_md + "\n", encoding="utf-8")
    stats.to_csv(out_dir / "cells.csv", index=False)

    ok = int(rows[STATUS].eq(STATUS_OK).sum())
    dashed = "; the dashed line is the full cache" if rows[POLICY].map(is_baseline).any() else ""
    parts = [
        "# kvbench report",
        "",
        f"{len(rows)} example rows ({ok} ok, {len(rows) - ok} failed) from {len(loaded.files)} files under "
        + ", ".join(f"`{root}`" for root in roots)
        + f". Quality: {', '.join(sorted(set(names.values())))}. "
        f"Error bars: 95 % percentile bootstrap over examples ({n_boot} resamples, seed {seed}; the questions of "
        "one context resampled together). "
        f"x = mean achieved budget of the cell{dashed}.",
    ]
    shared = shared_settings(rows)
    if shared:
        listed = ", ".join(f"`{key}={value}`" for key, value in shared)
        parts += ["", f"Every cell changes these of its named defaults: {listed}."]
    if not cover.missing.empty:
        parts += ["", f"**Partial sweep: {len(cover.missing)} missing cells, listed under Coverage.**"]
    for title, images in sections.items():
        if images:
            parts += ["", f"## {title}", "", "\n\n".join(images)]
    if board_figures:
        parts += ["", *board]
    if capacity:
        parts += ["", "## Capacity", "", *capacity]
    parts += ["", "## Quality tables", "", "Best policy per budget in bold (the full cache is the reference).", ""]
    parts += [tables_md or "No quality values."]
    for baseline in paired:
        parts += ["", *_paired_section(rows, column, names, baseline, n_boot, seed, out_dir)]
    parts += ["", coverage_markdown(loaded, cover), ""]
    report = out_dir / "report.md"
    report.write_text("\n".join(parts), encoding="utf-8")
    print(f"kvbench-report: wrote {report}", file=log)
    return report
