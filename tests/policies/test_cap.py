"""CAP (CAPKV's capacity score) against NumPy from the formula, on a hand view and through the engine from the
model's own projections; the future-averaged RoPE it reads against the model's rotary embedding; its refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from linalg_reference import Projections, np_cap, np_mean_rotation, np_rope
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kvbench.policies.allocations.adaptive import Adaptive
from kvbench.policies.base import Allocation
from kvbench.policies.policy import Policy
from kvbench.policies.positions import Rotary, RowRope
from kvbench.policies.registry import build_policy
from kvbench.policies.scopes.everything import All
from kvbench.policies.scores.cap import CAP
from kvbench.policies.state import TokenState

DIM, GROUP = 8, 2


def test_cap_on_a_hand_view_equals_numpy() -> None:
    g = torch.Generator().manual_seed(0)
    rows, n, seen = 3, 21, 25
    queries = torch.randn(rows, GROUP, n, DIM, generator=g, dtype=torch.float64)
    keys = torch.randn(rows, n, DIM, generator=g, dtype=torch.float64)
    values = torch.randn(rows, n, DIM, generator=g, dtype=torch.float64) * 0.7
    inv_freq = 1.0 / 50 ** (np.arange(0, DIM, 2) / DIM)
    view = TokenState(
        keys=keys.float(),
        values=values.float(),
        positions=torch.arange(seen - n, seen).expand(rows, n),
        queries=queries.float(),
        seen=torch.full((rows, 1), seen),
        rope=RowRope([(Rotary(torch.tensor(inv_freq)), 0, rows)], stored_rotated=True),
    )
    score = CAP(tau=3.0, n_future_positions=40, n_sink=4)
    got = score(view)
    rotation = np_mean_rotation(DIM, seen, 40, inv_freq)
    for r in range(rows):
        want = np_cap(queries[r].numpy(), keys[r].numpy(), values[r].numpy(), rotation, tau=3.0, n_sink=4)
        np.testing.assert_allclose(got[r, 4:].double().numpy(), want, rtol=1e-4, atol=1e-6)
        assert bool(torch.isinf(got[r, :4]).all()), "the sinks rank first"


def test_the_future_averaged_rope_is_the_models(tiny) -> None:
    """RoPE at coming positions, and averaged over them, through the view's ``rope``, equals the model's rotary
    embedding applied at each of those positions (transformers' own functions), and their mean."""
    model = tiny.model
    dim = model.config.hidden_size // model.config.num_attention_heads
    x = torch.randn(2, 3, dim, generator=torch.Generator().manual_seed(1))
    start = torch.tensor([[10], [31]])
    positions = start + torch.arange(6)
    rotary = Rotary(model.model.rotary_emb.inv_freq)
    rope = RowRope([(rotary, 0, 2)], stored_rotated=True)
    got = rope.rotate(x.unsqueeze(2).expand(-1, -1, 6, -1), positions[:, None])
    averaged = rope.averaged(x, positions[:, None])
    for r in range(2):
        cos, sin = model.model.rotary_emb(x, positions[r : r + 1])
        spread = x[r].unsqueeze(1).expand(-1, 6, -1).unsqueeze(0)  # [1, 3, 6, D]
        want = apply_rotary_pos_emb(spread, spread, cos, sin)[0][0]
        torch.testing.assert_close(got[r], want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(averaged[r], want.mean(dim=1), rtol=1e-5, atol=1e-6)
    inv_freq = model.model.rotary_emb.inv_freq.double().numpy()
    np.testing.assert_allclose(
        np_rope(x[0, 0].double().numpy(), np.array([12]), inv_freq)[0], got[0, 0, 2].double().numpy(), atol=1e-5
    )


@pytest.mark.parametrize("allocation", [Allocation(), Adaptive(floor=0.0)], ids=["uniform", "per-head"])
def test_cap_through_the_engine_equals_numpy(tiny, random_ids, allocation) -> None:
    """The prompt's eviction scores each row as NumPy's CAPKV of the model's own queries before RoPE, keys after
    it and values (and the average rotation built from the model's inverse frequencies)."""
    model, heads = tiny.model, tiny.model.config.num_key_value_heads
    group = model.config.num_attention_heads // heads
    prompt = 40
    calls = []

    class Checked(CAP):
        def __call__(self, view: TokenState) -> torch.Tensor:
            scores = super().__call__(view)
            dim = view.keys.shape[-1]
            inv_freq = model.model.rotary_emb.inv_freq.double().numpy()
            rotation = np_mean_rotation(dim, prompt, self.n_future_positions, inv_freq)
            for row, key in enumerate(view.row_keys.flatten().tolist()):
                layer, head = divmod(key, heads)
                q = projections.before_rope(layer, "q")[head * group : (head + 1) * group, :prompt]
                k = projections.after_rope(layer, "k")[head, :prompt]
                v = projections.before_rope(layer, "v")[head, :prompt]
                want = np_cap(q, k, v, rotation, tau=self.tau, n_sink=self.n_sink)
                np.testing.assert_allclose(scores[row, self.n_sink :].double().numpy(), want, rtol=1e-3, atol=1e-6)
            calls.append(view.phase)
            return scores

    projections = Projections(model)
    policy = Policy("cap", Checked(n_future_positions=64), All(), allocation=allocation)
    projections.run(policy, random_ids(prompt, seed=6), 12, "prefill", 3)
    assert calls and set(calls) == {"prefill"}


def test_cap_compresses_a_prompt_fed_at_once_only() -> None:
    policy = build_policy({"name": "cap", "score": {"kind": "cap"}})
    assert policy.unsupported_stages == ("decode", "both") and policy.whole_prompt and policy.rope
    view = TokenState(
        keys=torch.zeros(2, 10, 4),
        values=torch.zeros(2, 10, 4),
        positions=torch.arange(10).expand(2, 10),
        queries=torch.zeros(2, 2, 3, 4),  # a last chunk's queries: fewer than the held entries
    )
    with pytest.raises(ValueError, match="the prompt fed in one step"):
        CAP()(view)
    with pytest.raises(ValueError, match="n_future_positions=0 must be >= 1"):
        CAP(n_future_positions=0)
