"""Expected Attention (Devoto et al. 2025, arXiv:2510.00636; kvpress's ExpectedAttentionPress) against NumPy
from the paper's equations: the step's queries before RoPE (those at positions >= n_sink), their mean μ and
covariance Σ (divided by the count), R̄ the mean of the RoPE rotation matrices over the next F positions, and per
query head softmax over the non-sink entries of μ̄·k/√d + kᵀΣ̄k/(2d) (μ̄ = R̄μ, Σ̄ = R̄ΣR̄ᵀ), averaged over the GQA
group, times ‖v‖₂; sinks kept."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_run import generate

from kvbench.engine.engine import DecodeSettings
from kvbench.families import policy_problem
from kvbench.policies.allocations.adaptive import Adaptive
from kvbench.policies.base import Allocation
from kvbench.policies.policy import Policy
from kvbench.policies.registry import build_policy
from kvbench.policies.scores.expected_attention import ExpectedAttention
from kvbench.policies.state import TokenState

N_SINK, FUTURE = 2, 6


def numpy_scores(
    queries: np.ndarray, positions: np.ndarray, keys: np.ndarray, values: np.ndarray, n_sink: int, cov: bool = True
) -> np.ndarray:
    """One row: queries [group, k, D] (already turned by R̄) at ``positions`` [k]; keys, values [m, D]."""
    d = keys.shape[-1]
    used = queries[:, positions >= n_sink] if (positions >= n_sink).any() else queries
    sink = np.arange(len(keys)) < n_sink
    out = []
    for q in used:  # per query head
        mu = q.mean(axis=0)
        sigma = (q - mu).T @ (q - mu) / len(q)
        logit = keys @ mu / np.sqrt(d) + (np.einsum("nd,de,ne->n", keys, sigma, keys) / (2 * d) if cov else 0)
        e = np.exp(logit[~sink] - logit[~sink].max())
        p = np.zeros(len(keys))
        p[~sink] = e / e.sum()
        out.append(p)
    scores = np.mean(out, axis=0) * np.linalg.norm(values, axis=-1)
    scores[sink] = np.inf
    return scores


@pytest.mark.parametrize("cov", [True, False])
@pytest.mark.parametrize("lengths", [[9, 9], [9, 5]], ids=["even", "padded"])
def test_on_a_hand_view_equals_numpy(lengths, cov) -> None:
    g = torch.Generator().manual_seed(len(set(lengths)) + cov)
    rows, n, d, group, k = len(lengths), max(lengths), 4, 3, 5
    valid = torch.arange(n) < torch.tensor(lengths).unsqueeze(1)
    keys, values = torch.randn(rows, n, d, generator=g), torch.randn(rows, n, d, generator=g)
    queries = torch.randn(rows, group, k, d, generator=g)
    score = ExpectedAttention(n_future_positions=FUTURE, n_sink=N_SINK, use_covariance=cov, last_queries=k)
    view = TokenState(
        keys=keys,
        values=values,
        positions=torch.arange(n).expand(rows, n).masked_fill(~valid, 0),
        stats={"value_l2": values.norm(dim=-1) * valid},
        valid=None if len(set(lengths)) == 1 else valid,
        seen=torch.tensor([[6], [4]]),  # the first row's queries at 1..5, the second's at -1..3: sinks left out
        queries=queries,
    )
    got = score(view)
    for r, m in enumerate(lengths):
        at = int(view.seen[r]) - k + np.arange(k)
        expected = numpy_scores(
            queries[r].double().numpy(), at, keys[r, :m].double().numpy(), values[r, :m].double().numpy(), N_SINK, cov
        )
        np.testing.assert_allclose(got[r, :m].double().numpy(), expected, rtol=1e-5, atol=1e-7)


def rope_average(inv_freq: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """The mean over ``positions`` of Llama's RoPE matrices (rotate-half pairs i, i + D/2): [D, D]."""
    half = len(inv_freq)
    mats = []
    for t in positions:
        c, s = np.cos(t * inv_freq), np.sin(t * inv_freq)
        r = np.zeros((2 * half, 2 * half))
        r[np.arange(half), np.arange(half)] = c
        r[np.arange(half) + half, np.arange(half) + half] = c
        r[np.arange(half), np.arange(half) + half] = -s
        r[np.arange(half) + half, np.arange(half)] = s
        mats.append(r)
    return np.mean(mats, axis=0)


class Checked(ExpectedAttention):
    """Each eviction checked against NumPy from the model's own pre-RoPE queries (its q_proj outputs)."""

    def __init__(self, model, projected: list[list[torch.Tensor]], last: int) -> None:
        super().__init__(n_future_positions=FUTURE, n_sink=N_SINK, last_queries=last)
        self.model, self.projected, self.calls, self.padded = model, projected, 0, 0

    def __call__(self, view: TokenState) -> torch.Tensor:
        scores = super().__call__(view)
        cfg = self.model.config
        heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        d, group = cfg.hidden_size // heads, heads // kv_heads
        inv_freq = self.model.model.rotary_emb.inv_freq.double().numpy()
        k = view.queries.shape[2]
        for r, key in enumerate(view.row_keys.flatten().tolist()):
            layer, head = divmod(key, kv_heads)
            seen = int(view.seen[r])
            prompt = torch.cat(self.projected[layer], dim=1)[0].view(-1, heads, d).transpose(0, 1).double().numpy()
            at = np.arange(seen - k, seen)
            turn = rope_average(inv_freq, np.arange(seen, seen + FUTURE))
            q = prompt[head * group : (head + 1) * group, seen - k : seen] @ turn.T  # R̄ q for each query
            m = int(view.lengths()[r])
            assert view.positions[r, :m].tolist() == sorted(view.positions[r, :m].tolist())
            keys, values = view.keys[r, :m].double().numpy(), view.values[r, :m].double().numpy()
            # the sinks by position: the row's first entries, never evicted (the scope keeps them)
            assert view.positions[r, :N_SINK].tolist() == list(range(N_SINK))
            expected = numpy_scores(q, at, keys, values, N_SINK)
            np.testing.assert_allclose(scores[r, :m].double().numpy(), expected, rtol=1e-4, atol=1e-6)
        self.calls += 1
        self.padded += int(view.valid is not None and not bool(view.valid.all()))
        return scores


@pytest.mark.parametrize("last", [40, 5], ids=["every query of the step", "the last 5"])
@pytest.mark.parametrize("allocation", [Allocation(), Adaptive(floor=0.2)], ids=["uniform", "per-head"])
def test_through_the_engine_equals_numpy_at_every_eviction(tiny, random_ids, allocation, last) -> None:
    from kvbench.policies.scopes.sinks_window import SinksWindow

    model = tiny.model
    projected: list[list[torch.Tensor]] = [[] for _ in model.model.layers]
    handles = [
        layer.self_attn.q_proj.register_forward_hook(lambda m, i, out, at=j: projected[at].append(out.detach()))
        for j, layer in enumerate(model.model.layers)
    ]
    score = Checked(model, projected, last)
    try:
        policy = Policy("expected_attention", score, SinksWindow(n_sink=N_SINK), allocation=allocation)
        settings = DecodeSettings(max_new_tokens=2)
        generate(model, None, random_ids(30, seed=2), policy, 10, "prefill", settings, stride=8, fused=False)
        assert score.calls == 3  # the prompt's chunks 2-4 evict
        assert score.padded > 0 if allocation.per_head else score.padded == 0
        # One chunk, as kvpress compresses a prompt: every query after the sinks makes the statistics.
        score.calls = 0
        for layer in projected:
            layer.clear()
        generate(model, None, random_ids(30, seed=3), policy, 10, "prefill", settings, fused=False)
        assert score.calls == 1
    finally:
        for handle in handles:
            handle.remove()


def test_the_covariance_term_moves_the_scores() -> None:
    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(1, 12, 4, generator=g), torch.randn(1, 12, 4, generator=g)
    queries = torch.randn(1, 2, 6, 4, generator=g) * 3
    view = TokenState(keys=keys, values=values, positions=torch.arange(12).unsqueeze(0), seen=12, queries=queries)
    view.stats = {"value_l2": values.norm(dim=-1)}
    with_cov = ExpectedAttention(n_sink=0)(view)
    without = ExpectedAttention(n_sink=0, use_covariance=False)(view)
    assert not torch.allclose(with_cov, without)


def test_named_config_stages_and_refusals(tiny) -> None:
    from conftest import tiny_policy_cfg
    from family_models import family_config

    policy = build_policy(tiny_policy_cfg("expected_attention"))
    assert policy.unsupported_stages == ("decode", "both") and policy.needs == frozenset()
    assert policy.queries.rope is False and policy.queries.ahead == 512 and policy.scope.min_budget() == 5
    for option, value in (("n_future_positions", 0), ("n_sink", -1), ("epsilon", -1.0), ("last_queries", 1)):
        with pytest.raises(ValueError, match=option):
            ExpectedAttention(**{option: value})
    with pytest.raises(ValueError, match="positions=absolute"):
        build_policy(tiny_policy_cfg("expected_attention") | {"positions": "reindex"})
    for family in ("gpt2", "opt"):
        problem = policy_problem(family_config(family), policy)
        assert problem and "no rotary position embedding" in problem and "reads no pre-RoPE queries" in problem
    assert policy_problem(tiny.model.config, policy) is None
