"""Compactor against NumPy from its definition (leverage and non-causal attention on the tokens between the sinks,
each z-scored, blended by the share evicted), on a hand view and through the engine; its options and refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import CONFIG_DIR
from linalg_reference import Projections, np_leverage, np_noncausal, np_rope, np_zscore
from omegaconf import OmegaConf

from kvbench.policies.policy import Policy
from kvbench.policies.positions import Rotary, RowRope
from kvbench.policies.registry import build_policy
from kvbench.policies.scopes.everything import All
from kvbench.policies.scores.compactor import Compactor
from kvbench.policies.scores.leverage import gaussian_sketch
from kvbench.policies.state import TokenState

DIM, GROUP = 8, 2


def np_compactor(queries, raw_keys, keys, values, sketches, blend, start, end, chunk) -> list[np.ndarray]:
    """One unit's rows: the scores of the tokens between the first ``start`` and the last ``end``."""
    middle = slice(start, keys[0].shape[0] - end)
    leverage = np_zscore([np_leverage(k[middle], s) for k, s in zip(raw_keys, sketches)])
    attention = np_zscore(
        [np_noncausal(q[:, middle], k[middle], v[middle], chunk) for q, k, v in zip(queries, keys, values)]
    )
    return [blend * lv + at for lv, at in zip(leverage, attention)]


@pytest.mark.parametrize("blending, budget", [(None, 11), (0.35, 20), (None, 30)])
def test_compactor_on_a_hand_view_equals_numpy(blending, budget) -> None:
    g = torch.Generator().manual_seed(budget)
    rows, n = 3, 37
    raw = torch.randn(rows, n, DIM, generator=g, dtype=torch.float64)
    inv_freq = 1.0 / 100 ** (np.arange(0, DIM, 2) / DIM)
    stored = np_rope(raw.numpy(), np.arange(n), inv_freq)
    queries = torch.randn(rows, GROUP, n, DIM, generator=g, dtype=torch.float64)
    values = torch.randn(rows, n, DIM, generator=g, dtype=torch.float64)
    view = TokenState(
        keys=torch.tensor(stored, dtype=torch.float32),
        values=values.float(),
        positions=torch.arange(n).expand(rows, n),
        queries=queries.float(),
        seed=5,
        rope=RowRope([(Rotary(torch.tensor(inv_freq)), 0, rows)], stored_rotated=True),
        budget=budget,
    )
    score = Compactor(blending=blending, sink_start=3, sink_end=2, chunk_size=8, sketch_dimension=4)
    got = score(view)
    sketches = gaussian_sketch(5, view.row_keys, DIM, 4).double().numpy()
    blend = 1 - budget / n if blending is None else blending
    expected = np_compactor(queries.numpy(), raw.numpy(), stored, values.numpy(), sketches, blend, 3, 2, 8)
    for r, want in enumerate(expected):
        np.testing.assert_allclose(got[r, 3 : n - 2].double().numpy(), want, rtol=1e-4, atol=1e-4)
        assert bool(torch.isinf(got[r, :3]).all() and torch.isinf(got[r, n - 2 :]).all()), "the sinks rank first"


def test_compactor_through_the_engine_equals_numpy(tiny, random_ids) -> None:
    """The prompt's eviction, from the model's own queries and keys (before and after RoPE) and values, with the
    blend the budget gives (1 − 12 / 40)."""
    model, heads = tiny.model, tiny.model.config.num_key_value_heads
    group = model.config.num_attention_heads // heads
    prompt, budget = 40, 12
    calls = []

    class Checked(Compactor):
        def __call__(self, view: TokenState) -> torch.Tensor:
            scores = super().__call__(view)
            dim = view.keys.shape[-1]
            sketch = gaussian_sketch(view.seed, view.row_keys, dim, self.sketch_dimension).double().numpy()
            layers = [divmod(key, heads) for key in view.row_keys.flatten().tolist()]
            for u in range(0, len(layers), heads):
                unit = layers[u : u + heads]
                expected = np_compactor(
                    [projections.after_rope(lay, "q")[h * group : (h + 1) * group, :prompt] for lay, h in unit],
                    [projections.before_rope(lay, "k")[h, :prompt] for lay, h in unit],
                    [projections.after_rope(lay, "k")[h, :prompt] for lay, h in unit],
                    [projections.before_rope(lay, "v")[h, :prompt] for lay, h in unit],
                    sketch[u : u + heads],
                    1 - budget / prompt,
                    self.sink_start,
                    self.sink_end,
                    self.chunk_size,
                )
                for i, want in enumerate(expected):
                    got = scores[u + i, self.sink_start : prompt - self.sink_end].double().numpy()
                    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3)
            calls.append(view.phase)
            return scores

    projections = Projections(model)
    policy = Policy("compactor", Checked(chunk_size=16, sketch_dimension=6), All())
    projections.run(policy, random_ids(prompt, seed=9), budget, "prefill", 3)
    assert calls and set(calls) == {"prefill"}


def test_compactor_config_keeps_its_sinks_and_compresses_a_prompt_fed_at_once_only() -> None:
    cfg = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "policy" / "compactor.yaml"), resolve=True)
    policy = build_policy(cfg)
    assert (policy.scope.n_sink, policy.scope.window) == (8, 4) and policy.score.blending is None
    assert policy.unsupported_stages == ("decode", "both") and policy.whole_prompt and policy.rope
    with pytest.raises(ValueError, match="sink_start=-1 and sink_end=4 must be >= 0"):
        Compactor(sink_start=-1)
