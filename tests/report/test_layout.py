"""Every figure kind of the report, drawn as report.md gets it: no text outside the figure, no legend over a
panel, no two budget labels on top of each other, and no two policies drawn alike."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.text import Annotation, Text

from kvbench.report.aggregate import cell_stats, quality_column, with_full_baseline
from kvbench.report.capacity import capacity_plots
from kvbench.report.declared import policy_facts
from kvbench.report.labels import DISPLAY_NAMES
from kvbench.report.leaderboard import baseline_levels, mean_points, task_points
from kvbench.report.leaderboard_plot import leaderboard_figure
from kvbench.report.load import load_rows
from kvbench.report.plots import budget_figure, pareto_figure
from kvbench.report.served import served_figure, served_points

POLICIES = [*DISPLAY_NAMES, "my_policy", "h2o (window=0.75)", "h2o (window=0.25)"]  # 32 lines
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"  # a long name, as the hub's are


def quality_rows() -> list[dict]:
    rows = []
    for p, policy in enumerate(POLICIES):
        for budget in [1.0] if policy == "full" else [0.5, 0.25, 0.125, 1 / 32]:
            for task in ("retrieval", "xsum"):
                rows += [
                    {"model": MODEL, "task": task, "policy": policy, "budget": budget, "stage": "prefill",
                     "example_id": str(i), "status": "ok", "primary_metric": "accuracy",
                     "score": (p * 7 + i) % 10 / 10 * budget ** 0.2, "budget_achieved": budget,
                     "kv_resident_bytes": budget * 2**24, "decode_ms_mean": 20 + p}
                    for i in range(3)
                ]  # fmt: skip
    return rows


def capacity_rows() -> list[dict]:
    rows = []
    for p, policy in enumerate(["full", "window", "streamingllm", "h2o", "tova", "roco", "snapkv", "keydiff"]):
        for budget in [1.0] if policy == "full" else [0.5, 0.25, 0.125]:
            for batch in (1, 2, 4, 8, 16):
                rows.append(
                    {"model": MODEL, "task": "retrieval", "policy": policy, "budget": budget, "stage": "prefill",
                     "example_id": f"batch={batch}", "kind": "capacity", "status": "ok", "batch": batch,
                     "capacity_batch": batch, "fits": batch <= 2 / budget, "capacity_memory_gib": 0.0625,
                     "decode_tokens_per_s": batch * (30 + p) * (1 - budget / 4)}
                )  # fmt: skip
    return rows


def figures(tmp_path: Path) -> Iterator[tuple[str, Figure]]:
    directory = tmp_path / "s"
    directory.mkdir()
    (directory / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in quality_rows() + capacity_rows()))
    rows = load_rows([directory]).rows
    capacity, rows = rows[rows["kind"].eq("capacity")], rows[rows["kind"].ne("capacity")]
    column, _ = quality_column(rows, None)
    stats = with_full_baseline(cell_stats(rows, [column, "kv_resident_bytes"], 50))
    quality = stats[stats["quantity"].eq(column)]
    yield "quality vs budget", budget_figure(quality, "prefill", "accuracy")
    cost = stats[stats["quantity"].eq("kv_resident_bytes")]
    yield "pareto", pareto_figure(quality, cost, "prefill", "resident KV (MiB)", "accuracy", {})
    for stem, _, fig in capacity_plots(capacity):
        yield stem, fig
    facts = policy_facts(rows)
    points = pd.concat([task_points(rows, column, facts, quality), mean_points(rows, column, facts, 50)])
    levels = baseline_levels(rows, column)
    yield "leaderboard", leaderboard_figure(points, levels, "prefill", "accuracy")
    decode = points.assign(stage="decode")  # its axis says what the ratio divides in stage=decode, at more length
    yield "leaderboard, decode", leaderboard_figure(decode, levels.assign(stage="decode"), "decode", "accuracy")
    served, _ = served_points(capacity, quality)
    yield "served", served_figure(served, f"{MODEL}\nretrieval, cap 64 MiB", "accuracy")


def layout_problems(fig: Figure) -> list[str]:
    """What is cut off or covered once the figure is saved as report.md's PNG."""
    FigureCanvasAgg(fig)
    fig.savefig(io.BytesIO(), format="png", dpi=100)
    renderer = fig.canvas.get_renderer()
    bounds = fig.bbox.padded(1.0)
    problems = []
    axes = [axis for ax in fig.axes for axis in (ax.xaxis, ax.yaxis)]
    ticks = {id(t) for axis in axes for t in axis.get_ticklabels(minor=False) + axis.get_ticklabels(minor=True)}
    texts = [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip() and id(t) not in ticks]
    boxes = [(repr(t.get_text()), t.get_window_extent(renderer)) for t in texts]
    boxes += [(f"tick labels of {axis.axis_name}", axis.get_tightbbox(renderer)) for axis in axes]  # drawn ones
    for name, box in boxes:
        if box is not None and not (bounds.contains(box.x0, box.y0) and bounds.contains(box.x1, box.y1)):
            problems.append(f"cut off: {name}")
    legends = [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend())]
    for legend in legends:
        for ax in fig.axes:
            if legend.get_window_extent(renderer).overlaps(ax.get_window_extent(renderer)):
                problems.append("a legend covers a panel")
    labels = [t.get_window_extent(renderer) for t in texts if isinstance(t, Annotation)]
    for i, box in enumerate(labels):
        problems += ["two budget labels overlap" for other in labels[i + 1 :] if box.overlaps(other)]
    return problems


def test_every_figure_kind_keeps_its_text_inside_and_its_legend_off_the_panels(tmp_path: Path) -> None:
    drawn = dict(figures(tmp_path))
    assert len(drawn) == 8
    for name, fig in drawn.items():
        assert layout_problems(fig) == [], name


@pytest.mark.parametrize("kind", ["quality vs budget", "leaderboard"])
def test_no_two_of_thirty_policies_are_drawn_alike(tmp_path: Path, kind: str) -> None:
    fig = dict(figures(tmp_path))[kind]
    looks = {}
    for line in fig.axes[0].get_lines():
        if line.get_gid():
            looks[line.get_gid()] = (line.get_color(), str(line.get_linestyle()), line.get_marker())
    assert len(looks) >= len(POLICIES) - 4  # every policy that has a point in the first panel
    assert len(set(looks.values())) == len(looks)
    colour_style = [(c, s) for c, s, _ in looks.values()]
    assert len(set(colour_style)) == len(colour_style)  # apart even without markers


def overlaps(boxes: list) -> bool:
    return any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1 :])


@pytest.mark.parametrize("kind", ["quality vs budget", "leaderboard"])
def test_thirteen_tasks_keep_titles_ticks_and_labels_apart(tmp_path: Path, kind: str) -> None:
    """RULER's 13 subtasks (and their mean): the figure widens instead of squeezing its panels together."""
    subsets = [f"ruler/niah_multikey_{i} (question_aware=true)" for i in range(13)]
    rows = [
        {"model": MODEL, "task": task, "policy": policy, "budget": budget, "stage": "prefill", "example_id": str(i),
         "status": "ok", "primary_metric": "accuracy", "score": (i + j) % 3 / 3, "budget_achieved": budget}
        for j, task in enumerate(subsets) for policy in ("full", "snapkv", "streamingllm")
        for budget in ([1.0] if policy == "full" else [0.5, 0.25, 0.125, 1 / 16, 1 / 32]) for i in range(2)
    ]  # fmt: skip
    directory = tmp_path / "s"
    directory.mkdir()
    (directory / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    loaded = load_rows([directory]).rows
    column, _ = quality_column(loaded, None)
    quality = with_full_baseline(cell_stats(loaded, [column], 20))
    if kind == "leaderboard":
        facts = policy_facts(loaded)
        points = pd.concat([task_points(loaded, column, facts, quality), mean_points(loaded, column, facts, 20)])
        fig = leaderboard_figure(points, baseline_levels(loaded, column), "prefill", "accuracy")
    else:
        fig = budget_figure(quality, "prefill", "accuracy")
    assert layout_problems(fig) == []
    renderer = fig.canvas.get_renderer()
    assert not overlaps([ax.title.get_window_extent(renderer) for ax in fig.axes]), "panel titles overlap"
    assert not overlaps([ax.xaxis.label.get_window_extent(renderer) for ax in fig.axes]), "x labels overlap"
    for ax in fig.axes:
        ticks = [t.get_window_extent(renderer) for t in ax.get_xticklabels() if t.get_text()]
        assert not overlaps(ticks), "x tick labels overlap"


def test_a_profiled_policy_is_known_by_its_name(monkeypatch):
    """A cell of ``policy=profiled/headkv`` is labelled ``headkv``: its config is found in its folder, so the
    coverage knows it refuses stage=decode (no missing decode cells listed for it). The config reads the
    committed profile, relative to the repository."""
    from conftest import REPO

    from kvbench.report.declared import facts

    monkeypatch.chdir(REPO)
    facts.cache_clear()
    assert facts("headkv").refused_stages == ("decode",)
    assert facts("no_such_policy").refused_stages == ()
