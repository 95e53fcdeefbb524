"""A policy per phase (``policy.prefill`` / ``policy.decode``, kvbench.policies.phased): the prompt is compressed
by one named policy's rule, the decode evicts by another's, over one cache that keeps what both read."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_policy_cfg
from engine_run import generate

from kvbench.engine.engine import DecodeSettings
from kvbench.policies.policy import Policy
from kvbench.policies.registry import build_policy

pytestmark = pytest.mark.usefixtures("one_thread")
NEW = 10


def phased(prefill: str | None, decode: str | None, run: str, **extra) -> Policy:
    """Policy ``run`` with ``prefill`` and ``decode`` (named policies' configs, None: the run's own)."""
    cfg = tiny_policy_cfg(run, **extra)
    cfg["prefill"] = tiny_policy_cfg(prefill) if prefill else None
    cfg["decode"] = tiny_policy_cfg(decode) if decode else None
    return build_policy(cfg)


def run(tiny, ids, policy, budget, stage="both", stride=None):
    settings = DecodeSettings(max_new_tokens=NEW)
    return generate(
        tiny.model, None, ids, policy, budget, stage, settings, stride=stride, return_logits=True, trace=True
    )


@pytest.mark.parametrize("name", ["h2o", "tova", "vatp", "scissorhands", "roco"])
def test_a_policy_named_for_both_phases_is_the_policy_itself(tiny, random_ids, name):
    ids = random_ids(40, seed=30)
    for stride in (None, 8):
        alone = run(tiny, ids, build_policy(tiny_policy_cfg(name)), 12, stride=stride)
        both = run(tiny, ids, phased(name, name, name), 12, stride=stride)
        assert alone.tokens == both.tokens and torch.equal(alone.logits, both.logits), (name, stride)
        for a, b in zip(alone.trace, both.trace):
            assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_window_while_decoding_after_snapkv_drops_the_oldest_held_entry_each_step(tiny, random_ids):
    """By hand: the prompt keeps SnapKV's set, then each decode step adds its token and drops the oldest held."""
    ids = random_ids(40, seed=31)
    snapkv = run(tiny, ids, build_policy(tiny_policy_cfg("snapkv")), 12, stage="prefill")
    g = run(tiny, ids, phased(None, "window", "snapkv"), 12)
    for alone, ours in zip(snapkv.trace[0], g.trace[0]):
        assert torch.equal(alone, ours)
    assert any(not torch.equal(held, torch.arange(28, 40).expand_as(held)) for held in g.trace[0])  # not a window
    for step, (before, after) in enumerate(zip(g.trace, g.trace[1:]), start=1):
        for held, now in zip(before, after):
            newest = torch.full((held.shape[0], 1), 39 + step)
            assert torch.equal(now, torch.cat([held[:, 1:], newest], dim=1)), step


def test_the_cache_keeps_what_either_phase_reads():
    policy = phased(None, "h2o", "snapkv")
    assert {"qlog", "count", "acc"} <= policy.needs and policy.history == 6
    assert policy.scope.min_budget() == max(
        build_policy(tiny_policy_cfg(n)).scope.min_budget() for n in ("snapkv", "h2o")
    )
    assert policy.unsupported_stages == ("prefill", "decode")
    with_schedule = phased("snapkv", "h2o", "full", interval=4, quantize="int8")
    assert with_schedule.interval == 4 and with_schedule.quantize is not None and with_schedule.evicts


@pytest.mark.parametrize(
    "prefill, decode, policy, message",
    [
        (None, "snapkv", "h2o", "policy.decode=snapkv cannot evict in the decode phase: SnapKV scores the prompt"),
        ("h2o", "full", "h2o", "policy.decode=full never evicts"),
        (None, "h2o", "full", r"policy=full \(policy.prefill is not set\) never evicts"),
        ("adakv", None, "h2o", "policy.prefill=adakv splits the budget by allocation"),
        ("snapkv", None, "scissorhands", "keep different query logs"),
    ],
)
def test_a_phase_policy_that_cannot_run_there_is_refused(prefill, decode, policy, message):
    with pytest.raises(ValueError, match=message):
        phased(prefill, decode, policy)


def test_a_phase_given_by_name_is_refused_here():
    with pytest.raises(ValueError, match="names a policy config"):
        build_policy({**tiny_policy_cfg("h2o"), "decode": "window"})


@pytest.mark.parametrize("name", ["cap", "leverage", "compactor"])
def test_a_prompt_score_reading_rope_compresses_the_prompt_under_a_decode_policy(tiny, random_ids, name):
    """The prompt is compressed exactly as the policy alone compresses it: the phased score declares that its
    prefill phase reads RoPE and the whole prompt, so the engine hands both over."""
    ids = random_ids(40, seed=32)
    policy, single = phased(name, "window", name), build_policy(tiny_policy_cfg(name))
    assert policy.rope and policy.whole_prompt == single.whole_prompt
    alone = run(tiny, ids, single, 12, stage="prefill")
    g = run(tiny, ids, policy, 12)
    for a, b in zip(alone.trace[0], g.trace[0]):
        assert torch.equal(a, b)
