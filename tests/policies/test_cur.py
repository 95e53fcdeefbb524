"""CUR (CurDKV) against NumPy from the formula: on hand views with padded rows, every combination, and through
the engine at every eviction (chunked prompt, per-head rows, decode steps), from the model's own projections."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from linalg_reference import Projections, np_cur

from kvbench.policies.allocations.adaptive import Adaptive
from kvbench.policies.policy import Policy
from kvbench.policies.registry import build_policy
from kvbench.policies.scopes.everything import All
from kvbench.policies.scores.cur import CUR
from kvbench.policies.state import TokenState


def hand_view(lengths: list[int], score: CUR, seed: int = 0) -> tuple[TokenState, list[tuple[np.ndarray, ...]]]:
    """Rows of ``lengths`` entries (features as the cache computes them when written), padded with garbage."""
    g = torch.Generator().manual_seed(seed)
    rows, n = len(lengths), max(lengths)
    valid = torch.arange(n) < torch.tensor(lengths).unsqueeze(1)
    keys, values = torch.randn(rows, n, 6, generator=g), torch.randn(rows, n, 6, generator=g) * 2
    stats = {name: x.masked_fill(~valid, 0) for name, x in score.features(keys, values, {}).items()}
    view = TokenState(
        keys=keys,
        values=values,
        positions=torch.arange(n).expand(rows, n),
        stats=stats,
        valid=None if len(set(lengths)) == 1 else valid,
    )
    return view, [(keys[r, :m].double().numpy(), values[r, :m].double().numpy()) for r, m in enumerate(lengths)]


@pytest.mark.parametrize("how", ["kv_product", "kv_avg", "key", "value"])
@pytest.mark.parametrize("window", [16, 5, 0])
@pytest.mark.parametrize("lengths", [[37, 37], [37, 12, 30]], ids=["uniform", "padded"])
def test_cur_on_a_hand_view_equals_numpy(how, window, lengths) -> None:
    score = CUR(leverage=how, local_window=window)
    view, held = hand_view(lengths, score, seed=window)
    got = score(view)
    for r, (k, v) in enumerate(held):
        np.testing.assert_allclose(got[r, : len(k)].double().numpy(), np_cur(k, v, window, how), rtol=1e-5)


def test_cur_through_the_engine_equals_numpy_at_every_eviction(tiny, random_ids) -> None:
    model, heads = tiny.model, tiny.model.config.num_key_value_heads
    checked = []

    class Checked(CUR):
        def __call__(self, view: TokenState) -> torch.Tensor:
            scores = super().__call__(view)
            for row, key in enumerate(view.row_keys.flatten().tolist()):
                layer, head = divmod(key, heads)
                at = view.positions[row][view.valid_mask()[row]].numpy()
                k = projections.after_rope(layer, "k")[head][at]
                v = projections.before_rope(layer, "v")[head][at]
                np.testing.assert_allclose(scores[row, : len(at)].double().numpy(), np_cur(k, v, 4), rtol=1e-4)
            checked.append(view.valid is not None)
            return scores

    projections = Projections(model)
    policy = Policy("cur", Checked(local_window=4), All(), allocation=Adaptive(floor=0.0))
    projections.run(policy, random_ids(30, seed=1), 12, "both", 4, stride=8)
    assert len(checked) >= 5 and any(checked), "rows were padded at some eviction"


def test_cur_config_keeps_sinks_runs_in_every_stage_and_refuses_bad_options() -> None:
    policy = build_policy({"name": "cur", "score": {"kind": "cur"}, "scope": {"kind": "sinks_window", "n_sink": 4}})
    assert policy.unsupported_stages == () and policy.scope.min_budget() == 5
    with pytest.raises(ValueError, match="leverage='both' must be one of"):
        CUR(leverage="both")
    with pytest.raises(ValueError, match="local_window=-1 must be >= 0"):
        CUR(local_window=-1)
