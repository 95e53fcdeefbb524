"""The needle-in-a-haystack heatmaps: every cell's mean lands at its (length, depth), read back from the figure's
images and tick labels; defaults fill in what a row's settings leave out; the report draws them."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from kvbench.report.build import build_report
from kvbench.report.heatmap import heatmap_figure, niah_rows
from kvbench.report.load import load_rows
from kvbench.tasks.niah import Niah

REPO = Path(__file__).resolve().parents[2]
LENGTHS = [1024, 2048, 4096]  # 4096: the task's default, left out of the rows' settings
DEPTHS = [0, 50, 100]  # 50: the default
BUDGETS = [0.25, 0.5]


def expected(policy: str, budget: float, length: int, depth: int) -> float:
    """A distinct mean per panel and cell."""
    if policy == "full":
        return 1.0 - depth / 1000
    return round(budget * (LENGTHS.index(length) + 1) / 4 + DEPTHS.index(depth) / 10, 6)


def rows_of(policy: str, budget: float, length: int, depth: int) -> list[dict]:
    """Two examples whose scores average to ``expected``, with what a real row's settings would hold."""
    settings = {}
    if length != 4096:
        settings["task.context_tokens"] = length
    if depth != 50:
        settings["task.depth"] = depth  # Hydra's sweep gives an int
    mean = expected(policy, budget, length, depth)
    out = []
    for i, score in enumerate((mean - 0.05, mean + 0.05) if 0.05 <= mean <= 0.95 else (mean, mean)):
        out.append(
            {
                "model": "m",
                "task": "niah",
                "policy": policy,
                "budget": 1.0 if policy == "full" else budget,
                "stage": "prefill",
                "example_id": f"niah-{i}",
                "run_dir": f"{policy}/{budget}/{length}/{depth}",
                "settings": settings,
                "status": "ok",
                "primary_metric": "exact_match",
                "score": score,
                "metric.exact_match": score,
                "budget_achieved": budget,
                "kv_resident_bytes": 1 << 20,
            }
        )
    return out


@pytest.fixture
def sweep(tmp_path) -> Path:
    records = [r for length in LENGTHS for depth in DEPTHS for r in rows_of("full", 1.0, length, depth)]
    records += [
        r for budget in BUDGETS for length in LENGTHS for depth in DEPTHS for r in rows_of("h2o", budget, length, depth)
    ]
    records.append({**records[-1], "example_id": "niah-9", "status": "error", "score": None})  # a failure: no score
    folder = tmp_path / "niah"
    folder.mkdir()
    (folder / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return folder


def read_back(ax) -> dict[tuple[float, float], float]:
    """Each cell of a heatmap axis by (length, depth), from its image and its tick labels."""
    matrix = np.ma.filled(ax.images[0].get_array(), np.nan)
    lengths = [float(t.get_text()) for t in ax.get_xticklabels()]
    depths = [float(t.get_text()) for t in ax.get_yticklabels()]
    assert [round(x) for x in ax.get_xticks()] == list(range(len(lengths)))
    assert [round(y) for y in ax.get_yticks()] == list(range(len(depths)))
    return {(lengths[j], depths[i]): float(matrix[i, j]) for i in range(len(depths)) for j in range(len(lengths))}


def test_each_cell_lands_at_its_length_and_depth(sweep):
    rows = niah_rows(load_rows([sweep]).rows)
    fig = heatmap_figure(rows, "m", "prefill", "h2o")
    axes = {ax.get_gid(): ax for ax in fig.axes if ax.get_gid()}
    assert list(axes) == ["full@full", "h2o@25%", "h2o@50%", "summary"]  # the full cache first, budgets in order
    panels = {"full@full": ("full", 1.0), "h2o@25%": ("h2o", 0.25), "h2o@50%": ("h2o", 0.5)}
    for gid, (policy, budget) in panels.items():
        cells = read_back(axes[gid])
        want = {(float(n), float(d)): expected(policy, budget, n, d) for n in LENGTHS for d in DEPTHS}
        assert cells.keys() == want.keys()
        for key, value in want.items():
            assert cells[key] == pytest.approx(value), (gid, key)
    # Depth grows down the image (the classic figure's 0 % at the top).
    assert [t.get_text() for t in axes["h2o@50%"].get_yticklabels()] == ["0", "50", "100"]
    # The summary panel: the mean over depths against length, one line per panel.
    lines = {line.get_gid(): line for line in axes["summary"].get_lines()}
    for gid, (policy, budget) in {"full@full": ("full", 1.0), "h2o@25%": ("h2o", 0.25)}.items():
        x, y = lines[gid].get_data()
        assert list(x) == LENGTHS
        assert list(y) == pytest.approx([np.mean([expected(policy, budget, n, d) for d in DEPTHS]) for n in LENGTHS])
    assert lines["full@full"].get_linestyle() == "--"


def test_a_missing_cell_stays_empty(sweep):
    rows = niah_rows(load_rows([sweep]).rows)
    rows = rows[~(rows["policy"].eq("h2o") & rows["context_tokens"].eq(2048) & rows["depth"].eq(100))]
    axes = {ax.get_gid(): ax for ax in heatmap_figure(rows, "m", "prefill", "h2o").axes}
    assert np.isnan(read_back(axes["h2o@25%"])[(2048.0, 100.0)])
    assert read_back(axes["h2o@25%"])[(1024.0, 100.0)] == pytest.approx(expected("h2o", 0.25, 1024, 100))


def test_defaults_in_the_report_are_the_configs():
    """A row leaves out what equals the task config's defaults: the report fills them in from the task's."""
    config = OmegaConf.load(REPO / "configs" / "task" / "niah.yaml")
    assert (config.context_tokens, config.depth) == (Niah.context_tokens, Niah.depth) == (4096, 50)


def test_the_report_draws_the_heatmaps(sweep, tmp_path):
    out = tmp_path / "report"
    report = build_report([sweep], out, n_boot=20, log=io.StringIO()).read_text(encoding="utf-8")
    assert "## Needle in a haystack" in report
    assert "(niah_m_prefill_h2o.png)" in report and (out / "niah_m_prefill_h2o.png").is_file()
    assert (out / "niah_m_prefill_h2o.pdf").is_file()


def test_no_niah_rows_no_heatmaps(tmp_path):
    assert niah_rows(load_rows([tmp_path]).rows).empty
