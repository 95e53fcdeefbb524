"""Leverage (Compactor's approximate leverage of the keys) against NumPy from the formula, on hand views with
padded rows and through the engine at every eviction; its seeded sketch; and the RoPE seam it reads (keys before
RoPE, checked against the model's own k_proj)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from linalg_reference import Projections, np_leverage, np_rope, np_zscore

from kvbench.policies.allocations.adaptive import Adaptive
from kvbench.policies.base import Allocation
from kvbench.policies.policy import Policy
from kvbench.policies.positions import Rotary, RowRope
from kvbench.policies.registry import build_policy
from kvbench.policies.scopes.everything import All
from kvbench.policies.scores.leverage import Leverage, gaussian_sketch
from kvbench.policies.state import TokenState

DIM = 8


def rotated_view(
    lengths: list[int], units: int = 1, seed: int = 0, scale: float = 1.0
) -> tuple[TokenState, list[np.ndarray]]:
    """Rows holding ``lengths`` keys before RoPE (returned), the view holding them after RoPE at their
    positions (as a cache stores them), padded with garbage."""
    g = torch.Generator().manual_seed(seed)
    rows, n = len(lengths), max(lengths)
    valid = torch.arange(n) < torch.tensor(lengths).unsqueeze(1)
    spread = torch.linspace(0.2, 3, DIM, dtype=torch.float64) * scale
    raw = torch.randn(rows, n, DIM, generator=g, dtype=torch.float64) * spread
    positions = (torch.arange(n) + 3).expand(rows, n)
    inv_freq = 1.0 / 100 ** (np.arange(0, DIM, 2) / DIM)
    stored = torch.tensor(np_rope(raw.numpy(), positions.numpy(), inv_freq), dtype=torch.float32)
    stored = stored.masked_fill(~valid.unsqueeze(-1), 1e3)
    rope = RowRope([(Rotary(torch.tensor(inv_freq)), 0, rows)], stored_rotated=True)
    view = TokenState(
        keys=stored,
        values=stored.clone(),
        positions=positions.masked_fill(~valid, 0),
        valid=None if len(set(lengths)) == 1 else valid,
        units=units,
        seed=7,
        rope=rope,
    )
    return view, [raw[r, :m].numpy() for r, m in enumerate(lengths)]


@pytest.mark.parametrize(
    "lengths, units", [([9, 9, 9, 9], 1), ([9, 4, 7, 6], 1), ([9, 4, 7, 6], 2)], ids=["uniform", "padded", "units"]
)
def test_leverage_on_a_hand_view_equals_numpy(lengths, units) -> None:
    view, raw = rotated_view(lengths, units)
    score = Leverage(sketch_dimension=5)
    got = score(view)
    sketch = gaussian_sketch(7, view.row_keys, DIM, 5).double().numpy()
    leverage = [np_leverage(k, sketch[r]) for r, k in enumerate(raw)]
    per_unit = len(lengths) // units
    expected = sum((np_zscore(leverage[u : u + per_unit]) for u in range(0, len(lengths), per_unit)), [])
    for r, want in enumerate(expected):
        np.testing.assert_allclose(got[r, : len(want)].double().numpy(), want, rtol=1e-4, atol=1e-4)
    keep = Policy("leverage", score, All(), allocation=Allocation()).keep_mask(view, 3)
    assert not bool((keep & ~view.valid_mask()).any()), "padding is never kept"


def test_a_sketch_as_wide_as_the_keys_leaves_the_leverage_exact() -> None:
    """With k ≥ D a full-rank sketch spans what the keys span: the leverage is the keys' own, up to the ridge
    (negligible against keys this large)."""
    view, raw = rotated_view([20, 20], scale=30.0)
    got = Leverage(sketch_dimension=3 * DIM)(view)
    exact = [np_leverage(k, np.eye(DIM), ridge=0.0) for k in raw]
    mean, std = np.concatenate(exact).mean(), np.concatenate(exact).std(ddof=1)
    for r, want in enumerate(exact):
        np.testing.assert_allclose(got[r].double().numpy(), (want - mean) / std, atol=2e-2)


def test_the_sketch_is_seeded_gaussian_and_each_rows_own() -> None:
    rows = torch.tensor([[0], [1], [5]])
    sketch = gaussian_sketch(3, rows, 64, 48)
    assert sketch.shape == (3, 64, 48)
    assert torch.equal(sketch, gaussian_sketch(3, rows, 64, 48))
    assert torch.equal(sketch[2:], gaussian_sketch(3, rows[2:], 64, 48)), "a row's sketch ignores the others"
    assert not torch.equal(sketch[0], sketch[1]) and not torch.equal(sketch, gaussian_sketch(4, rows, 64, 48))
    values = sketch.double().flatten() * np.sqrt(48)  # standard normal entries
    assert abs(float(values.mean())) < 0.05 and abs(float(values.var()) - 1) < 0.05
    assert abs(float((values.abs() < 1).double().mean()) - 0.6827) < 0.015


@pytest.mark.parametrize("positions", ["absolute", "reindex"])
def test_the_view_reads_the_keys_the_model_projected_before_rope(tiny, random_ids, positions) -> None:
    """At every eviction (chunked prompt, per-head rows, decode steps), ``keys_before_rope`` is each held entry's
    k_proj output, whatever the positions mode stores (tests/policies/test_noncausal_attn.py checks
    ``keys_after_rope`` the same way)."""
    model, heads = tiny.model, tiny.model.config.num_key_value_heads
    seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []

    class Recording(Leverage):
        def __call__(self, view: TokenState) -> torch.Tensor:
            mask = view.valid_mask()
            seen.append((view.row_keys.flatten(), view.positions, mask, view.keys_before_rope))
            return super().__call__(view)

    projections = Projections(model)
    policy = Policy("leverage", Recording(4), All(), allocation=Adaptive(floor=0.0), positions=positions)
    projections.run(policy, random_ids(30, seed=2), 12, "both", 5, stride=8)
    assert len(seen) >= 5
    for row_keys, held, mask, keys in seen:
        for row, key in enumerate(row_keys.tolist()):
            layer, head = divmod(key, heads)
            projected = projections.before_rope(layer, "k")[head]
            at = held[row][mask[row]].numpy()
            np.testing.assert_allclose(keys[row][mask[row]].double().numpy(), projected[at], rtol=1e-4, atol=1e-5)


def test_leverage_through_the_engine_equals_numpy_at_every_eviction(tiny, random_ids) -> None:
    """Per-head rows, a chunked prompt and decode steps: every eviction's scores are NumPy's leverage of the held
    entries' k_proj outputs (sketched by each row's own sketch), z-scored over the layer's heads."""
    model, heads = tiny.model, tiny.model.config.num_key_value_heads
    checked = []

    class Checked(Leverage):
        def __call__(self, view: TokenState) -> torch.Tensor:
            scores = super().__call__(view)
            sketch = gaussian_sketch(view.seed, view.row_keys, keys_dim, self.sketch_dimension).double().numpy()
            rows = []
            for row, key in enumerate(view.row_keys.flatten().tolist()):
                layer, head = divmod(key, heads)
                at = view.positions[row][view.valid_mask()[row]].numpy()
                rows.append(np_leverage(projections.before_rope(layer, "k")[head][at], sketch[row]))
            expected = sum((np_zscore(rows[u : u + heads]) for u in range(0, len(rows), heads)), [])
            for row, want in enumerate(expected):
                np.testing.assert_allclose(scores[row, : len(want)].double().numpy(), want, rtol=1e-3, atol=1e-3)
            checked.append(view.valid is not None)
            return scores

    keys_dim = model.config.hidden_size // model.config.num_attention_heads
    projections = Projections(model)
    policy = Policy("leverage", Checked(4), All(), allocation=Adaptive(floor=0.0))
    projections.run(policy, random_ids(30, seed=3), 12, "both", 4, stride=8)
    assert len(checked) >= 5 and any(checked), "rows were padded at some eviction"


def test_leverage_runs_in_every_stage_and_refuses_bad_options() -> None:
    policy = build_policy({"name": "leverage", "score": {"kind": "leverage"}})
    assert policy.unsupported_stages == () and policy.rope and not policy.whole_prompt
    with pytest.raises(ValueError, match="sketch_dimension=0 must be >= 1"):
        Leverage(0)
