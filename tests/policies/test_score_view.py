"""What a score sees: dense rows, padding it need not handle, and the running per-row sums the cache keeps.

KeyDiff (evict the keys most like the row's mean normalised key) is written here as a new score would be, in a
few lines and with no knowledge of the cache's layout, and checked against NumPy from the formula: on a hand
view whose padding holds garbage, and through the engine at every eviction, with uniform and per-head (padded)
rows, chunked prompts, decode steps and merging.
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from engine_run import generate, generate_batch

from kvbench.engine.engine import DecodeSettings, Request
from kvbench.policies.allocations.adaptive import Adaptive
from kvbench.policies.base import Allocation, Score
from kvbench.policies.policy import Policy
from kvbench.policies.running import RowSum
from kvbench.policies.scopes.everything import All
from kvbench.policies.state import TokenState


class KeyDiff(Score):
    """KeyDiff: a key unlike the row's mean normalised key is distinctive; the score is minus the cosine to it."""

    row_sums = (RowSum("key_direction", lambda keys, values: F.normalize(keys.float(), dim=-1)),)

    def __call__(self, view: TokenState) -> torch.Tensor:
        mean = view.row_sums["key_direction"] / view.lengths().unsqueeze(1)
        return -F.cosine_similarity(view.keys.float(), mean.unsqueeze(1), dim=-1)


def test_keydiff_is_a_short_score() -> None:
    assert len(inspect.getsource(KeyDiff).splitlines()) <= 30


def numpy_keydiff(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The formula on one row's held keys [m, D]: minus the cosine of each key to the mean unit key; and the sum
    of the unit keys (the row sum the cache keeps)."""
    unit = keys / np.linalg.norm(keys, axis=-1, keepdims=True)
    mean = unit.mean(axis=0)
    return -(unit @ mean) / np.linalg.norm(mean), unit.sum(axis=0)


def padded_view(lengths: list[int], dim: int = 4, seed: int = 0) -> tuple[TokenState, list[np.ndarray]]:
    """Rows holding ``lengths`` entries, padded to the longest with garbage keys and values (never zero)."""
    g = torch.Generator().manual_seed(seed)
    rows, n = len(lengths), max(lengths)
    valid = torch.arange(n) < torch.tensor(lengths).unsqueeze(1)
    keys = torch.randn(rows, n, dim, generator=g).masked_fill(~valid.unsqueeze(-1), 1e3)
    held = [keys[r, :m].double().numpy() for r, m in enumerate(lengths)]
    sums = torch.tensor(np.stack([numpy_keydiff(k)[1] for k in held]), dtype=torch.float32)
    positions = torch.arange(n).expand(rows, n).masked_fill(~valid, 0)
    view = TokenState(
        keys=keys, values=keys.clone(), positions=positions, valid=valid, row_sums={"key_direction": sums}
    )
    return view, held


def test_the_view_zeroes_padding_and_leaves_it_out_of_sums_and_means() -> None:
    view, held = padded_view([5, 2, 7])
    assert bool((view.keys[~view.valid_mask()] == 0).all()) and bool((view.values[~view.valid_mask()] == 0).all())
    for r, keys in enumerate(held):
        np.testing.assert_allclose(view.sum(view.keys)[r].double().numpy(), keys.sum(0), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(view.mean(view.keys)[r].double().numpy(), keys.mean(0), rtol=1e-5, atol=1e-5)
    assert view.mean(view.positions.float()).tolist() == [2.0, 0.5, 3.0]
    assert view.per_unit(view.positions).shape == (1, 3, 7)


@pytest.mark.parametrize("lengths", [[6, 6, 6], [6, 3, 5]], ids=["uniform", "padded"])
def test_keydiff_on_a_hand_view_equals_numpy(lengths: list[int]) -> None:
    view, held = padded_view(lengths, seed=len(set(lengths)))
    scores = KeyDiff()(view)
    for r, keys in enumerate(held):
        np.testing.assert_allclose(scores[r, : len(keys)].double().numpy(), numpy_keydiff(keys)[0], atol=1e-5)
    budget = 3
    keep = Policy("keydiff", KeyDiff(), All()).keep_mask(view, budget)
    for r, keys in enumerate(held):
        best = np.argsort(-numpy_keydiff(keys)[0], kind="stable")[: min(budget, len(keys))]
        assert sorted(keep[r].nonzero().flatten().tolist()) == sorted(best.tolist())
    assert not bool((keep & ~view.valid_mask()).any()), "padding is never kept"


class Checked(KeyDiff):
    """KeyDiff, each call checked against NumPy on the rows' held keys (and the rows' sums against a fresh sum)."""

    def __init__(self) -> None:
        self.calls = self.padded = 0

    def __call__(self, view: TokenState) -> torch.Tensor:
        scores = super().__call__(view)
        self.calls += 1
        self.padded += int(view.valid is not None and not bool(view.valid.all()))
        for r, m in enumerate(view.lengths().tolist()):
            expected, row_sum = numpy_keydiff(view.keys[r, :m].double().numpy())
            np.testing.assert_allclose(scores[r, :m].double().numpy(), expected, rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(view.row_sums["key_direction"][r].double().numpy(), row_sum, atol=1e-4)
        return scores


@pytest.mark.parametrize(
    "allocation,merge",
    [(Allocation(), False), (Adaptive(floor=0.0), False), (Allocation(), True)],
    ids=["uniform", "per-head", "merging"],
)
def test_keydiff_through_the_engine_equals_numpy_at_every_eviction(tiny, random_ids, allocation, merge) -> None:
    """A chunked prompt that evicts, then decode steps that each evict: the cache's running sums follow every
    write, eviction and merge, and the score sees each row's held keys alone."""
    score = Checked()
    policy = Policy("keydiff", score, All(), allocation=allocation, merge=merge)
    g = generate(
        tiny.model, None, random_ids(40, seed=5), policy, 12, "both", DecodeSettings(max_new_tokens=10), stride=8
    )
    assert len(g.tokens) == 10
    assert score.calls >= 10
    assert score.padded > 0 if allocation.per_head else score.padded == 0


def test_running_sums_follow_sequences_into_a_batch(tiny, random_ids) -> None:
    """Prompts prefilled alone and copied into a batch's slots, then decoded together: each slot's sums are its own."""
    score = Checked()
    policy = Policy("keydiff", score, All(), allocation=Adaptive(floor=0.0))
    settings = DecodeSettings(max_new_tokens=6)
    requests = [Request(random_ids(30 + 7 * i, seed=i), settings=settings) for i in range(3)]
    runs = generate_batch(tiny.model, None, requests, policy, 12, "both", batch_size=2, stride=8)
    assert [len(g.tokens) for g in runs] == [6, 6, 6] and score.padded > 0
