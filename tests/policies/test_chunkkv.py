"""ChunkKV against NumPy from kvpress's ChunkKVPress equations: chunks of ``chunk`` positions ranked by the mean
base score over the chunk (summed over the heads when the base is shared), whole chunks kept best first. kvpress
keeps whole chunks only; kvbench keeps exactly the budget, the chunk the budget cuts kept by its best entries."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import tiny_policy_cfg
from engine_run import generate
from layer_zero import LayerZero

from kvbench.engine.engine import DecodeSettings
from kvbench.policies.base import Allocation
from kvbench.policies.policy import Policy
from kvbench.policies.registry import build_policy
from kvbench.policies.scopes.everything import All
from kvbench.policies.scores.chunkkv import ChunkKV
from kvbench.policies.scores.shared import SharedAcrossHeads
from kvbench.policies.scores.snapkv import SnapKV
from kvbench.policies.state import TokenState

KEY_NORM = {"kind": "key_norm"}  # an attention-free base: NumPy computes it from the keys alone


def kvpress_kept(base: np.ndarray, chunk: int, kept_chunks: int) -> set[int]:
    """ChunkKVPress on one row's (or the heads' summed) base scores [n]: complete chunks and the short last one
    ranked by their mean, the top ``kept_chunks`` kept whole."""
    n = len(base)
    starts = list(range(0, n, chunk))
    means = np.array([base[s : s + chunk].mean() for s in starts])
    best = np.argsort(-means, kind="stable")[:kept_chunks]
    return {i for c in best for i in range(starts[c], min(starts[c] + chunk, n))}


def kvbench_rule(base: np.ndarray, chunk: int) -> list[int]:
    """The entries best first, as kvbench documents it: by chunk (mean base score, descending; ties: the earlier
    chunk), then by base score within the chunk (ties: the earlier entry)."""
    n = len(base)
    means = {c: base[c * chunk : (c + 1) * chunk].mean() for c in range((n + chunk - 1) // chunk)}
    rank = {c: r for r, c in enumerate(sorted(means, key=lambda c: (-means[c], c)))}
    return sorted(range(n), key=lambda i: (rank[i // chunk], -base[i], i))


def view_of(keys: torch.Tensor, lengths: list[int]) -> TokenState:
    rows, n = keys.shape[:2]
    valid = torch.arange(n) < torch.tensor(lengths).unsqueeze(1)
    keys = keys.masked_fill(~valid.unsqueeze(-1), 9.0)
    norms = keys.norm(dim=-1).masked_fill(~valid, 0.0)
    padded = None if len(set(lengths)) == 1 else valid
    positions = torch.arange(n).expand(rows, n).masked_fill(~valid, 0)
    return TokenState(keys=keys, values=keys, positions=positions, valid=padded, stats={"key_norm": norms})


def kept(policy: Policy, view: TokenState, budget: int) -> list[set[int]]:
    return [set(row.nonzero().flatten().tolist()) for row in policy.keep_mask(view, budget)]


@pytest.mark.parametrize("n", [45, 47], ids=["whole-chunks", "short-last-chunk"])
@pytest.mark.parametrize("shared", [False, True], ids=["per-head", "shared"])
def test_whole_chunks_are_kvpress_chunkkv(shared: bool, n: int) -> None:
    """Chunks of 5 (47 tokens: 9 whole and a short one of 2): at every budget kvbench keeps what kvpress keeps, and
    where kvpress keeps fewer (the short chunk among those kept, or a budget between whole chunks), the best entries
    of the next chunk."""
    keys = torch.randn(3, n, 4, generator=torch.Generator().manual_seed(1))
    view = view_of(keys, [n] * 3)
    base = -np.linalg.norm(keys.double().numpy(), axis=-1)  # [heads, n]
    policy = Policy("chunkkv", ChunkKV(base=KEY_NORM | {"shared": shared}, chunk=5), All())
    rows = [base.sum(axis=0)] * 3 if shared else list(base)
    for budget in range(1, n + 1):
        for r, got in enumerate(kept(policy, view, budget)):
            assert got == set(kvbench_rule(rows[r], 5)[:budget])
            if budget % 5 == 0:
                whole = kvpress_kept(rows[r], 5, budget // 5)
                assert whole <= got and (whole == got or n % 5 != 0)
    if shared:
        assert all(got == kept(policy, view, 20)[0] for got in kept(policy, view, 20))


def test_padded_rows_rank_their_own_chunks() -> None:
    keys = torch.randn(3, 23, 4, generator=torch.Generator().manual_seed(2))
    lengths = [23, 15, 9]
    view = view_of(keys, lengths)
    policy = Policy("chunkkv", ChunkKV(base=KEY_NORM, chunk=4), All(), allocation=Allocation())
    for budget in (4, 7, 8):
        for r, got in enumerate(kept(policy, view, budget)):
            base = -np.linalg.norm(keys[r, : lengths[r]].double().numpy(), axis=-1)
            assert got == set(kvbench_rule(base, 4)[:budget])


class Recorded(ChunkKV):
    def __init__(self, layer_zero: LayerZero, **options):
        super().__init__(**options)
        self.layer_zero = layer_zero

    def __call__(self, state: TokenState) -> torch.Tensor:
        self.layer_zero.record(state)
        return super().__call__(state)


def test_chunkkv_through_the_engine(tiny, random_ids) -> None:
    """The prompt at once: layer 0 (keys independent of every other token) keeps NumPy's chunks."""
    n, budget = 40, 14
    heads = tiny.model.config.num_key_value_heads
    layer_zero = LayerZero(heads)
    policy = Policy("chunkkv", Recorded(layer_zero, base=KEY_NORM, chunk=4), All())
    g = generate(tiny.model, None, random_ids(n, seed=6), policy, budget, "prefill", DecodeSettings(1), trace=True)
    for head in range(heads):
        base = -np.linalg.norm(layer_zero.keys(head, n), axis=-1)
        assert set(g.trace[0][0][head].tolist()) == set(kvbench_rule(base, 4)[:budget])


def test_the_named_config_keeps_one_set_per_layer(tiny, random_ids) -> None:
    cfg = tiny_policy_cfg("chunkkv")
    policy = build_policy(cfg)
    assert isinstance(policy.score, ChunkKV) and policy.score.chunk == 20
    inner = policy.score.inner
    assert isinstance(inner, SharedAcrossHeads) and isinstance(inner.inner, SnapKV)
    assert policy.unsupported_stages == ("decode",)
    g = generate(
        tiny.model,
        None,
        random_ids(50, seed=3),
        build_policy(tiny_policy_cfg("chunkkv", score={"chunk": 5})),
        16,
        "prefill",
        DecodeSettings(1),
        trace=True,
    )
    for layer in g.trace[0]:
        assert layer.shape[-1] == 16 and all(torch.equal(head, layer[0]) for head in layer)


def test_bad_options_are_refused_and_stages_follow_the_base() -> None:
    with pytest.raises(ValueError, match="chunkkv chunk=0 must be at least 1 token"):
        build_policy(tiny_policy_cfg("chunkkv", score={"chunk": 0}))
    with pytest.raises(ValueError, match="keeps one set per layer"):
        build_policy(tiny_policy_cfg("chunkkv", allocation={"kind": "adaptive"}))
    with pytest.raises(ValueError, match="unknown score 'nope'"):
        build_policy({"name": "c", "score": {"kind": "chunkkv", "base": "nope"}})
    free = build_policy({"name": "c", "score": {"kind": "chunkkv", "base": "key_norm"}})
    assert free.unsupported_stages == ()


def kvpress_snapkv(attention: np.ndarray, window: int, kernel: int) -> np.ndarray:
    """kvpress's SnapKVPress scores from the window's attention [heads, window, n] (one query head per KV head):
    the prefix's mean over the window's queries, avg-pooled (zero padding counted), the window's entries at the
    best prefix score over every head plus 1."""
    mean = attention[:, :, :-window].mean(axis=1)
    padded = np.pad(mean, ((0, 0), (kernel // 2, kernel // 2)))
    pooled = np.stack([padded[:, i : i + mean.shape[1]] for i in range(kernel)]).mean(axis=0)
    return np.concatenate([pooled, np.full((len(mean), window), pooled.max() + 1.0)], axis=1)


KVPRESS_CHUNKS = {
    "kind": "chunkkv",
    "chunk": 5,
    "whole_chunks": True,
    "base": {"kind": "snapkv", "window": 6, "kernel_size": 3, "shared": True, "window_score": "top"},
}


@pytest.mark.parametrize("budget", [4, 10, 23, 33, 40])
@pytest.mark.parametrize("seed", range(3))
def test_whole_chunks_over_kvpress_snapkv_keep_kvpress_chunks(budget: int, seed: int) -> None:
    """chunkkv_kvpress's rule (whole chunks, SnapKV's window scored as kvpress's) against NumPy of
    ChunkKVPress(SnapKVPress()): 47 entries in 9 chunks of 5 and one of 2, kvpress's max(1, ⌊10 × (1 - ratio)⌋)
    chunks by the mean over the chunk of the scores summed over heads, at the ratio whose kept share is kvbench's
    budget (47 × (1 - ratio) whole: kvbench's ⌊chunks × budget / n⌋ is then kvpress's count)."""
    ratio = 1 - budget / 47
    heads, n, window = 3, 47, 6
    g = torch.Generator().manual_seed(seed)
    attention = torch.rand(heads, window, n, generator=g) ** 4  # peaked, so the chunks' means differ
    count = (n - torch.arange(n, dtype=torch.float32)).expand(heads, n)
    view = TokenState(positions=torch.arange(n).expand(heads, n), stats={"qlog": attention, "count": count})
    policy = build_policy(
        {"name": "c", "score": KVPRESS_CHUNKS, "allocation": {"kind": "threshold", "threshold": 0, "window": 0}}
    )
    scores = kvpress_snapkv(attention.double().numpy(), window, 3).sum(axis=0)
    expected = kvpress_kept(scores, 5, max(1, int(10 * (1 - ratio))))
    assert len(expected) <= budget
    assert kept(policy, view, budget) == [expected] * heads


def test_kvpress_window_score_is_the_best_prefix_score_plus_one_query() -> None:
    heads, n, window = 2, 20, 4
    attention = torch.rand(heads, window, n, generator=torch.Generator().manual_seed(5))
    count = (n - torch.arange(n, dtype=torch.float32)).expand(heads, n)
    view = TokenState(positions=torch.arange(n).expand(heads, n), stats={"qlog": attention, "count": count})
    got = SnapKV(window=window, kernel_size=3, window_score="top")(view).double().numpy() / window
    np.testing.assert_allclose(got, kvpress_snapkv(attention.double().numpy(), window, 3), rtol=1e-6)
    with pytest.raises(ValueError, match="window_score"):
        SnapKV(window_score="max")


def test_the_kvpress_config_keeps_whole_chunks_through_the_engine(tiny, random_ids) -> None:
    policy = build_policy(tiny_policy_cfg("chunkkv_kvpress", score={"chunk": 5, "base": {"window": 4}}))
    g = generate(tiny.model, None, random_ids(47, seed=3), policy, 23, "prefill", DecodeSettings(1), trace=True)
    for layer in g.trace[0]:
        chunks = set((layer[0] // 5).tolist())
        assert all(torch.equal(head, layer[0]) for head in layer)
        assert len(chunks) == 4 and len(layer[0]) == sum(min(5, 47 - 5 * c) for c in chunks)  # ⌊10 × 23 / 47⌋
