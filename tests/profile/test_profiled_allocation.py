"""allocation=profiled: per-layer budgets in proportion to a saved profile's layer statistic, same total."""

from __future__ import annotations

import json

import pytest
from engine_run import generate

from kvbench.engine.engine import DecodeSettings
from kvbench.policies.allocations.profiled import Profiled
from kvbench.policies.registry import build_policy


def saved_profile(tmp_path, coverage, budget_layers=None, name="p.json"):
    path = tmp_path / name
    layers = {"coverage_90": coverage, "coverage_95": coverage, "entropy": coverage}
    path.write_text(
        json.dumps({"model": "m", "layers": layers, "budget_layers": budget_layers or list(range(len(coverage)))})
    )
    return str(path)


def test_budgets_follow_the_profile_by_hand(tmp_path):
    alloc = Profiled(saved_profile(tmp_path, [0.1, 0.3]))
    assert alloc.layer_budgets(10, 2) == [5, 15]
    assert alloc.layer_budgets(10, 2, reserved=2) == [6, 14]  # the reserved 2 in each, the free 16 split 1:3
    assert alloc.layer_budgets(10, 2, limit=12) == [8, 12]  # what the limit clips goes to the other layer
    assert alloc.layer_budgets(20, 2, limit=12) == [12, 12]  # never more than a layer can hold


@pytest.mark.parametrize("budget", [1, 7, 33, 100])
def test_same_total_as_uniform(tmp_path, budget):
    alloc = Profiled(saved_profile(tmp_path, [0.2, 0.9, 0.5, 0.31, 0.77]))
    split = alloc.layer_budgets(budget, 5, limit=200, reserved=4)
    assert sum(split) == 5 * budget
    assert min(split) >= min(5, budget)


def test_hybrid_model_splits_over_its_full_layers(tmp_path):
    alloc = Profiled(saved_profile(tmp_path, [0.9, 0.9, 0.2, 0.9, 0.6], budget_layers=[2, 4]))
    assert alloc.layer_budgets(8, 2) == [4, 12]
    with pytest.raises(ValueError, match="profile this model"):
        alloc.layer_budgets(8, 3)


def test_bad_profiles_are_refused(tmp_path):
    with pytest.raises(ValueError, match="is not a file"):
        build_policy({"name": "x", "score": "accumulated", "allocation": {"kind": "profiled", "profile": "nope.json"}})
    with pytest.raises(ValueError, match="must be one of"):
        Profiled(saved_profile(tmp_path, [0.1]), statistic="sink_mass")
    with pytest.raises(ValueError, match="positive"):
        Profiled(saved_profile(tmp_path, [0.1, 0.0]))


def test_any_policy_runs_with_profiled_budgets(tmp_path, tiny, random_ids, one_thread):
    """H2O's score and scope with profiled budgets: each layer holds its own share, the total is uniform's."""
    path = saved_profile(tmp_path, [0.1, 0.2, 0.3, 0.4])
    policy = build_policy(
        {
            "name": "h2o-profiled",
            "score": "accumulated",
            "scope": {"kind": "sinks_window", "n_sink": 2, "window": 4},
            "allocation": {"kind": "profiled", "profile": path},
        }
    )
    ids = random_ids(64)
    g = generate(tiny.model, tiny.tokenizer, ids, policy, 20, "prefill", DecodeSettings(max_new_tokens=1))
    kept = [round(a * len(ids)) for a in g.measures.budget_achieved_per_layer]
    assert kept == policy.layer_budgets(20, 4, len(ids))
    assert kept[0] < kept[-1] and sum(kept) == 80
