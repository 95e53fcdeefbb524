"""KeyDiff against NumPy from the paper's rule (minus the cosine of each key to the mean unit key), on hand rows
(padded ones too) and, block-wise, through the engine's chunked prefill: after every chunk the cache holds the
budget's most distinctive keys of what it held plus the chunk, as the paper's block-wise run and kvpress's
BlockPress compute it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import tiny_policy_cfg
from engine_run import generate
from layer_zero import LayerZero

from kvbench.engine.engine import DecodeSettings
from kvbench.policies.policy import Policy
from kvbench.policies.registry import build_policy
from kvbench.policies.scopes.everything import All
from kvbench.policies.scores.keydiff import KeyDiff
from kvbench.policies.state import TokenState


def numpy_keydiff(keys: np.ndarray) -> np.ndarray:
    """The paper's score of one row's keys [m, D]: -cos(k_i, mean_j k_j / |k_j|)."""
    norms = np.linalg.norm(keys, axis=-1)
    anchor = (keys / norms[:, None]).mean(axis=0)
    return -(keys @ anchor) / (norms * np.linalg.norm(anchor))


def top(scores: np.ndarray, k: int) -> set[int]:
    return set(np.argsort(-scores, kind="stable")[:k].tolist())


@pytest.mark.parametrize("lengths", [[7, 7, 7], [7, 3, 5]], ids=["uniform", "padded"])
def test_keydiff_equals_numpy_on_hand_rows(lengths: list[int]) -> None:
    g = torch.Generator().manual_seed(3)
    rows, n = len(lengths), max(lengths)
    valid = torch.arange(n) < torch.tensor(lengths).unsqueeze(1)
    keys = torch.randn(rows, n, 6, generator=g).masked_fill(~valid.unsqueeze(-1), 7.0)  # garbage padding
    held = [keys[r, :m].double().numpy() for r, m in enumerate(lengths)]
    sums = torch.tensor(np.stack([(k / np.linalg.norm(k, axis=-1, keepdims=True)).sum(0) for k in held]))
    view = TokenState(
        keys=keys,
        values=keys.clone(),
        positions=torch.arange(n).expand(rows, n).masked_fill(~valid, 0),
        valid=None if len(set(lengths)) == 1 else valid,
        row_sums={"key_direction": sums},
    )
    scores = KeyDiff()(view)
    for r, k in enumerate(held):
        np.testing.assert_allclose(scores[r, : len(k)].double().numpy(), numpy_keydiff(k), rtol=1e-5, atol=1e-6)
    keep = Policy("keydiff", KeyDiff(), All()).keep_mask(view, 3)
    for r, k in enumerate(held):
        assert set(keep[r].nonzero().flatten().tolist()) == top(numpy_keydiff(k), min(3, len(k)))


def test_the_config_is_kvpress_keydiff_in_every_stage() -> None:
    policy = build_policy(tiny_policy_cfg("keydiff"))
    assert isinstance(policy.score, KeyDiff) and isinstance(policy.scope, All)
    assert policy.unsupported_stages == ()


class Recorded(KeyDiff):
    def __init__(self, layer_zero: LayerZero):
        self.layer_zero = layer_zero

    def __call__(self, state: TokenState) -> torch.Tensor:
        self.layer_zero.record(state)
        return super().__call__(state)


def blockwise(keys: np.ndarray, budget: int, block: int, start: int) -> list[set[int]]:
    """The paper's block-wise eviction on one head: blocks of ``block`` tokens from ``start`` (the first ``start``
    tokens come in at once), the cache evicted back to ``budget`` after each block. What it holds after each."""
    held: list[int] = list(range(start))
    after = []
    for i in range(start, len(keys), block):
        held += range(i, min(i + block, len(keys)))
        if len(held) > budget:
            held = sorted(np.array(held)[sorted(top(numpy_keydiff(keys[held]), budget))].tolist())
        after.append(set(held))
    return after


@pytest.mark.parametrize("budget", [12, 16], ids=["budget-not-a-multiple", "budget-a-multiple"])
def test_stride_is_the_papers_blockwise_keydiff(tiny, random_ids, budget) -> None:
    """With ``stride`` = the block size, every prompt chunk ends with the cache evicted to the budget: layer 0
    (whose keys depend on no other token) holds what NumPy's block-wise run holds, chunk by chunk. kvpress's
    BlockPress starts its blocks after the first ``budget`` tokens: where the budget is a multiple of the block
    size the blocks are the same, and so is what it keeps."""
    n, block = 40, 8
    heads = tiny.model.config.num_key_value_heads
    layer_zero = LayerZero(heads)
    policy = Policy("keydiff", Recorded(layer_zero), All())
    ids = random_ids(n, seed=2)
    g = generate(tiny.model, None, ids, policy, budget, "prefill", DecodeSettings(1), stride=block, trace=True)
    for head in range(heads):
        keys = layer_zero.keys(head, n)
        expected = blockwise(keys, budget, block, 0)
        assert [set(t[0][head].tolist()) for t in g.trace[: len(expected)]] == expected
        if budget % block == 0:
            assert blockwise(keys, budget, block, budget)[-1] == expected[-1]
