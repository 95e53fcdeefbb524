"""Profile.to_dict: each example counts once; the std-by-age curve pools the moments of every example."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvbench.profile.summary import HEAD_MEASURES, LayerResult, Profile


def result(value: float, ages: list[list[float]]) -> LayerResult:
    return LayerResult(
        heads=dict.fromkeys(HEAD_MEASURES, [value, 2 * value]),
        age=torch.tensor(ages, dtype=torch.float64),
        future_prompt_share=value,
        recall={"oracle": [value, 1.0], "score/recency": [value / 2, 1.0]},
    )


def test_examples_are_averaged_and_ages_pooled():
    profile = Profile("m", "t", [None, 4], [0.5, 1.0], {"oracle": "oracle", "score/recency": "score"}, 4, 64)
    # age moments [count, sum, squares] over 2 ages: example 1 saw values {1, 3} at age 0, example 2 saw {5}
    profile.add({0: result(0.2, [[2, 1], [4, 0], [10, 0]]), 1: result(0.4, [[2, 0], [4, 0], [10, 0]])}, 10, 3)
    profile.add({0: result(0.6, [[1, 0], [5, 0], [25, 0]]), 1: result(0.8, [[1, 0], [5, 0], [25, 0]])}, 20, 5)
    data = profile.to_dict()
    assert np.allclose(data["heads"]["entropy"], [[0.4, 0.8], [0.6, 1.2]])
    assert data["layers"]["sink_mass"] == pytest.approx([0.6, 0.9])
    assert data["age"]["std"][0][0] == pytest.approx(np.std([1, 3, 5]))
    assert data["age"]["std"][0][1] == 0.0 and data["age"]["std"][1][1] is None  # one value; none at all
    assert data["budget_layers"] == [0]  # layer 1 slides: the budget is the full layers'
    assert data["recall_mean"]["score/recency"] == pytest.approx([0.2, 1.0])
    assert np.allclose(data["recall"]["oracle"], [[0.4, 1.0], [0.6, 1.0]])
    assert data["prompt_tokens"] == [10, 20]


def test_missing_layers_are_refused():
    profile = Profile("m", "t", [None, None], [1.0], {"oracle": "oracle"}, 4, 64)
    with pytest.raises(RuntimeError, match="expected all 2"):
        profile.add({0: result(0.1, [[1], [1], [1]])}, 5, 1)
