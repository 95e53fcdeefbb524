"""kvbench-profile end to end on the tiny model: config checks before any model loads, the profile's invariants,
the files it writes and the plotted numbers."""

from __future__ import annotations

import csv
import json

import pytest
from conftest import CONFIG_DIR
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from kvbench.config import ConfigError
from kvbench.policies.parts import SCORES
from kvbench.profile import app
from kvbench.profile.consistency import bare_scores, measurable_scores
from kvbench.profile.summary import write_profile
from kvbench.report.profile import build_profile_report, recall_figure


def profile_config(*overrides: str) -> dict:
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("profile", overrides=list(overrides))
    return OmegaConf.to_container(cfg, resolve=True)


TINY = ("model=tiny-llama", "task=retrieval", "task.n=1", "task.context_tokens=120", "budgets=[0.1,0.5,1.0]")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("budgets=[1.5]", "budget=1.5 is out of range"),
        ("budgets=[]", "budgets must list"),
        ("scores=[accumulated,bogus]", "unknown ['bogus']"),
        ("scores=[accumulated,noncausal_attn]", "noncausal_attn cannot be profiled: it reads the evicting step's"),
        ("max_new_tokens=0", "max_new_tokens=0"),
        ("policies.h2o.scope.kind=nowhere", "policies.h2o: unknown scope"),
    ],
)
def test_bad_config_is_refused_before_the_model_loads(override, message, monkeypatch):
    monkeypatch.setattr(app, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        app.profile_task(profile_config(*TINY, override))


def test_tiny_profile_and_report(tmp_path, one_thread):
    data = app.profile_task(profile_config(*TINY))
    assert data["examples"] == 1 and data["budget_layers"] == [0, 1, 2, 3]
    oracle = data["recall_mean"]["oracle"]
    for name, values in data["recall_mean"].items():
        assert all(v <= o + 1e-6 for v, o in zip(values, oracle)), name
        assert values[-1] == pytest.approx(1.0), name  # the whole prompt kept
    assert {k for k, v in data["kinds"].items() if v == "score"} == {f"score/{s}" for s in measurable_scores()}
    # Every registered score but those reading what a profile does not record (the step's queries, RoPE, the
    # attention of replay passes or of the question).
    assert set(SCORES.names()) - set(measurable_scores()) == {
        s
        for s, policy in bare_scores(SCORES.names()).items()
        if policy.queries is not None or policy.rope or policy.replay is not None or policy.question
    }
    assert {"snapkv", "accumulated", "key_norm"} <= set(measurable_scores())
    write_profile(data, tmp_path)
    paths = build_profile_report(tmp_path)
    assert all(p.exists() for p in paths)
    assert {p.suffix for p in paths} == {".png", ".pdf", ".md"}
    rows = list(csv.DictReader(open(tmp_path / "recall.csv")))
    means = {(r["candidate"], float(r["budget"])): float(r["recall"]) for r in rows if r["layer"] == "mean"}
    assert means[("oracle", 0.1)] == pytest.approx(oracle[0])
    lines = {line.get_gid(): line for ax in recall_figure(data).axes for line in ax.get_lines()}
    assert list(lines["score/accumulated"].get_ydata()) == pytest.approx(data["recall_mean"]["score/accumulated"])
    assert json.loads((tmp_path / "profile.json").read_text())["model"] == "tiny-llama"
    assert "Most consistent score" in (tmp_path / "profile.md").read_text()
