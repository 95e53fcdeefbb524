"""Non-causal chunked attention (Compactor's) against NumPy from the formula: on hand views (chunks that divide
the prompt and a last chunk filled with zeros), in row blocks, and through the engine from the model's own
queries and keys; its refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from linalg_reference import Projections, np_noncausal, np_zscore

from kvbench.policies import blocks
from kvbench.policies.allocations.adaptive import Adaptive
from kvbench.policies.base import Allocation
from kvbench.policies.policy import Policy
from kvbench.policies.positions import Rotary, RowRope
from kvbench.policies.registry import build_policy
from kvbench.policies.scopes.everything import All
from kvbench.policies.scores import noncausal_attn
from kvbench.policies.scores.noncausal_attn import NonCausalAttention
from kvbench.policies.state import TokenState

DIM, GROUP = 8, 3


def hand_view(rows: int, n: int, units: int = 1, seed: int = 0) -> TokenState:
    g = torch.Generator().manual_seed(seed)
    return TokenState(
        keys=torch.randn(rows, n, DIM, generator=g),
        values=torch.randn(rows, n, DIM, generator=g),
        positions=torch.arange(n).expand(rows, n),
        queries=torch.randn(rows, GROUP, n, DIM, generator=g) * 0.8,
        units=units,
        rope=RowRope([(Rotary.identity(), 0, rows)], stored_rotated=True),
    )


@pytest.mark.parametrize("n, chunk", [(24, 8), (23, 8), (5, 8), (19, 1)], ids=["whole", "filled", "one", "single"])
@pytest.mark.parametrize("units", [1, 2])
def test_noncausal_attention_on_a_hand_view_equals_numpy(n, chunk, units) -> None:
    view = hand_view(4, n, units, seed=n)
    got = NonCausalAttention(chunk_size=chunk)(view)
    raw = [
        np_noncausal(
            view.queries[r].double().numpy(), view.keys[r].double().numpy(), view.values[r].double().numpy(), chunk
        )
        for r in range(4)
    ]
    per_unit = 4 // units
    expected = sum((np_zscore(raw[u : u + per_unit]) for u in range(0, 4, per_unit)), [])
    for r, want in enumerate(expected):
        np.testing.assert_allclose(got[r].double().numpy(), want, rtol=1e-4, atol=1e-4)


def test_row_blocks_change_nothing(monkeypatch) -> None:
    view = hand_view(5, 23, seed=3)
    whole = NonCausalAttention(chunk_size=8)(view)
    monkeypatch.setattr(blocks, "BLOCK_ELEMENTS", 1)  # one row at a time
    calls = []
    chunked = noncausal_attn.chunked_attention
    monkeypatch.setattr(noncausal_attn, "chunked_attention", lambda *a: calls.append(1) or chunked(*a))
    torch.testing.assert_close(NonCausalAttention(chunk_size=8)(view), whole)
    assert len(calls) == 5


@pytest.mark.parametrize("allocation", [Allocation(), Adaptive(floor=0.0)], ids=["uniform", "per-head"])
@pytest.mark.parametrize("positions", ["absolute", "reindex"])
def test_noncausal_attention_through_the_engine_equals_numpy(tiny, random_ids, allocation, positions) -> None:
    """The prompt's eviction scores each row as NumPy's non-causal chunked attention of the model's own queries
    and keys after RoPE (whatever the positions mode stores), and its values."""
    model, heads = tiny.model, tiny.model.config.num_key_value_heads
    group = model.config.num_attention_heads // heads
    prompt = 37
    calls = []

    class Checked(NonCausalAttention):
        def __call__(self, view: TokenState) -> torch.Tensor:
            scores = super().__call__(view)
            raw = []
            for key in view.row_keys.flatten().tolist():
                layer, head = divmod(key, heads)
                q = projections.after_rope(layer, "q")[head * group : (head + 1) * group, :prompt]
                k = projections.after_rope(layer, "k")[head, :prompt]
                v = projections.before_rope(layer, "v")[head, :prompt]
                raw.append(np_noncausal(q, k, v, self.chunk_size))
            expected = sum((np_zscore(raw[u : u + heads]) for u in range(0, len(raw), heads)), [])
            for row, want in enumerate(expected):
                np.testing.assert_allclose(scores[row].double().numpy(), want, rtol=1e-3, atol=1e-3)
            calls.append(view.phase)
            return scores

    projections = Projections(model)
    policy = Policy("noncausal_attn", Checked(chunk_size=16), All(), allocation=allocation, positions=positions)
    projections.run(policy, random_ids(prompt, seed=8), 12, "prefill", 3)
    assert calls and set(calls) == {"prefill"}


def test_noncausal_attention_compresses_a_prompt_fed_at_once_only() -> None:
    policy = build_policy({"name": "noncausal_attn", "score": {"kind": "noncausal_attn"}})
    assert policy.unsupported_stages == ("decode", "both") and policy.whole_prompt
    view = hand_view(2, 10)
    view.valid = torch.arange(10) < torch.tensor([[10], [7]])  # rows of different counts: entries evicted before
    with pytest.raises(ValueError, match="the prompt fed in one step"):
        NonCausalAttention()(view)
    with pytest.raises(ValueError, match="chunk_size=0 must be >= 1"):
        NonCausalAttention(chunk_size=0)
