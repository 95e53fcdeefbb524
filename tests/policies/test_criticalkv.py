"""CriticalKV (Feng et al. 2025, arXiv:2502.03805) against NumPy from the paper's two stages and kvpress's
CriticalKVPress / CriticalAdaKVPress: a row's budget B, its ⌊ratio × B⌋ (at least one) best entries by the base
score, the rest of B by (base + ε) × ‖W_o v‖₁ (the value through each query head's columns of W_o, L1 norm,
averaged over the KV head's GQA group); under Ada-KV each head's B comes from the base score across heads."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from engine_run import generate

from kvbench.engine.engine import DecodeSettings
from kvbench.policies.allocations.adaptive import Adaptive
from kvbench.policies.base import Allocation
from kvbench.policies.policy import Policy
from kvbench.policies.registry import build_policy
from kvbench.policies.scopes.everything import All
from kvbench.policies.scopes.sinks_window import SinksWindow
from kvbench.policies.scores.critical import FEATURE, CriticalKV
from kvbench.policies.state import TokenState

EPS, RATIO = 1e-4, 0.5


def numpy_norm(values: np.ndarray, w_o: np.ndarray, head: int, group: int) -> np.ndarray:
    """‖W_o,j v‖₁ averaged over the query heads j of KV head ``head``: values [m, D], W_o [hidden, heads × D]."""
    d = values.shape[-1]
    cols = [w_o[:, j * d : (j + 1) * d] for j in range(head * group, (head + 1) * group)]
    return np.mean([np.abs(values @ c.T).sum(axis=-1) for c in cols], axis=0)


def top(scores: np.ndarray, k: int) -> set[int]:
    return set(np.argsort(-scores, kind="stable")[:k].tolist())


def two_stages(base: np.ndarray, norm: np.ndarray, budget: int, protected: set[int]) -> set[int]:
    """One row: the protected entries rank first in both stages (kvpress's SnapKV window at the top)."""
    first = min(max(1, math.floor(RATIO * budget)), budget)
    lifted = base.copy()
    lifted[list(protected)] = np.inf
    chosen = top(lifted, first)
    weighted = (base + EPS) * norm
    weighted[list(chosen | protected)] = np.inf
    return top(weighted, budget)


def adakv_budgets(bases: list[np.ndarray], budget: int, floor: float) -> list[int]:
    """Ada-KV's split of heads × budget: each head's ⌊floor × budget⌋ best first, the rest to the best left."""
    safe = math.floor(floor * budget)
    taken = [top(b, min(safe, len(b))) for b in bases]
    rest = [(s, h, i) for h, b in enumerate(bases) for i, s in enumerate(b) if i not in taken[h]]
    extra = sorted(rest, reverse=True)[: len(bases) * budget - sum(map(len, taken))]
    return [len(taken[h]) + sum(1 for _, hh, _ in extra if hh == h) for h in range(len(bases))]


def hand_view(lengths: list[int], group: int, seed: int) -> tuple[TokenState, np.ndarray, int]:
    """Rows of one layer (KV heads), padded with garbage; W_o [hidden, heads × D]; features as the cache writes
    them, one KV head at a time."""
    g = torch.Generator().manual_seed(seed)
    rows, n, d, hidden = len(lengths), max(lengths), 4, 6
    valid = torch.arange(n) < torch.tensor(lengths).unsqueeze(1)
    values = torch.randn(rows, n, d, generator=g)
    w_o = torch.randn(hidden, rows * group * d, generator=g)
    acc = torch.rand(rows, n, generator=g).masked_fill(~valid, 7.0)
    score = CriticalKV(base="accumulated", first_stage_ratio=RATIO, epsilon=EPS)
    per_kv_head = w_o.view(hidden, rows, -1)
    norm = torch.cat(
        [
            score.features(values[h : h + 1], values[h : h + 1], {"output_projection": per_kv_head[:, h]})[FEATURE]
            for h in range(rows)
        ]
    )
    positions = torch.arange(n).expand(rows, n)
    view = TokenState(
        keys=values,
        values=values,
        positions=positions,
        stats={"acc": acc, "projected_value_l1": norm},
        valid=None if len(set(lengths)) == 1 else valid,
    )
    return view, w_o.double().numpy(), group


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("budget", [1, 3, 6, 10])
def test_two_stages_on_a_hand_view_equal_numpy(group, budget) -> None:
    view, w_o, group = hand_view([16, 16, 16], group, seed=budget + group)
    policy = Policy("criticalkv", CriticalKV("accumulated", RATIO, EPS), SinksWindow(n_sink=1, window=0))
    keep = policy.keep_mask(view, budget)
    for h in range(view.heads):
        values = view.values[h].double().numpy()
        np.testing.assert_allclose(
            view.stats["projected_value_l1"][h].double().numpy(), numpy_norm(values, w_o, h, group), rtol=1e-5
        )
        expected = two_stages(view.stats["acc"][h].double().numpy(), numpy_norm(values, w_o, h, group), budget, {0})
        assert set(keep[h].nonzero().flatten().tolist()) == expected, h


def test_the_second_stage_changes_what_is_kept() -> None:
    """The test has teeth: the base score alone keeps another set than the two stages."""
    differ = 0
    for seed in range(8):
        view, w_o, group = hand_view([12, 12], 2, seed)
        two = Policy("c", CriticalKV("accumulated", RATIO, EPS), All()).keep_mask(view, 4)
        alone = Policy("a", build_policy({"name": "a", "score": "accumulated"}).score, All()).keep_mask(view, 4)
        differ += int(not torch.equal(two, alone))
    assert differ >= 4


@pytest.mark.parametrize("lengths", [[10, 10, 10], [10, 6, 8]], ids=["even", "padded"])
def test_adakv_budgets_come_from_the_base_score_and_the_stages_run_inside(lengths) -> None:
    floor, budget = 0.2, 4
    view, w_o, group = hand_view(lengths, 2, seed=len(set(lengths)))
    policy = Policy("c", CriticalKV("accumulated", RATIO, EPS), All(), allocation=Adaptive(floor=floor))
    keep = policy.keep_mask(view, budget)
    bases = [view.stats["acc"][h, :m].double().numpy() for h, m in enumerate(lengths)]
    budgets = adakv_budgets(bases, budget, floor)
    assert keep.sum(dim=1).tolist() == budgets and sum(budgets) == len(lengths) * budget
    assert len(set(budgets)) > 1, "the split is uneven, or the test proves nothing about it"
    for h, m in enumerate(lengths):
        norm = numpy_norm(view.values[h, :m].double().numpy(), w_o, h, group)
        assert set(keep[h].nonzero().flatten().tolist()) == two_stages(bases[h], norm, budgets[h], set()), h
    assert not bool((keep & ~view.valid_mask()).any())


def kvpress_critical_adakv(bases: list[np.ndarray], norms: list[np.ndarray], budget: int, alpha: float) -> list[set]:
    """kvpress's CriticalAdaKVPress, one layer of equal-length heads: each head's max(1, ⌊α × B⌋) best by the base
    score (the safeguard) lifted to the top; heads × B slots to the highest lifted scores across heads; each head's
    first stage its ⌊ratio × B_h⌋ best of the lifted scores (the safeguard stays lifted); its B_h kept by
    (base + ε) × norm with the lifted entries at the top."""
    safe = max(1, math.floor(alpha * budget))
    lifted = [b.copy() for b in bases]
    for row in lifted:
        row[list(top(row, safe))] = np.inf
    flat = np.concatenate(lifted)
    n = len(bases[0])
    chosen = np.argsort(-flat, kind="stable")[: len(bases) * budget]
    head_budgets = [int(np.sum(chosen // n == h)) for h in range(len(bases))]
    kept = []
    for row, base, norm, b in zip(lifted, bases, norms, head_budgets, strict=True):
        first = top(row, math.floor(RATIO * b)) | set(np.flatnonzero(np.isinf(row)).tolist())
        weighted = (base + EPS) * norm
        weighted[list(first)] = np.inf
        kept.append(top(weighted, b))
    return kept


def skewed_view(seed: int) -> tuple[TokenState, np.ndarray, int]:
    """Four heads whose base scores differ in scale: Ada-KV gives the low ones little more than their safeguard,
    where the first stage's ⌊ratio × B_h⌋ falls short of it."""
    view, w_o, group = hand_view([14, 14, 14, 14], 2, seed=100 + seed)
    view.stats["acc"] = view.stats["acc"] * torch.tensor([[0.05], [0.3], [1.0], [3.0]])
    return view, w_o, group


@pytest.mark.parametrize("seed", range(6))
def test_first_stage_min_holds_adakvs_safeguard_as_kvpress(seed) -> None:
    """``first_stage_min`` = the allocation's floor: the first stage keeps each head's safeguard, as kvpress's
    CriticalAdaKVPress (its safeguard is lifted above the first stage's ranking)."""
    floor, budget, lengths = 0.4, 8, [14, 14, 14, 14]
    view, w_o, group = skewed_view(seed)
    score = CriticalKV("accumulated", RATIO, EPS, first_stage_min=floor)
    keep = Policy("c", score, All(), allocation=Adaptive(floor=floor)).keep_mask(view, budget)
    bases = [view.stats["acc"][h].double().numpy() for h in range(len(lengths))]
    norms = [numpy_norm(view.values[h].double().numpy(), w_o, h, group) for h in range(len(lengths))]
    expected = kvpress_critical_adakv(bases, norms, budget, floor)
    assert [set(keep[h].nonzero().flatten().tolist()) for h in range(len(lengths))] == expected


def test_first_stage_min_changes_what_is_kept() -> None:
    """The test above has teeth: without the safeguard in the first stage some head keeps another set."""
    floor, budget, differ = 0.4, 8, 0
    for seed in range(6):
        view, _, _ = skewed_view(seed)
        kept = [
            Policy(
                "c", CriticalKV("accumulated", RATIO, EPS, first_stage_min=m), All(), allocation=Adaptive(floor)
            ).keep_mask(view, budget)
            for m in (0.0, floor)
        ]
        differ += int(not torch.equal(*kept))
    assert differ >= 2


class Checked(CriticalKV):
    """CriticalKV, each eviction checked against NumPy: the entries it makes the policy keep, per row, are the two
    stages' choice from the view's base statistic and the model's own W_o."""

    def __init__(self, model, per_head: bool, floor: float = 0.0) -> None:
        super().__init__("accumulated", RATIO, EPS)
        self.model, self.per_head, self.floor, self.calls = model, per_head, floor, 0

    def __call__(self, view: TokenState) -> torch.Tensor:
        scores = super().__call__(view)
        keep = view.kept_by(scores)
        cfg = self.model.config
        kv_heads = cfg.num_key_value_heads
        group = cfg.num_attention_heads // kv_heads
        lengths = view.lengths().tolist()
        bases = [view.stats["acc"][r, :m].double().numpy() for r, m in enumerate(lengths)]
        if self.per_head:
            budgets = []
            for unit in range(view.units):
                heads = range(unit * kv_heads, (unit + 1) * kv_heads)
                budgets += adakv_budgets([bases[r] for r in heads], view.budget, self.floor)
        else:
            budgets = [min(view.budget, m) for m in lengths]
        for r, key in enumerate(view.row_keys.flatten().tolist()):
            layer, head = divmod(key, kv_heads)
            w_o = self.model.model.layers[layer].self_attn.o_proj.weight.detach().double().numpy()
            norm = numpy_norm(view.values[r, : lengths[r]].double().numpy(), w_o, head, group)
            assert set(keep[r].nonzero().flatten().tolist()) == two_stages(bases[r], norm, budgets[r], set()), r
        self.calls += 1
        return scores


@pytest.mark.parametrize("per_head", [False, True], ids=["uniform", "ada-kv"])
def test_through_the_engine_every_eviction_keeps_the_numpy_choice(tiny, random_ids, per_head) -> None:
    score = Checked(tiny.model, per_head)
    allocation = Adaptive(floor=0.0) if per_head else Allocation()
    policy = Policy("criticalkv", score, All(), allocation=allocation)
    g = generate(
        tiny.model, None, random_ids(30, seed=3), policy, 10, "both", DecodeSettings(max_new_tokens=4), stride=8
    )
    assert len(g.tokens) == 4 and score.calls >= 6


def test_named_configs_and_refusals() -> None:
    from conftest import tiny_policy_cfg

    for name, per_head in (("criticalkv", False), ("criticalkv_adakv", True)):
        policy = build_policy(tiny_policy_cfg(name))
        assert policy.weights == {"output_projection"} and policy.unsupported_stages == ("decode",)
        assert policy.allocation.per_head is per_head and policy.history == 6
    with pytest.raises(ValueError, match="first_stage_ratio"):
        CriticalKV(first_stage_ratio=1.5)
    with pytest.raises(ValueError, match="another score"):
        CriticalKV(base="criticalkv")
    with pytest.raises(ValueError, match="epsilon"):
        CriticalKV(epsilon=-1.0)
    with pytest.raises(ValueError, match="first_stage_min"):
        CriticalKV(first_stage_min=2.0)
    decode_ready = build_policy({"name": "c", "score": {"kind": "criticalkv", "base": "accumulated"}})
    assert decode_ready.unsupported_stages == () and decode_ready.needs == {"acc"}


@pytest.mark.parametrize("family", ["llama", "gpt2", "gpt-neox", "gptj", "opt"])
def test_the_output_projection_is_the_one_the_family_applies(family) -> None:
    """Each family names (and GPT-2 transposes) W_o its own way: the weight read multiplies as the module does."""
    from family_models import build

    from kvbench.engine.score_inputs import layer_weights

    model = build(family)
    weights = layer_weights(model, frozenset({"output_projection"}), model.config.num_hidden_layers)
    names = ("o_proj", "dense", "out_proj", "c_proj")
    attentions = [m for m in model.modules() if isinstance(getattr(m, "layer_idx", None), int)]
    attentions = [m for m in attentions if any(hasattr(m, a) for a in names)]
    assert len(attentions) == model.config.num_hidden_layers
    for layer, module in enumerate(attentions):
        applied = next(getattr(module, a) for a in names if hasattr(module, a))
        w = weights[module.layer_idx]["output_projection"]
        x = torch.randn(3, w.shape[1])
        bias = applied(torch.zeros(1, w.shape[1]))
        torch.testing.assert_close(applied(x), x @ w.T + bias, rtol=1e-5, atol=1e-5, msg=f"{family} {layer}")
