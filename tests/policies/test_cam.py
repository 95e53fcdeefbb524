"""CaM's merge against NumPy from the paper's rule: each evicted value v_e is added, as M_e · v_e / |T_e|, to the
kept entries T_e that follow it (at most ``merge_budget``), M_e ~ Bernoulli(clamp(A_e / mean(A over T_e), 0, 1));
one step by hand, random steps against loops, and every merge of a run through the cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import tiny_policy_cfg
from engine_run import generate

from kvbench.engine.engine import DecodeSettings
from kvbench.policies.cam import STREAM, CamMerge, merged_values
from kvbench.policies.registry import build_policy
from kvbench.policies.scores.uniform_random import uniform_hash
from kvbench.policies.state import TokenState


def numpy_cam(values, acc, keep, valid, draws, m) -> np.ndarray:
    """One merge step, entry by entry. values [H, n, D]; the others [H, n]."""
    out, acc = values.astype(np.float64), acc.astype(np.float64)
    for h in range(values.shape[0]):
        kept = [j for j in range(values.shape[1]) if keep[h, j] and valid[h, j]]
        for e in range(values.shape[1]):
            if keep[h, e] or not valid[h, e]:
                continue
            targets = [j for j in kept if j > e][:m]
            if not targets:
                continue
            mean = np.mean([acc[h, j] for j in targets])
            p = min(1.0, acc[h, e] / mean) if mean > 0 else float(acc[h, e] > 0)
            if draws[h, e] < p:
                for j in targets:
                    out[h, j] += values[h, e].astype(np.float64) / len(targets)
    return out


def test_one_merge_step_by_hand() -> None:
    # One row, 5 entries, keep 0, 2, 4; merge budget 2. Entry 1 (A 0.2) -> targets 2, 4 (A 0.3, 0.1: mean 0.2):
    # p = 1, merged, each gains v1 / 2. Entry 3 (A 0.05) -> target 4 alone (A 0.1): p = 0.5, drawn 0.7: not merged.
    values = torch.tensor([[[1.0], [4.0], [2.0], [8.0], [3.0]]])
    acc = torch.tensor([[0.5, 0.2, 0.3, 0.05, 0.1]])
    keep = torch.tensor([[True, False, True, False, True]])
    draws = torch.tensor([[0.0, 0.99, 0.0, 0.7, 0.0]])
    out = merged_values(values, acc, keep, torch.ones_like(keep), draws, 2)
    assert out[0, :, 0].tolist() == [1.0, 4.0, 4.0, 8.0, 5.0]
    draws[0, 3] = 0.4  # now entry 3 merges too: entry 4 gains all of v3
    out = merged_values(values, acc, keep, torch.ones_like(keep), draws, 2)
    assert out[0, :, 0].tolist() == [1.0, 4.0, 4.0, 8.0, 13.0]


@pytest.mark.parametrize("m", [1, 3, 50])
@pytest.mark.parametrize("padded", [False, True])
def test_merged_values_equal_numpy(m, padded) -> None:
    g = torch.Generator().manual_seed(m + 10 * padded)
    h, n, d = 3, 24, 5
    values = torch.randn(h, n, d, generator=g)
    acc = torch.rand(h, n, generator=g) * (torch.rand(h, n, generator=g) > 0.2)  # some entries saw no attention
    valid = torch.arange(n) < torch.tensor([24, 17, 20]).unsqueeze(1) if padded else torch.ones(h, n, dtype=torch.bool)
    keep = (torch.rand(h, n, generator=g) > 0.6) & valid
    draws = torch.rand(h, n, generator=g)
    got = merged_values(values, acc, keep, valid, draws, m)
    expected = numpy_cam(values.numpy(), acc.numpy(), keep.numpy(), valid.numpy(), draws.numpy(), m)
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-6, atol=1e-6)
    merged = (got - values).abs().amax(-1) > 1e-6
    assert bool(merged.any()) and not bool((merged & ~keep).any()), "only kept entries change, and some do"


class Checked(CamMerge):
    """CaM, each merge checked against NumPy on the state it gets, and each state's values against what the
    previous merges wrote back (by row and position)."""

    def __init__(self, merge_budget: int) -> None:
        super().__init__(merge_budget)
        self.calls = self.changed = 0
        self.written: dict[tuple[int, int], torch.Tensor] = {}

    def __call__(self, state: TokenState, keep: torch.Tensor):
        merged = super().__call__(state, keep)
        self.calls += 1
        valid = state.valid_mask()
        for r in range(state.heads):
            for i in valid[r].nonzero().flatten().tolist():
                key = (int(state.row_keys[r]), int(state.positions[r, i]))
                if key in self.written:
                    torch.testing.assert_close(state.values[r, i], self.written.pop(key))
        draws = uniform_hash(state.seed + STREAM, state.row_keys, state.positions, state.seen)
        args = (state.values, state.stats["acc"], keep, valid, draws)
        expected = numpy_cam(*(a.numpy() for a in args), self.merge_budget)
        np.testing.assert_allclose(merged.values.numpy(), expected, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(merged.keys, state.keys)
        self.changed += int(((merged.values - state.values).abs() > 1e-6).any())
        for r, i in (keep & valid).nonzero().tolist():
            self.written[(int(state.row_keys[r]), int(state.positions[r, i]))] = merged.values[r, i].clone()
        return merged


@pytest.mark.parametrize("stage", ["decode", "both"])
def test_every_merge_of_a_run_equals_numpy_and_is_written_back(tiny, random_ids, stage) -> None:
    policy = build_policy(tiny_policy_cfg("cam"))
    merge = Checked(merge_budget=3)
    policy.merge = merge
    ids = random_ids(30, seed=4)
    g = generate(tiny.model, None, ids, policy, 10, stage, DecodeSettings(max_new_tokens=8), stride=8, trace=True)
    assert merge.calls >= 8 and merge.changed > 0
    assert all(held.shape[-1] <= 10 for held in g.trace[-1])
    runs = {
        name: generate(
            tiny.model,
            None,
            ids,
            build_policy(tiny_policy_cfg(name)),
            10,
            stage,
            DecodeSettings(max_new_tokens=8),
            stride=8,
            forced_tokens=g.tokens,
            return_logits=True,
        )
        for name in ("cam", "h2o")  # one score and scope: the same entries kept, and only CaM merges
    }
    assert (runs["cam"].logits - runs["h2o"].logits).abs().max() > 1e-4, "merged values change the output"


def test_merge_settings_are_checked() -> None:
    assert isinstance(build_policy(tiny_policy_cfg("cam")).merge, CamMerge)
    for bad in ({"kind": "cam", "merge_budget": 0}, {"kind": "cam", "merge_budget": 2.5}):
        with pytest.raises(ValueError, match="merge_budget"):
            build_policy(tiny_policy_cfg("h2o", merge=bad))
    with pytest.raises(ValueError, match="must be true or false, or a merge kind"):
        build_policy(tiny_policy_cfg("h2o", merge="average"))
