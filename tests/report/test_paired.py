"""kvbench-report --paired: per-example differences against a baseline policy, checked by hand and NumPy."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from test_report import row, write_rows

from kvbench.report.cli import main
from kvbench.report.load import load_rows
from kvbench.report.paired import paired_differences


def paired(root: Path, baseline: str, n_boot: int = 200):
    rows = load_rows([root]).rows
    return paired_differences(rows, "score", {"retrieval": "exact_match", "ppl": "perplexity"}, baseline, n_boot)


def test_the_difference_is_of_matched_examples_and_the_interval_resamples_pairs(tmp_path: Path) -> None:
    """Examples of very different difficulty, a policy better by exactly 0.1 on each: the paired interval is
    exactly 0.1 wide of nothing, where the two cells' own intervals overlap widely."""
    easy_to_hard = [0.9, 0.5, 0.1, 0.7, 0.3]
    rows = [row("pyramidkv", 0.2, s, example=str(i)) for i, s in enumerate(easy_to_hard)]
    rows += [row("profiled", 0.2, s + 0.1, example=str(i)) for i, s in enumerate(easy_to_hard)]
    rows += [row("profiled", 0.2, 0.0, example="only-here")]  # no partner: not paired
    write_rows(tmp_path / "s", rows)
    (result,) = paired(tmp_path / "s", "pyramidkv").itertuples()
    assert result.policy == "profiled" and result.n == 5
    assert np.isclose(result.diff, 0.1) and np.isclose(result.ci_low, 0.1) and np.isclose(result.ci_high, 0.1)
    assert (result.better, result.worse) == (5, 0)


def test_interval_and_counts_against_numpy(tmp_path: Path) -> None:
    """The interval is the percentile bootstrap of the paired mean; checked against NumPy's own resampling of
    the differences (independent code) to within the resampling noise."""
    gen = np.random.default_rng(3)
    base, other = gen.random(40), gen.random(40)
    rows = [row("snapkv", 0.1, float(b), example=f"e{i}") for i, b in enumerate(base)]
    rows += [row("pyramidkv", 0.1, float(o), example=f"e{i}") for i, o in enumerate(other)]
    write_rows(tmp_path / "s", rows)
    (result,) = paired(tmp_path / "s", "snapkv", n_boot=4000).itertuples()
    diff = other - base
    means = diff[np.random.default_rng(0).integers(0, 40, size=(4000, 40))].mean(axis=1)
    low, high = np.percentile(means, [2.5, 97.5])
    assert np.isclose(result.diff, diff.mean())
    assert abs(result.ci_low - low) < 0.02 and abs(result.ci_high - high) < 0.02
    assert (result.better, result.worse) == (int((diff > 0).sum()), int((diff < 0).sum()))


def test_lower_is_better_metrics_count_a_drop_as_better(tmp_path: Path) -> None:
    rows = [row("window", 0.5, 10.0, example="a", task="ppl", metric="perplexity")]
    rows += [row("h2o", 0.5, 8.0, example="a", task="ppl", metric="perplexity")]
    write_rows(tmp_path / "s", rows)
    (result,) = paired(tmp_path / "s", "window").itertuples()
    assert result.diff == -2.0 and (result.better, result.worse) == (1, 0)


def test_the_full_cache_pairs_with_every_budget(tmp_path: Path) -> None:
    """The full cache has one budget (its own); each evicting budget is paired with it."""
    rows = [row("full", 1.0, 1.0, example=e) for e in "ab"]
    rows += [row("h2o", b, s, example=e) for b, s in ((0.1, 0.0), (0.5, 1.0)) for e in "ab"]
    write_rows(tmp_path / "s", rows)
    table = paired(tmp_path / "s", "full").set_index("budget")
    assert table.loc["10%", "diff"] == -1.0 and table.loc["50%", "diff"] == 0.0
    assert table.loc["10%", "worse"] == 2 and table.loc["50%", "n"] == 2


def test_cli_writes_the_section_and_csv_and_refuses_an_unknown_baseline(tmp_path: Path, capsys) -> None:
    rows = [row(p, 0.2, s, example=e) for p, s in (("snapkv", 0.0), ("pyramidkv", 1.0)) for e in "abc"]
    write_rows(tmp_path / "s", rows)
    out = tmp_path / "out"
    assert main([str(tmp_path / "s"), "--out", str(out), "--bootstrap", "50", "--paired", "snapkv"]) == 0
    report = (out / "report.md").read_text()
    assert "## Paired differences against SnapKV" in report
    assert "| PyramidKV | +1.000 [+1.000, +1.000] 3/0 of 3 |" in report
    assert (out / "paired_snapkv.csv").read_text().count("\n") == 2
    assert main([str(tmp_path / "s"), "--out", str(out), "--paired", "nope"]) == 2
    err = capsys.readouterr().err
    assert "--paired nope: no such policy in the rows; give one of (either name, any case): " in err
    assert "snapkv (SnapKV), pyramidkv (PyramidKV)" in err
