"""The decode schedule (``policy.interval=k``): a decode step evicts every k-th step of its sequence, down to the
budget; in between the rows grow by one entry a step, and the row reports the most it held."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_policy_cfg
from engine_run import generate, generate_batch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kvbench.engine.engine import DecodeSettings, Request
from kvbench.policies.policy import Policy
from kvbench.policies.registry import build_policy
from kvbench.policies.scopes.everything import All
from kvbench.policies.scores.recency import Recency
from kvbench.policies.scores.snapkv import SnapKV
from kvbench.policies.scores.value_aware import ValueAware
from kvbench.policies.state import TokenState

NEW = 16


def held_per_head(held: torch.Tensor) -> torch.Tensor:
    """Entries each KV head holds, from a trace's [heads, longest row] (a shorter row repeats its last position)."""
    return (held[:, 1:] != held[:, :-1]).sum(dim=1) + 1


def policy(name: str, interval: int) -> Policy:
    return build_policy(tiny_policy_cfg(name, interval=interval))


@pytest.mark.parametrize("name", ["window", "h2o", "adakv"])
@pytest.mark.parametrize("interval", [1, 3, 5])
def test_rows_hold_the_budget_after_each_eviction_and_grow_by_one_a_step_in_between(tiny, random_ids, name, interval):
    ids = random_ids(40, seed=11)
    g = generate(
        tiny.model, None, ids, policy(name, interval), 10, "both", DecodeSettings(max_new_tokens=NEW), trace=True
    )
    prefill, *decode = g.trace
    assert len(decode) == NEW - 1
    for layer in prefill:
        assert held_per_head(layer).sum() == 10 * layer.shape[0]
    for step, layers in enumerate(decode, start=1):
        expected = 10 + step % interval  # exactly the budget right after an eviction (every interval-th step)
        for layer in layers:
            counts = held_per_head(layer)
            assert counts.sum() == expected * layer.shape[0], (name, interval, step)
            if name != "adakv":  # Ada-KV splits a layer's budget across its heads; the others hold it per head
                assert torch.all(counts == expected)
            assert torch.all(layer[:, -1] == 39 + step)  # the newest token (fed at 40 + step - 1) is always held
    assert g.measures.budget_tokens == 10
    assert g.measures.peak_kept_tokens == 10 + interval - 1
    assert g.measures.kept_tokens == 10 + (NEW - 1) % interval


def test_each_sequence_of_a_batch_keeps_its_own_schedule(tiny, random_ids):
    """Sequences join the batch at different steps; each evicts every k-th of its own decode steps, as alone."""
    requests = [
        Request(random_ids(30 + 7 * i, seed=20 + i), settings=DecodeSettings(max_new_tokens=9 + i)) for i in range(3)
    ]
    alone = [
        generate_batch(tiny.model, None, [r], policy("h2o", 4), 8, "both", return_logits=True)[0] for r in requests
    ]
    batched = generate_batch(tiny.model, None, requests, policy("h2o", 4), 8, "both", 2, return_logits=True, trace=True)
    for one, together in zip(alone, batched):
        assert one.tokens == together.tokens
        torch.testing.assert_close(one.logits, together.logits, rtol=1e-4, atol=1e-4)
        for step, layers in enumerate(together.trace[1:], start=1):
            assert all(held_per_head(layer).max() == 8 + step % 4 for layer in layers)


def test_stage_decode_first_evicts_at_the_intervals_step(tiny, random_ids):
    """stage=decode holds the whole prompt until its first evicting step, the interval-th."""
    ids = random_ids(30, seed=12)
    g = generate(
        tiny.model, None, ids, policy("window", 4), 12, "decode", DecodeSettings(max_new_tokens=NEW), trace=True
    )
    held = [int(held_per_head(layers[0]).max()) for layers in g.trace]
    assert held[:4] == [30, 31, 32, 33]
    assert held[4:] == [12 + step % 4 for step in range(4, NEW)]
    assert g.measures.peak_kept_tokens == 33


def test_interval_one_is_every_step_and_a_budget_of_the_length_changes_nothing(tiny, random_ids):
    ids = random_ids(24, seed=13)
    settings = DecodeSettings(max_new_tokens=NEW)
    default = generate(
        tiny.model, None, ids, build_policy(tiny_policy_cfg("h2o")), 0.5, "both", settings, return_logits=True
    )
    every = generate(tiny.model, None, ids, policy("h2o", 1), 0.5, "both", settings, return_logits=True)
    assert default.tokens == every.tokens and torch.equal(default.logits, every.logits)
    assert default.measures.peak_kept_tokens == 12
    full = generate(tiny.model, None, ids, build_policy({"name": "full"}), 1.0, "both", settings, return_logits=True)
    for interval in (2, 7):
        g = generate(tiny.model, None, ids, policy("h2o", interval), 24 + NEW, "both", settings, return_logits=True)
        assert g.tokens == full.tokens
        torch.testing.assert_close(g.logits, full.logits, rtol=1e-5, atol=1e-5)
    # The schedule has teeth: at a small budget evicting every third step gives other logits than every step.
    third = generate(tiny.model, None, ids, policy("h2o", 3), 0.5, "both", settings, return_logits=True)
    assert (third.logits - every.logits).abs().max() > 1e-3


@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_an_interval_below_one_is_refused(bad):
    with pytest.raises(ValueError, match="interval=.* must be a positive integer"):
        Policy("window", Recency(), All(), interval=bad)


class LogChecked(SnapKV):
    """SnapKV whose every decode eviction checks the query log it reads against the family's own attention: for
    layer 0's rows, the summed rows of the last ``window`` queries over the held entries, each query's softmax (mean
    over its group's heads) taken over the entries held at or before its position (no eviction since: the
    interval outlasts the window)."""

    def __init__(self, window: int, queries: list[torch.Tensor], heads: int) -> None:
        super().__init__(window=window, kernel_size=1)
        self.recorded, self.heads, self.checked = queries, heads, 0

    def __call__(self, state: TokenState) -> torch.Tensor:
        if state.phase == "decode":
            every = torch.cat(self.recorded, dim=2)[0]  # [Hq, positions fed, D], rotated as the model attends
            fed = every.shape[1]
            group = every.shape[0] // self.heads
            for r, key in enumerate(state.row_keys.flatten().tolist()):
                if key >= self.heads:  # layer 0 only: its queries are the ones recorded
                    continue
                held = state.valid_mask()[r]
                keys, positions = state.keys[r, held].double(), state.positions[r, held]
                expected = torch.zeros(len(positions), dtype=torch.float64)
                for t in range(fed - self.window, fed):
                    seen = positions <= t
                    q = every[key * group : (key + 1) * group, t].double()  # the group's query heads
                    probs = torch.softmax(q @ keys[seen].T / q.shape[-1] ** 0.5, dim=-1).mean(dim=0)
                    expected[seen] += probs
                got = state.stats["qlog"][r].sum(dim=0)[held].double()
                torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
            self.checked += 1
        return super().__call__(state)


@pytest.mark.parametrize("interval", [9, 13])
def test_the_query_log_before_a_scheduled_eviction_is_the_last_window_of_queries(tiny, random_ids, interval):
    """A decode step logs its queries only within the log's length before its eviction (docs/perf/methods.md):
    the log read at each eviction still holds the last ``window`` queries' attention, checked against queries
    taken from the model's own layer-0 attention (its projection and rotary embedding)."""
    attention = tiny.model.model.layers[0].self_attn
    queries: list[torch.Tensor] = []

    def record(module, args, kwargs) -> None:
        hidden, (cos, sin) = kwargs["hidden_states"], kwargs["position_embeddings"]
        q = module.q_proj(hidden).view(*hidden.shape[:2], -1, module.head_dim).transpose(1, 2)
        queries.append(apply_rotary_pos_emb(q, q, cos, sin)[0].detach())

    window, heads = 4, tiny.model.config.num_key_value_heads
    policy = build_policy(tiny_policy_cfg("snapkv", interval=interval, score={"window": window}))
    score = LogChecked(window, queries, heads)
    policy.score = score
    hook = attention.register_forward_pre_hook(record, with_kwargs=True)
    try:
        g = generate(
            tiny.model,
            None,
            random_ids(24, seed=5),
            policy,
            10,
            "both",
            DecodeSettings(max_new_tokens=2 * interval + 2),
            stride=8,
            fused=False,
        )
    finally:
        hook.remove()
    assert len(g.tokens) == 2 * interval + 2 and score.checked == 2  # both scheduled decode evictions checked


class FeaturesChecked(ValueAware):
    """VATP whose every eviction checks each held entry's value norm (a feature written when the entry is, or
    deferred to a step that prepares an eviction) against the L1 norm of the value the row holds."""

    def __init__(self) -> None:
        super().__init__(base="accumulated", p=1.0)
        self.checked = 0

    def __call__(self, state: TokenState) -> torch.Tensor:
        held = state.valid_mask()
        expected = state.values.double().abs().sum(dim=-1)
        torch.testing.assert_close(state.stats["value_norm"].double()[held], expected[held], rtol=1e-5, atol=1e-6)
        self.checked += 1
        return super().__call__(state)


@pytest.mark.parametrize("batch_size", [1, 2])
def test_features_deferred_between_scheduled_evictions_are_those_of_the_held_values(tiny, random_ids, batch_size):
    """Between scheduled evictions a decode step leaves its entries' features to the next step that prepares one;
    each eviction still reads every held entry's own value norm, also after a finished sequence's lane is taken
    by another (lanes of several schedules in one batch)."""
    policy = build_policy(tiny_policy_cfg("vatp", interval=7))
    score = FeaturesChecked()
    policy.score = score
    requests = [
        Request(random_ids(20 + 3 * i, seed=i), settings=DecodeSettings(max_new_tokens=new))
        for i, new in enumerate([9, 23, 16])
    ]
    out = generate_batch(tiny.model, None, requests, policy, 12, "both", batch_size=batch_size, stride=8)
    assert [len(g.tokens) for g in out] == [9, 23, 16]
    assert score.checked >= 6  # the prompts' evictions and the decode schedule's
