"""SnapKV's pooling stops at the observation window: the entries before the window are pooled as the prefix
alone would be (avg_pool1d / max_pool1d over the n - w prefix columns, as SnapKV's reference and kvpress do),
so the window's attention never spills into its neighbours. The window is found by ``count`` (the last
``window`` tokens fed), not by index."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvbench.engine.cache.cache import KVCache
from kvbench.engine.plan import LayerPlan
from kvbench.engine.step import Phase, Step
from kvbench.policies.allocations.adaptive import Adaptive
from kvbench.policies.base import Allocation
from kvbench.policies.policy import Policy
from kvbench.policies.scopes.everything import All
from kvbench.policies.scopes.sinks_window import SinksWindow
from kvbench.policies.scores.snapkv import SnapKV, pool_neighbours
from kvbench.policies.state import TokenState


def torch_pool(x: torch.Tensor, kernel: int, kind: str) -> torch.Tensor:
    """SnapKV's own pooling of [H, m] rows (stride 1, padding kernel // 2, zero padding counted for avg)."""
    if x.shape[-1] == 0:
        return x
    if kind == "avg":
        return F.avg_pool1d(x.unsqueeze(1), kernel, stride=1, padding=kernel // 2, count_include_pad=True).squeeze(1)
    return F.max_pool1d(x.unsqueeze(1), kernel, stride=1, padding=kernel // 2).squeeze(1)


# ---------------------------------------------------------------------------- worked by hand
# n = 10 entries (positions 0..9, all 10 tokens fed), window 3: the window is positions 7, 8, 9 (count 3, 2, 1).
# The three window queries' rows (causal: query 7 sees 0..7, query 8 sees 0..8, query 9 sees 0..9):
ROWS = torch.tensor(
    [
        [1.0, 0.0, 2.0, 0.0, 0.0, 0.0, 1.0, 4.0, 0.0, 0.0],
        [1.0, 0.0, 2.0, 0.0, 0.0, 0.0, 1.0, 4.0, 5.0, 0.0],
        [1.0, 0.0, 2.0, 0.0, 0.0, 0.0, 1.0, 4.0, 4.0, 6.0],
    ]
)
# Summed over the window: [3, 0, 6, 0, 0, 0, 3 | 12, 9, 6]; the prefix is the first 7 entries.
#
# avg, kernel 3, prefix zero-padded at both ends (the window's 12 is NOT a neighbour of position 6):
#   p0 = (0 + 3 + 0) / 3 = 1      p1 = (3 + 0 + 6) / 3 = 3      p2 = (0 + 6 + 0) / 3 = 2
#   p3 = (6 + 0 + 0) / 3 = 2      p4 = (0 + 0 + 0) / 3 = 0      p5 = (0 + 0 + 3) / 3 = 1
#   p6 = (0 + 3 + 0) / 3 = 1      (pooling over every entry gave (0 + 3 + 12) / 3 = 5)
# The window is not pooled: its entries score their own sums, 12, 9, 6.
HAND_AVG = [1.0, 3.0, 2.0, 2.0, 0.0, 1.0, 1.0, 12.0, 9.0, 6.0]
# max, kernel 3, prefix -inf-padded:
#   p0 = max(3, 0) = 3    p1 = max(3, 0, 6) = 6    p2 = max(0, 6, 0) = 6    p3 = max(6, 0, 0) = 6
#   p4 = max(0, 0, 0) = 0  p5 = max(0, 0, 3) = 3   p6 = max(0, 3) = 3       (over every entry: max(0, 3, 12) = 12)
# The window, unpooled: 12, 9, 6.
HAND_MAX = [3.0, 6.0, 6.0, 6.0, 0.0, 3.0, 3.0, 12.0, 9.0, 6.0]


def hand_state(with_count: bool = True) -> TokenState:
    stats = {"qlog": ROWS.view(1, 3, 10), "qlog_nvis": torch.tensor([[8.0, 9.0, 10.0]])}
    if with_count:
        stats["count"] = 10.0 - torch.arange(10, dtype=torch.float32).view(1, 10)
    return TokenState(positions=torch.arange(10).view(1, 10), stats=stats)


@pytest.mark.parametrize("with_count", [True, False])
@pytest.mark.parametrize("pooling, expected", [("avg", HAND_AVG), ("max", HAND_MAX)])
def test_snapkv_scores_worked_by_hand_at_the_window_boundary(pooling, expected, with_count):
    score = SnapKV(window=3, kernel_size=3, pooling=pooling)
    got = score(hand_state(with_count))
    torch.testing.assert_close(got, torch.tensor([expected]), rtol=0, atol=1e-6)
    # The prefix is exactly SnapKV's pooling of the prefix columns alone.
    summed = ROWS.sum(0, keepdim=True)
    assert torch.equal(got[:, :7], torch_pool(summed[:, :7], 3, pooling))


def test_snapkv_keeps_by_the_prefix_alone_with_the_window_protected():
    """SnapKV's configuration (the window protected by the scope): budget 4 keeps the window and the prefix's best.
    avg: position 1 (3); pooling over every entry would have kept position 6 (5, the window's 12 spilling in).
    max at budget 6: positions 1, 2, 3 (6 each); over every entry position 6 (12) would have been among them."""
    scope = SinksWindow(n_sink=0, window=3)
    avg = Policy("snapkv", SnapKV(window=3, kernel_size=3, pooling="avg"), scope)
    assert avg.partition(hand_state(), 4)[0].tolist() == [[1, 7, 8, 9]]
    high = Policy("snapkv", SnapKV(window=3, kernel_size=3, pooling="max"), scope)
    assert high.partition(hand_state(), 6)[0].tolist() == [[1, 2, 3, 7, 8, 9]]


def test_window_is_found_by_count_not_by_index():
    """A chunked prompt whose eviction dropped position 9: of the last 3 tokens fed (9, 10, 11) the head holds
    10 and 11, so position 8 (third from the end) pools with the prefix, zero beyond it."""
    positions = torch.tensor([[0, 2, 3, 5, 6, 8, 10, 11]])
    summed = torch.tensor([[3.0, 0.0, 0.0, 6.0, 0.0, 3.0, 12.0, 9.0]])
    state = TokenState(
        positions=positions,
        stats={
            "qlog": summed.view(1, 1, 8),
            "qlog_nvis": torch.ones(1, 1),
            "count": (12 - positions).to(torch.float32),
        },
    )
    got = SnapKV(window=3, kernel_size=3, pooling="avg")(state)
    # prefix [3, 0, 0, 6, 0, 3]: 3/3, 3/3, 6/3, 6/3, 9/3, 3/3 (position 8 does not read the 12 of position 10);
    # the window [12, 9] unpooled
    torch.testing.assert_close(got, torch.tensor([[1.0, 1.0, 2.0, 2.0, 3.0, 1.0, 12.0, 9.0]]), rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------- bit for bit, padding
@pytest.mark.parametrize("pooling", ["avg", "max"])
@pytest.mark.parametrize("kernel", [3, 5, 7])
@pytest.mark.parametrize("n, w", [(1, 1), (4, 1), (9, 3), (9, 9), (40, 8), (300, 32)])
def test_pooled_prefix_is_bit_for_bit_torch_pooling_of_the_prefix(n, w, kernel, pooling):
    x = torch.rand(3, n, generator=torch.Generator().manual_seed(n + kernel + w)) * torch.tensor([[1.0], [1e-3], [7.0]])
    window = torch.zeros(3, n, dtype=torch.bool)
    window[:, n - w :] = True
    got = pool_neighbours(x, kernel, pooling, window)
    assert torch.equal(got[:, : n - w], torch_pool(x[:, : n - w], kernel, pooling))
    assert torch.equal(got[:, n - w :], x[:, n - w :])  # the window unpooled
    assert torch.equal(
        x,
        torch.rand(3, n, generator=torch.Generator().manual_seed(n + kernel + w))
        * torch.tensor([[1.0], [1e-3], [7.0]]),
    )  # the scores are never written
    # Without a window: unchanged, the pooling of the whole row.
    assert torch.equal(pool_neighbours(x, kernel, pooling), torch_pool(x, kernel, pooling))


@pytest.mark.parametrize("pooling", ["avg", "max"])
def test_padding_pools_as_before_and_is_never_the_window(pooling):
    """Per-head allocation: head 1 holds 6 entries, padded to 9 with zero statistics (count 0 too). Padding is
    not the window though its count 0 <= window; of the last 4 tokens fed (16..19) head 0 holds all, head 1 three.
    Each head's prefix pools as its prefix alone, and ``Policy.scored`` puts the padding value on padding."""
    fed = 20
    positions = torch.tensor([[3, 5, 8, 12, 15, 16, 17, 18, 19], [2, 9, 14, 17, 18, 19, 0, 0, 0]])
    valid = torch.tensor([[True] * 9, [True] * 6 + [False] * 3])
    summed = torch.rand(2, 9, generator=torch.Generator().manual_seed(3)) * valid
    count = (fed - positions).to(torch.float32) * valid
    state = TokenState(
        positions=positions,
        valid=valid,
        stats={"qlog": summed.unsqueeze(1), "qlog_nvis": torch.ones(2, 1), "count": count},
    )
    score = SnapKV(window=4, kernel_size=5, pooling=pooling)
    assert score.in_window(state).tolist() == [[False] * 5 + [True] * 4, [False] * 3 + [True] * 3 + [False] * 3]
    got = score(state)
    assert torch.equal(got[0, :5], torch_pool(summed[:1, :5], 5, pooling)[0])
    assert torch.equal(got[1, :3], torch_pool(summed[1:, :3], 5, pooling)[0])
    scored = Policy("ada", score, All()).scored(state, 4, padding=float("inf"))
    assert scored[1, 6:].isposinf().all() and torch.isfinite(scored[valid]).all()


# ---------------------------------------------------------------------------- through a cache
HEADS, DIM, WINDOW, BUDGET, KERNEL = 2, 4, 5, 9, 3


def check_prefix_pooling(state: TokenState, seen: int, score: SnapKV, pooling: str) -> None:
    """Each head: the entries fed before the last ``WINDOW`` tokens pool as their sums alone would."""
    got = score(state)
    sums = state.derived("qlog_sum", None)
    for h in range(state.heads):
        n = int(state.lengths()[h])
        pos = state.positions[h, :n]
        prefix = int((pos < seen - WINDOW).sum())
        assert bool((pos[:prefix] < seen - WINDOW).all())  # in sequence order: the prefix comes first
        assert torch.equal(got[h, :prefix], torch_pool(sums[h : h + 1, :prefix], KERNEL, pooling)[0])
        assert torch.equal(got[h, prefix:n], sums[h, prefix:n])  # the window's own entries: unpooled


@pytest.mark.parametrize("pooling", ["avg", "max"])
@pytest.mark.parametrize("per_head", [False, True])
def test_prefix_pooling_through_chunks_and_decode_steps(per_head, pooling):
    """A prompt of two chunks (the second evicts) then decode steps that each evict (stage=both scores decode
    steps alike): at every step the window is the last WINDOW tokens fed, the query log's, and what is held before
    it pools as SnapKV's prefix."""
    g = torch.Generator().manual_seed(5)
    score = SnapKV(window=WINDOW, kernel_size=KERNEL, pooling=pooling)
    policy = Policy("snap", score, All(), allocation=Adaptive(floor=0.0) if per_head else Allocation())
    assert "count" in policy.needs
    plans = [LayerPlan(BUDGET, prefill=16, decode=16, total=64)]
    cache = KVCache([plans], policy)
    cache.assign(0, plans)
    layer = cache.layers[0]
    fed = 0
    for q in [7, 6] + [1] * 12:
        phase = Phase.prefill if q > 1 else Phase.decode
        step = Step(range(1), [list(range(fed, fed + q))], phase, evicts=True, collects=True)
        cache.begin(step)
        keys, _ = cache.update(
            torch.randn(1, HEADS, q, DIM, generator=g), torch.randn(1, HEADS, q, DIM, generator=g), 0
        )
        span, r = keys.shape[2], min(q, WINDOW)
        visible = torch.ones(HEADS, span, dtype=torch.bool)
        if layer.visible is not None:
            visible[:, : layer.visible.shape[1]] = layer.visible
        rows = torch.rand(HEADS, r, span, generator=g) * (visible & (layer.key_positions >= 0)).unsqueeze(1)
        if q > 1:
            for i in range(r):  # causal within the chunk
                rows[:, i, span - r + i + 1 :] = 0.0
        layer.record({"qlog": rows, "qlog_nvis": torch.full((HEADS, r), float(span))})
        cache.finish(step)
        fed += q
        check_prefix_pooling(cache.layer_state(0), fed, score, pooling)
    assert fed > 2 * BUDGET


def test_decode_window_follows_the_query_log():
    """After the prompt the window is still the last ``window`` queries: a state one decode step later has
    shifted it by one entry."""
    score = SnapKV(window=3, kernel_size=3)
    positions = torch.arange(11).view(1, 11)
    state = TokenState(
        positions=positions,
        stats={
            "qlog": torch.zeros(1, 3, 11),
            "qlog_nvis": torch.ones(1, 3),
            "count": (11 - positions).to(torch.float32),
        },
    )
    assert score.in_window(state).nonzero()[:, 1].tolist() == [8, 9, 10]
