"""Scores, scopes and selection on small hand-written tensors, with the expected kept sets worked out by hand."""

from __future__ import annotations

import torch

from kvbench.policies.policy import Policy
from kvbench.policies.registry import build_policy
from kvbench.policies.scopes.everything import All
from kvbench.policies.scopes.sinks_window import SinksWindow
from kvbench.policies.scores.recency import Recency
from kvbench.policies.scores.uniform_random import Random
from kvbench.policies.state import TokenState


def state(positions: list[list[int]], seed: int = 0) -> TokenState:
    pos = torch.tensor(positions)
    h, n = pos.shape
    return TokenState(keys=torch.zeros(h, n, 2), values=torch.zeros(h, n, 2), positions=pos, stats={}, seed=seed)


def test_recency_keeps_newest_per_head():
    # Head 0 holds positions 0..5, head 1 holds a sparser set; budget 3 keeps the three largest positions.
    s = state([[0, 1, 2, 3, 4, 5], [0, 2, 7, 8, 11, 12]])
    keep = Policy("window", Recency(), All()).partition(s, 3)[0]
    assert keep.tolist() == [[3, 4, 5], [3, 4, 5]]
    assert s.positions.gather(1, keep).tolist() == [[3, 4, 5], [8, 11, 12]]


def test_sinks_and_window_protects_first_and_last():
    # 10 tokens, budget 6, 2 sinks, window 2 -> protected {0,1} and {8,9}; recency fills the other 2 with {6,7}.
    s = state([list(range(10))])
    scope = SinksWindow(n_sink=2, window=2)
    assert scope.protected(s, 6).nonzero()[:, 1].tolist() == [0, 1, 8, 9]
    keep = Policy("p", Recency(), scope).partition(s, 6)[0]
    assert keep.tolist() == [[0, 1, 6, 7, 8, 9]]


def test_protection_beats_score():
    # A score that prefers the oldest tokens still cannot evict the protected recent window.
    class Oldest(Recency):
        def __call__(self, st):
            return -super().__call__(st)

    s = state([list(range(8))])
    keep = Policy("p", Oldest(), SinksWindow(n_sink=0, window=3)).partition(s, 4)[0]
    assert keep.tolist() == [[0, 5, 6, 7]]


def test_window_fraction_of_budget_and_sink_cap():
    scope = SinksWindow(n_sink=4, window=0.5)
    assert scope.window_size(10) == 5
    assert scope.window_size(6) == 2  # capped at budget - sinks
    assert scope.min_budget() == 5


def test_streamingllm_keeps_sinks_plus_recent():
    # budget 7 with 4 sinks and recency: positions 0-3 then the 3 newest.
    s = state([list(range(20)), list(range(20))])
    policy = build_policy(
        {"name": "streamingllm", "score": "recency", "scope": {"kind": "sinks_window", "n_sink": 4, "window": 0}}
    )
    assert policy.partition(s, 7)[0].tolist() == [[0, 1, 2, 3, 17, 18, 19]] * 2


def test_random_is_seeded_uniform_and_sorted():
    s1, s2, s3 = state([list(range(50))], seed=1), state([list(range(50))], seed=1), state([list(range(50))], seed=2)
    p = Policy("random", Random(), All())
    k1, k2, k3 = p.partition(s1, 10)[0], p.partition(s2, 10)[0], p.partition(s3, 10)[0]
    assert torch.equal(k1, k2) and not torch.equal(k1, k3)
    assert torch.equal(k1, k1.sort().values) and len(set(k1[0].tolist())) == 10
    # Uniform: over many steps (draws afresh at each) every token is kept with probability budget / n = 0.2.
    counts = torch.zeros(50)
    for step in range(2000):
        st = TokenState(positions=torch.arange(50).unsqueeze(0), seed=3, seen=50 + step)
        counts[p.partition(st, 10)[0][0]] += 1
    assert (counts / 2000 - 0.2).abs().max() < 0.04


def test_full_never_evicts_and_unknown_parts_are_named():
    assert build_policy({"name": "full"}).evicts is False
    import pytest

    with pytest.raises(ValueError, match="unknown score 'nope'"):
        build_policy({"name": "x", "score": "nope"})


# ---------------------------------------------------------------------------- the zoo's parts
# Each score on small tensors against a plain NumPy reference; kept sets are the reference's top-k.

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from kvbench.engine.attention import attention_statistics, decode_attention  # noqa: E402
from kvbench.engine.visibility import KeyAccess  # noqa: E402
from kvbench.policies.allocations.adaptive import Adaptive  # noqa: E402
from kvbench.policies.allocations.pyramid import Pyramid  # noqa: E402
from kvbench.policies.base import Allocation, Score  # noqa: E402
from kvbench.policies.derived import attention_variance  # noqa: E402
from kvbench.policies.ends import last_n  # noqa: E402
from kvbench.policies.merge import merge_evicted  # noqa: E402
from kvbench.policies.scopes.robust import Robust  # noqa: E402
from kvbench.policies.scores.accumulated import Accumulated  # noqa: E402
from kvbench.policies.scores.hits import Hits  # noqa: E402
from kvbench.policies.scores.key_norm import KeyNorm  # noqa: E402
from kvbench.policies.scores.last_query import Last  # noqa: E402
from kvbench.policies.scores.mean import Mean  # noqa: E402
from kvbench.policies.scores.shared import SharedAcrossHeads  # noqa: E402
from kvbench.policies.scores.snapkv import SnapKV, pool_neighbours  # noqa: E402
from kvbench.policies.scores.value_aware import ValueAware  # noqa: E402
from kvbench.policies.statistics import Collecting  # noqa: E402

RNG = np.random.default_rng(7)
H, N, W = 2, 10, 4
ACC = RNG.random((H, N)) * 3
COUNT = RNG.integers(1, 12, (H, N)).astype(np.float64)
LAST = RNG.random((H, N))
QLOG = RNG.random((H, W, N)) * (RNG.random((H, W, N)) > 0.3) / 5
NVIS = RNG.integers(4, 12, (H, W)).astype(np.float64)
KEYS = RNG.normal(size=(H, N, 4))
VALUES = RNG.normal(size=(H, N, 4))


def rich_state(phase: str = "prefill", score: Score | None = None) -> TokenState:
    """What a cache hands ``score``: its query log as the score logs it, its write-time features."""
    t = lambda a: torch.tensor(a, dtype=torch.float32)  # noqa: E731
    keys, values = t(KEYS), t(VALUES)
    qlog = t(QLOG) if score is None else score.log_rows(t(QLOG), t(NVIS))
    features = {} if score is None else score.features(keys, values, {})
    stats = {"acc": t(ACC), "count": t(COUNT), "last": t(LAST), "qlog": qlog, "qlog_nvis": t(NVIS)} | features
    return TokenState(keys=keys, values=values, positions=torch.arange(N).repeat(H, 1), stats=stats, phase=phase)


def np_pool(x: np.ndarray, k: int, kind: str) -> np.ndarray:
    pad = k // 2
    fill = 0.0 if kind == "avg" else -np.inf
    padded = np.pad(x, ((0, 0), (pad, pad)), constant_values=fill)
    windows = np.stack([padded[:, i : i + x.shape[1]] for i in range(k)])
    return windows.mean(0) if kind == "avg" else windows.max(0)


def np_window_pool(x: np.ndarray, k: int, kind: str, window: np.ndarray) -> np.ndarray:
    """SnapKV's pooling stopped at the observation window: the other entries pool only their non-window
    neighbours (the window reads as padding), the window's own entries stay unpooled."""
    out = x.copy()
    for h, j in zip(*np.nonzero(~window)):
        near = [x[h, i] for i in range(j - k // 2, j + k // 2 + 1) if 0 <= i < x.shape[1] and not window[h, i]]
        out[h, j] = sum(near) / k if kind == "avg" else max(near)
    return out


REFERENCES = {
    "accumulated": (Accumulated(), ACC),
    "mean": (Mean(), ACC / COUNT),
    "last": (Last(), LAST),
    "hits": (Hits(history=W, threshold=1.5), ((QLOG >= 1.5 / NVIS[..., None]) & (QLOG > 0)).sum(1)),
    "snapkv_avg": (
        SnapKV(window=W, kernel_size=3, pooling="avg"),
        np_window_pool(QLOG.sum(1), 3, "avg", COUNT <= W),
    ),
    "snapkv_max": (
        SnapKV(window=W, kernel_size=5, pooling="max"),
        np_window_pool(QLOG.sum(1), 5, "max", COUNT <= W),
    ),
    "key_norm": (KeyNorm(), -np.linalg.norm(KEYS, axis=-1)),
    "value_aware": (ValueAware(base="accumulated", p=1), ACC * np.abs(VALUES).sum(-1)),
    "value_aware_mean_l2": (ValueAware(base="mean", p=2), ACC / COUNT * np.linalg.norm(VALUES, axis=-1)),
    "tova_shared": (SharedAcrossHeads(Last()), np.tile(LAST.mean(0), (H, 1))),
}


@pytest.mark.parametrize("name", list(REFERENCES))
def test_score_matches_numpy_reference_and_keeps_its_top_k(name):
    score, expected = REFERENCES[name]
    got = score(rich_state(score=score)).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    budget = 4
    keep = Policy(name, score, All()).partition(rich_state(score=score), budget)[0].numpy()
    for h in range(H):
        ranked = np.argsort(-expected[h], kind="stable")
        if expected[h][ranked[budget - 1]] == expected[h][ranked[budget]]:
            continue  # a tie at the cut: either kept set is right
        assert keep[h].tolist() == sorted(ranked[:budget].tolist()), (h, expected[h])


def test_hits_worked_by_hand():
    """History of 4 queries, each saw 5 tokens (uniform share 0.2). Hits per token: 4, 0, 2, 1, 3."""
    rows = torch.tensor(
        [
            [0.30, 0.10, 0.25, 0.05, 0.30],
            [0.40, 0.15, 0.10, 0.20, 0.15],
            [0.25, 0.05, 0.30, 0.10, 0.30],
            [0.20, 0.19, 0.10, 0.19, 0.32],
        ]
    )
    hits, nvis = Hits(history=4), torch.full((1, 4), 5.0)
    s = TokenState(
        positions=torch.arange(5).view(1, 5), stats={"qlog": hits.log_rows(rows.view(1, 4, 5), nvis), "qlog_nvis": nvis}
    )
    assert hits(s).tolist() == [[4, 0, 2, 1, 3]]
    assert Policy("sh", hits, All()).partition(s, 2)[0].tolist() == [[0, 4]]
    # Slots never written (nvis 0) hit nothing.
    empty = TokenState(
        positions=torch.arange(5).view(1, 5),
        stats={"qlog": hits.log_rows(torch.zeros(1, 4, 5), torch.zeros(1, 4)), "qlog_nvis": torch.zeros(1, 4)},
    )
    assert hits(empty).sum() == 0


def test_snapkv_pooling_brings_neighbours():
    """One strongly attended token: avg pooling (kernel 3) lifts its two neighbours above the rest."""
    obs = torch.tensor([[0.0, 0.01, 0.0, 0.9, 0.0, 0.02, 0.0, 0.03]])
    s = TokenState(
        positions=torch.arange(8).view(1, 8), stats={"qlog": obs.view(1, 1, 8), "qlog_nvis": torch.ones(1, 1)}
    )
    assert Policy("s", SnapKV(window=1, kernel_size=3), All()).partition(s, 3)[0].tolist() == [[2, 3, 4]]
    assert Policy("s", SnapKV(window=1, kernel_size=1), All()).partition(s, 3)[0].tolist() == [[3, 5, 7]]


@pytest.mark.parametrize("kernel", [3, 5, 7])
@pytest.mark.parametrize("n", [1, 2, 4, 9, 300])
def test_snapkv_pooling_is_bit_for_bit_torch_pooling(n, kernel):
    """The shifted-add pooling computes exactly what SnapKV's avg_pool1d / max_pool1d do (zero padding counted)."""
    x = torch.rand(3, n, generator=torch.Generator().manual_seed(n + kernel)) * torch.tensor([[1.0], [1e-3], [7.0]])
    pad = kernel // 2
    avg = torch.nn.functional.avg_pool1d(x.unsqueeze(1), kernel, stride=1, padding=pad, count_include_pad=True)
    high = torch.nn.functional.max_pool1d(x.unsqueeze(1), kernel, stride=1, padding=pad)
    assert torch.equal(pool_neighbours(x, kernel, "avg"), avg.squeeze(1))
    assert torch.equal(pool_neighbours(x, kernel, "max"), high.squeeze(1))


def np_attention_history(n_queries: int, n: int, seed: int) -> np.ndarray:
    """Rows of a causal attention history: query i (i = n - n_queries ...) sees keys 0..i."""
    rng = np.random.default_rng(seed)
    rows = np.zeros((n_queries, n))
    for r, i in enumerate(range(n - n_queries, n)):
        p = rng.random(i + 1) ** 3
        rows[r, : i + 1] = p / p.sum()
    return rows


@pytest.mark.parametrize("phase, n_std", [("prefill", 2), ("decode", 4)])
def test_robust_scope_protects_sinks_recent_and_highest_std(phase, n_std):
    n, budget = 12, 8
    rows = np_attention_history(12, n, seed=3)
    seen = rows > 0
    count = seen.sum(0)
    mean = rows.sum(0) / count
    std = np.sqrt((rows**2).sum(0) / count - mean**2)
    np.testing.assert_allclose(std, [rows[seen[:, j], j].std() for j in range(n)], atol=1e-12)
    stats = {
        "acc": torch.tensor(rows.sum(0)).view(1, n).float(),
        "sumsq": torch.tensor((rows**2).sum(0)).view(1, n).float(),
        "count": torch.tensor(count).view(1, n).float(),
    }
    s = TokenState(positions=torch.arange(n).view(1, n), stats=stats, phase=phase)
    scope = Robust(n_sink=2, n_recent=2, rho_prefill=0.25, rho_decode=0.5)  # floor(rho * 8) = 2 or 4
    middle = np.arange(2, n - 2)
    top_std = middle[np.argsort(-std[middle])[:n_std]]
    expected = sorted({0, 1, n - 2, n - 1} | set(top_std.tolist()))
    assert scope.protected(s, budget)[0].nonzero().flatten().tolist() == expected
    deviation = attention_variance(s)[0].clamp_min(0.0).sqrt()
    torch.testing.assert_close(deviation, torch.tensor(std).float(), rtol=1e-4, atol=1e-6)
    # The score fills the rest of the budget among unprotected tokens.
    keep = Policy("p", Accumulated(), scope).partition(s, budget)[0][0].tolist()
    rest = [j for j in np.argsort(-rows.sum(0)) if j not in expected][: budget - len(expected)]
    assert keep == sorted(expected + [int(j) for j in rest])
    assert scope.min_budget() == 5
    assert scope.std_count(5, "decode") == 1  # capped: 2 sinks + 2 recent leave one slot


def test_scopes_on_heads_of_different_lengths():
    """Under per-head allocation heads are padded: 'newest' ends at each head's own length."""
    valid = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    s = TokenState(positions=torch.tensor([[0, 1, 2, 3, 4, 5], [0, 2, 5, 9, 0, 0]]), stats={}, valid=valid)
    assert last_n(s, 2).tolist() == [[False] * 4 + [True] * 2, [False, False, True, True, False, False]]
    assert SinksWindow(n_sink=1, window=1).protected(s, 3).nonzero().tolist() == [[0, 0], [0, 5], [1, 0], [1, 3]]


def test_pyramid_budgets_by_hand():
    # B=100, 5 layers, 10 reserved, beta 20: free 90, top 10 + 4.5, bottom 10 + 180 - 4.5, linear:
    # 185.5, 142.75, 100, 57.25, 14.5 -> rounded keeping the total 500.
    assert Pyramid(beta=20).layer_budgets(100, 5, None, 10) == [186, 143, 100, 57, 14]
    capped = Pyramid(beta=20).layer_budgets(100, 5, 120, 10)
    assert sum(capped) == 500 and max(capped) == 120 and capped == sorted(capped, reverse=True)
    assert Pyramid().layer_budgets(100, 4, 90, 0) == [90] * 4  # budget >= what a layer holds: nothing evicts
    assert min(Pyramid().layer_budgets(20, 8, None, 6)) >= 7  # every layer keeps its reserve plus one
    assert Allocation().layer_budgets(7, 3) == [7, 7, 7]


def kvpress_layer_budget(q_len: int, share: float, window: int, beta: float, layer: int, layers: int) -> int:
    """kvpress's PyramidKVPress.get_layer_budget, from its docstring's equations, for the kept share
    q_len × (1 - compression_ratio): max + min = 2 × share, min = share / beta, max clipped at q_len - window;
    outside q_len >= max >= min >= window, the share rounded."""
    low = share / beta
    high = 2 * share - low
    if high >= q_len - window:
        high = q_len - window
        low = 2 * share - high
    if not q_len >= high >= low >= window:
        return max(1, round(share))
    return round(high - layer * (high - low) / (layers - 1))


@pytest.mark.parametrize(
    ("q_len", "ratio", "layers"),
    [(1000, 0.5, 30), (1000, 0.2, 30), (1049, 0.5, 30), (1000, 0.95, 30), (600, 0.4, 12), (2048, 0.1, 7)],
)
def test_pyramid_kvpress_ramp_is_kvpress_budgets(q_len, ratio, layers):
    """kvpress's budgets at the kept share kvbench's whole-token budget is: kvpress's own wherever
    q_len × (1 - ratio) is whole. 1049 × 0.5 is not: kvpress ramps 524.5 (its top layer 64, the window, after
    clipping) where kvbench's 524 leaves the top layer 63, below the window, and both fall back to uniform."""
    window, beta = 64, 20
    budget = int(q_len * (1 - ratio))
    got = Pyramid(beta=beta, ramp="kvpress").layer_budgets(budget, layers, q_len, window)
    assert got == [kvpress_layer_budget(q_len, budget, window, beta, i, layers) for i in range(layers)]
    assert len(set(got)) > 1 or ratio == 0.95 or q_len == 1049  # a ramp, unless kvpress's does not fit
    with pytest.raises(ValueError, match="ramp"):
        Pyramid(ramp="linear")


def test_adaptive_split_by_hand():
    scores = torch.tensor([[0.9, 0.8, 0.7, 0.6, 0.5], [0.1, 0.05, 0.3, 0.02, 0.01]])
    # Budget 3 per head, total 6. floor 0.34 -> one guaranteed per head (its best); the 4 other slots go to
    # the highest remaining scores, all in head 0.
    keep = Adaptive(floor=0.34).keep(scores, None, 3)
    assert keep.tolist() == [[True] * 5, [False, False, True, False, False]]
    # floor 0.67 -> two guaranteed per head; the two free slots to head 0's next best.
    keep = Adaptive(floor=0.67).keep(scores, None, 3)
    assert keep.tolist() == [[True, True, True, True, False], [True, False, True, False, False]]
    # A protected entry (+inf) always stays, and padding never does.
    protected = scores.clone()
    protected[1, 4] = float("inf")
    valid = torch.tensor([[True] * 5, [True] * 5])
    keep = Adaptive(floor=0.0).keep(protected, valid, 3)
    assert keep[1, 4] and keep.sum() == 6
    valid = torch.tensor([[True] * 5, [True, True, False, False, False]])
    keep = Adaptive(floor=0.0).keep(scores, valid, 2)
    assert keep.sum() == 4 and not keep[1, 2:].any()


def test_merge_evicted_by_hand():
    keys = torch.tensor([[[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.9], [0.8, -0.1]]])
    values = torch.arange(10, dtype=torch.float32).view(1, 5, 2)
    w = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0]])
    keep = torch.tensor([[True, False, True, False, False]])
    k, v, absorbed = merge_evicted(keys, values, w, keep)
    # 1 and 4 fold into 0 (cosine), 3 into 2.
    torch.testing.assert_close(k[0, 0], (1 * keys[0, 0] + 2 * keys[0, 1] + 5 * keys[0, 4]) / 8)
    torch.testing.assert_close(k[0, 2], (3 * keys[0, 2] + 4 * keys[0, 3]) / 7)
    torch.testing.assert_close(v[0, 0], (1 * values[0, 0] + 2 * values[0, 1] + 5 * values[0, 4]) / 8)
    torch.testing.assert_close(v[0, 2], (3 * values[0, 2] + 4 * values[0, 3]) / 7)
    assert absorbed.tolist() == [[7.0, 0.0, 4.0, 0.0, 0.0]]
    torch.testing.assert_close(k[0, [1, 3, 4]], keys[0, [1, 3, 4]])  # evicted rows untouched (dropped later)


def np_statistics(q: np.ndarray, k: np.ndarray, past: int, visible: np.ndarray, history: int):
    """Dense reference: softmax per query head with the engine's mask, mean over each KV head's group."""
    hq, nq, _ = q.shape
    hkv, n, d = k.shape
    group = hq // hkv
    probs = np.zeros((hkv, nq, n))
    nvis = np.zeros((hkv, nq))
    for h in range(hq):
        kv = h // group
        logits = q[h] @ k[kv].T / np.sqrt(d)
        allowed = np.arange(n)[None, :] <= (np.arange(nq)[:, None] + past)
        allowed[:, :past] &= visible[kv][None, :]
        logits = np.where(allowed, logits, -np.inf)
        p = np.exp(logits - logits.max(1, keepdims=True))
        probs[kv] += p / p.sum(1, keepdims=True) / group
        nvis[kv] = allowed.sum(1)
    r = min(nq, history)
    return {
        "acc": probs.sum(1),
        "sumsq": (probs**2).sum(1),
        "last": probs[:, -1],
        "qlog": probs[:, nq - r :],
        "qlog_nvis": nvis[:, nq - r :],
    }


@pytest.mark.parametrize("masked", [False, True])
def test_decode_attention_gives_sdpa_output_and_the_reference_statistics(masked):
    """The decode step's single pass: SDPA's output (GQA, with the past mask) and the dense statistics."""
    rng = np.random.default_rng(6)
    q, k, v = rng.normal(size=(4, 1, 8)), rng.normal(size=(2, 9, 8)), rng.normal(size=(2, 9, 8))
    visible = (
        np.array(
            [[True, False, True, True, True, False, True, True], [False, True, True, True, True, True, True, True]]
        )
        if masked
        else np.ones((2, 8), bool)
    )
    expected = np_statistics(q, k, 8, visible, history=4)
    t = lambda a: torch.tensor(a).float().unsqueeze(0)  # noqa: E731
    allowed = torch.cat([torch.tensor(visible), torch.ones(2, 1, dtype=torch.bool)], 1)
    output, got = decode_attention(
        t(q),
        t(k),
        t(v),
        KeyAccess(8**-0.5, visible=allowed if masked else None),
        Collecting(frozenset({"acc", "sumsq", "last", "qlog"}), history=4),
    )
    for name, ref in expected.items():
        np.testing.assert_allclose(got[name].numpy(), ref, rtol=1e-5, atol=1e-6, err_msg=name)
    allowed = allowed.repeat_interleave(2, 0)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        t(q), t(k).repeat_interleave(2, 1), t(v).repeat_interleave(2, 1), attn_mask=allowed.unsqueeze(1), scale=8**-0.5
    )
    torch.testing.assert_close(output, sdpa.transpose(1, 2), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("block", [1 << 22, 7])
def test_attention_statistics_match_dense_reference_in_any_block_size(block, monkeypatch):
    import kvbench.engine.blocked as blocked

    monkeypatch.setattr(blocked, "STATS_BLOCK_ELEMENTS", block)  # 7: one query per block
    rng = np.random.default_rng(5)
    q, k = rng.normal(size=(4, 5, 8)), rng.normal(size=(2, 9, 8))
    visible = np.array([[True, False, True, True], [False, True, True, True]])
    expected = np_statistics(q, k, 4, visible, history=3)
    access = KeyAccess(8**-0.5, 4, torch.tensor(visible))
    got = attention_statistics(
        torch.tensor(q).float().unsqueeze(0),
        torch.tensor(k).float().unsqueeze(0),
        access,
        Collecting(frozenset({"acc", "sumsq", "last", "qlog"}), history=3),
    )
    for name, ref in expected.items():
        np.testing.assert_allclose(got[name].numpy(), ref, rtol=1e-5, atol=1e-6, err_msg=name)
    # Policies reading only the last query(s) compute only those rows, to the same values.
    for needs in ({"last"}, {"qlog"}, {"last", "qlog"}):
        got = attention_statistics(
            torch.tensor(q).float().unsqueeze(0),
            torch.tensor(k).float().unsqueeze(0),
            access,
            Collecting(frozenset(needs), history=3),
        )
        assert set(got) == set(needs) | ({"qlog_nvis"} if "qlog" in needs else set())
        for name in got:
            np.testing.assert_allclose(got[name].numpy(), expected[name], rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize(
    "scope",
    [
        All(),
        SinksWindow(n_sink=2, window=3),
        SinksWindow(n_sink=0, window=0.5),
        SinksWindow(n_sink=4, window=0),
        Robust(n_sink=2, n_recent=3, rho_decode=0.4),
    ],
)
@pytest.mark.parametrize("budget", [1, 5, 9, 14])
def test_in_order_shield_is_the_general_protected_set(scope, budget):
    """Heads of one length take slices (``shield``); it must protect exactly what the general masks do, as
    computed for the same heads marked as per-head padded (every entry valid), and never touch the scores."""
    g = torch.Generator().manual_seed(budget)
    n, heads = 12, 3
    acc = torch.rand(heads, n, generator=g)
    stats = {
        "acc": acc,
        "sumsq": acc.square() * torch.rand(heads, n, generator=g),
        "count": torch.arange(n, 0, -1.0).expand(heads, n),
    }
    positions = torch.arange(n).expand(heads, n)
    uniform = TokenState(positions=positions, stats=stats, phase="decode")
    padded = TokenState(positions=positions, stats=stats, phase="decode", valid=torch.ones(heads, n, dtype=torch.bool))
    scores = torch.rand(heads, n, generator=g)
    before = scores.clone()
    shielded = scope.shield(scores, uniform, budget)
    torch.testing.assert_close(scores, before)
    general = scope.protected(padded, budget)
    assert shielded.isposinf().tolist() == general.tolist()
    torch.testing.assert_close(shielded[~general], scores[~general])
    assert scope.protected(uniform, budget).tolist() == general.tolist()


def test_batched_decode_attention_is_each_sequences_own():
    """Three sequences in one decode step, each row masked to its own slots (free slots anywhere): the output
    and statistics of each equal NumPy's for that sequence alone."""
    rng = np.random.default_rng(8)
    b, hq, hkv, n, dim = 3, 4, 2, 9, 8
    q, k, v = rng.normal(size=(b, hq, 1, dim)), rng.normal(size=(b, hkv, n, dim)), rng.normal(size=(b, hkv, n, dim))
    visible = rng.random((b * hkv, n)) < 0.7
    visible[:, -1] = True
    needs = frozenset({"acc", "sumsq", "last", "qlog"})
    t = lambda a: torch.tensor(a).float()  # noqa: E731
    output, got = decode_attention(
        t(q), t(k), t(v), KeyAccess(dim**-0.5, visible=torch.tensor(visible)), Collecting(needs, history=2)
    )
    for i in range(b):
        rows = slice(i * hkv, (i + 1) * hkv)
        expected = np_statistics(q[i], k[i], n - 1, visible[rows, :-1], history=2)
        for name, ref in expected.items():
            np.testing.assert_allclose(got[name][rows].numpy(), ref, rtol=1e-5, atol=1e-6, err_msg=name)
        mask = torch.tensor(visible[rows]).repeat_interleave(hq // hkv, 0).unsqueeze(1)
        sdpa = torch.nn.functional.scaled_dot_product_attention(
            t(q[i : i + 1]),
            t(k[i : i + 1]).repeat_interleave(2, 1),
            t(v[i : i + 1]).repeat_interleave(2, 1),
            attn_mask=mask,
            scale=dim**-0.5,
        )
        torch.testing.assert_close(output[i : i + 1], sdpa.transpose(1, 2), rtol=1e-5, atol=1e-6)
