"""LagKV against NumPy: on a prompt held whole, kvpress's LagKVPress equations (each lag block min/max-normalised by
the next, the channel std, a softmax per block, the rank within the block; sinks and tail kept) with kvbench's
tie-breaks; on rows holding what earlier evictions left (chunked prompts, decode steps, per-head allocation), the
same rule with the blocks cut by position, checked at every eviction through the engine."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import tiny_policy_cfg
from engine_run import generate

from kvbench.engine.engine import DecodeSettings
from kvbench.policies.allocations.adaptive import Adaptive
from kvbench.policies.base import Allocation
from kvbench.policies.policy import Policy
from kvbench.policies.registry import build_policy
from kvbench.policies.scopes.everything import All
from kvbench.policies.scores.lagkv import LagKV
from kvbench.policies.state import TokenState


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def kvpress_scores(keys: np.ndarray, values: np.ndarray, n_sink: int, lag: int, cross: bool) -> np.ndarray:
    """LagKVPress's score of a prompt's keys and values [m, D] (positions 0..m-1), from its equations."""
    m = len(keys)
    if m < n_sink + 2 * lag:
        s = np.ones(m)
        s[n_sink:] = np.arange(m - n_sink) / (m - n_sink)
        return s
    end = n_sink + (m - n_sink) // lag * lag

    def share(x: np.ndarray) -> np.ndarray:
        blocks = x[n_sink:end].reshape(-1, lag, x.shape[-1])
        ref, cur = blocks[1:], blocks[:-1]
        lo, hi = ref.min(axis=1, keepdims=True), ref.max(axis=1, keepdims=True)
        return softmax(((cur - lo) / (hi - lo)).std(axis=-1, ddof=1))

    s = (share(keys) + share(values)) / 2
    if not cross:
        s = s.argsort(-1).argsort(-1) / lag
    return np.concatenate([np.ones(n_sink), s.ravel(), np.ones(m - end + lag)])


def kvpress_order(keys, values, n_sink: int, lag: int, cross: bool) -> list[int]:
    """The entries best first: kvpress's scores, its ties broken as kvbench documents (sinks first, earlier
    first; then the tail, newest first; at one rank, the newer block's entry first)."""
    s = kvpress_scores(keys, values, n_sink, lag, cross)
    m = len(s)
    blocks = (m - n_sink) // lag
    protected = np.arange(m) < n_sink
    protected |= (np.arange(m) - n_sink) // lag >= blocks - 1
    sinks = list(range(min(n_sink, m)))
    tail = [i for i in range(m - 1, -1, -1) if protected[i] and i >= n_sink]
    scored = [i for i in range(m) if not protected[i]]
    return sinks + tail + sorted(scored, key=lambda i: (-s[i], -((i - n_sink) // lag)))


def reference_order(pos, keys, values, n_sink: int, lag: int, cross: bool) -> list[int]:
    """The rule on any held entries (positions ``pos`` ascending, maybe with gaps), in loops: blocks by position,
    each scored block against what the next one holds, an entry ranked by its depth in its block."""
    m = len(pos)
    blocks = max(0, int(pos.max()) + 1 - n_sink) // lag
    block = np.floor_divide(pos - n_sink, lag)
    sinks = [i for i in range(m) if pos[i] < n_sink]
    scored = [i for i in range(m) if pos[i] >= n_sink and block[i] < blocks - 1]
    tail = sorted(set(range(m)) - set(sinks) - set(scored), key=lambda i: -pos[i])
    share = np.zeros(m)
    for b in range(blocks - 1):
        members = [i for i in scored if block[i] == b]
        ref = [i for i in range(m) if pos[i] >= n_sink and block[i] == b + 1]
        if not members:
            continue
        for x in (keys, values):
            if ref:
                lo, hi = x[ref].min(axis=0), x[ref].max(axis=0)
                with np.errstate(divide="ignore", invalid="ignore"):
                    spread = np.nan_to_num(((x[members] - lo) / (hi - lo)).std(axis=-1, ddof=1), nan=0.0, posinf=0.0)
            else:
                spread = np.zeros(len(members))
            share[members] += softmax(spread) / 2
    depth = {}
    for b in range(blocks - 1):
        members = sorted((i for i in scored if block[i] == b), key=lambda i: -share[i])
        depth.update({i: d for d, i in enumerate(members)})
    key = (lambda i: -share[i]) if cross else (lambda i: (depth[i], -block[i]))
    return sinks + tail + sorted(scored, key=key)


def kvbench_order(scores: torch.Tensor) -> list[int]:
    order = np.argsort(-scores.double().numpy(), kind="stable").tolist()
    assert len(set(scores.tolist())) == len(scores), "kvbench's scores are a total order"
    return order


def ranks_as(scores: torch.Tensor, order: list[int], cross: bool) -> None:
    """kvbench's scores rank as ``order``: a total order by depth; by the shares themselves (``cross``), equal
    shares left equal (a block whose reference is degenerate, a block of one)."""
    if not cross:
        assert kvbench_order(scores) == order
        return
    along = scores.double().numpy()[order]
    assert bool((np.diff(along) <= 1e-6).all()), along


def hand_view(lengths: list[int], dim: int = 6, seed: int = 0) -> tuple[TokenState, list[tuple]]:
    g = torch.Generator().manual_seed(seed)
    rows, n = len(lengths), max(lengths)
    valid = torch.arange(n) < torch.tensor(lengths).unsqueeze(1)
    keys = torch.randn(rows, n, dim, generator=g).masked_fill(~valid.unsqueeze(-1), 5.0)
    values = torch.randn(rows, n, dim + 2, generator=g).masked_fill(~valid.unsqueeze(-1), -5.0)
    held = [(keys[r, :m].double().numpy(), values[r, :m].double().numpy()) for r, m in enumerate(lengths)]
    positions = torch.arange(n).expand(rows, n).masked_fill(~valid, 0)
    padded = None if len(set(lengths)) == 1 else valid
    return TokenState(keys=keys, values=values, positions=positions, valid=padded), held


@pytest.mark.parametrize("cross", [False, True], ids=["rank", "cross_scoring"])
@pytest.mark.parametrize("lengths", [[27, 27], [27, 18, 9, 30]], ids=["uniform", "padded"])
def test_a_whole_prompt_is_kvpress_lagkv(lengths: list[int], cross: bool) -> None:
    """Sinks 2, blocks of 4: 27 tokens make 6 blocks (5 scored; the last, with 1 more, is the tail), 30 make 7
    with no remainder, 9 are too few for two blocks (the sinks and the newest are kept)."""
    view, held = hand_view(lengths, seed=len(lengths) + cross)
    scores = LagKV(n_sink=2, lag_size=4, cross_scoring=cross)(view)
    for r, (k, v) in enumerate(held):
        assert kvbench_order(scores[r, : len(k)]) == kvpress_order(k, v, 2, 4, cross)
        if cross:
            s = kvpress_scores(k, v, 2, 4, True)
            scored = np.zeros(len(k), dtype=bool)  # kvpress's blocks that have a reference (none in a short row)
            if len(k) >= 2 + 2 * 4:
                scored[2 : 2 + ((len(k) - 2) // 4 - 1) * 4] = True
            np.testing.assert_allclose(scores[r, : len(k)].double().numpy()[scored], s[scored], rtol=1e-5)
    budget = 2 + 5 + 5 * 2  # the first row's sinks, tail and two per scored block: no tie at the cut
    keep = Policy("lagkv", LagKV(n_sink=2, lag_size=4, cross_scoring=cross), All()).keep_mask(view, budget)
    best = np.argsort(-kvpress_scores(*held[0], 2, 4, cross), kind="stable")[:budget]
    assert set(keep[0].nonzero().flatten().tolist()) == set(best.tolist())


def test_rows_with_gaps_follow_the_rule_by_position() -> None:
    g = torch.Generator().manual_seed(7)
    pos = torch.tensor([[0, 1, 3, 6, 7, 9, 10, 11, 12, 15, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26]])
    keys, values = torch.randn(1, 20, 5, generator=g), torch.randn(1, 20, 5, generator=g)
    view = TokenState(keys=keys, values=values, positions=pos)
    for cross in (False, True):
        scores = LagKV(n_sink=2, lag_size=4, cross_scoring=cross)(view)[0]
        args = (pos[0].numpy(), keys[0].double().numpy(), values[0].double().numpy(), 2, 4, cross)
        ranks_as(scores, reference_order(*args), cross)


class Checked(LagKV):
    """LagKV, each call checked against the NumPy rule on every row's held entries."""

    def __init__(self, cross: bool) -> None:
        super().__init__(n_sink=2, lag_size=4, cross_scoring=cross)
        self.calls = self.padded = 0

    def __call__(self, view: TokenState) -> torch.Tensor:
        scores = super().__call__(view)
        self.calls += 1
        self.padded += int(view.valid is not None and not bool(view.valid.all()))
        for r, m in enumerate(view.lengths().tolist()):
            pos = view.positions[r, :m].numpy()
            keys, values = view.keys[r, :m].double().numpy(), view.values[r, :m].double().numpy()
            ranks_as(scores[r, :m], reference_order(pos, keys, values, 2, 4, self.cross_scoring), self.cross_scoring)
        return scores


@pytest.mark.parametrize("allocation", [Allocation(), Adaptive(floor=0.0)], ids=["uniform", "per-head"])
def test_lagkv_through_the_engine_at_every_eviction(tiny, random_ids, allocation) -> None:
    """A chunked prompt that evicts, then decode steps that each evict: every call ranks as the NumPy rule. Under
    per-head allocation the shares themselves rank across heads (``cross_scoring``, kvpress's advice for Ada-KV),
    so that heads come to hold different counts."""
    score = Checked(cross=allocation.per_head)
    policy = Policy("lagkv", score, All(), allocation=allocation)
    g = generate(
        tiny.model, None, random_ids(40, seed=4), policy, 16, "both", DecodeSettings(max_new_tokens=8), stride=8
    )
    assert len(g.tokens) == 8 and score.calls >= 8
    assert score.padded > 0 if allocation.per_head else score.padded == 0


def test_the_config_is_kvpress_defaults_and_bad_options_are_refused() -> None:
    policy = build_policy(tiny_policy_cfg("lagkv"))
    assert isinstance(policy.score, LagKV) and isinstance(policy.scope, All)
    assert (policy.score.n_sink, policy.score.lag_size, policy.score.cross_scoring) == (4, 128, False)
    assert policy.unsupported_stages == ()
    with pytest.raises(ValueError, match="lag_size=0 must be at least 1"):
        build_policy(tiny_policy_cfg("lagkv", score={"lag_size": 0}))
    with pytest.raises(ValueError, match="n_sink=-1 must be >= 0"):
        build_policy(tiny_policy_cfg("lagkv", score={"n_sink": -1}))
