"""A stacked cache (every layer's buffers slices of one set, evicted and folded at once) must give exactly what
evicting layer by layer gives: the same tokens, logits and kept positions at every step, for every policy it
serves."""
from __future__ import annotations

import pytest
import torch

from kvbench.engine import cache as cache_module
from kvbench.engine.cache import BudgetedCache, LayerPlan

from test_policies import CASES, named, run  # noqa: F401  (the tiny fixtures come from conftest)



def serves(policy) -> bool:
    """Whether a tiny run's cache (4 layers, ~15 tokens held) is stacked."""
    budgets = policy.layer_budgets(15, 4, 60) if policy.evicts else [None] * 4
    return cache_module.stackable([LayerPlan(b, 30) for b in budgets], policy)


STACKED_CASES = [(n, s) for n, s in CASES if serves(named(n))]
VARIANTS = {"roco int8 reindex": ("roco", {"quantize": "int8", "positions": "reindex"}),
            "tova fp8": ("tova", {"quantize": "fp8"}),
            "scissorhands int8": ("scissorhands", {"quantize": "int8"})}


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class Record:
    """Count the stacked evictions and folds the runs make."""

    def __init__(self, monkeypatch):
        self.calls = {"evict_layers": 0, "fold_staged": 0}
        for name in self.calls:
            original = getattr(cache_module.LayerStack, name)

            def counted(stack, layers, _original=original, _name=name):
                self.calls[_name] += 1
                return _original(stack, layers)

            monkeypatch.setattr(cache_module.LayerStack, name, counted)


def per_layer(tiny, ids, policy, stage, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(cache_module, "stackable", lambda plans, policy: False)
        return run(tiny, ids, policy, 0.3, stage, trace=True)


def assert_same(stacked, reference):
    assert stacked.tokens == reference.tokens
    assert torch.equal(stacked.logits, reference.logits)
    for a_step, r_step in zip(stacked.trace, reference.trace, strict=True):
        for a, r in zip(a_step, r_step, strict=True):
            assert torch.equal(a, r)


def test_the_policies_a_stack_serves():
    """Uniform allocation with one plan for every layer, no merging: PyramidKV (a budget per layer), Ada-KV
    (per-head counts) and merging stay layer by layer."""
    served = {n for n, _ in STACKED_CASES}
    assert {"window", "h2o", "roco", "tova", "scissorhands", "snapkv", "random", "streamingllm"} <= served
    assert not served & {"full", "pyramidkv", "adakv"}
    assert not serves(named("h2o", merge=True))
    assert not cache_module.stackable([LayerPlan(4, 8), LayerPlan(5, 8)], named("h2o"))
    assert not cache_module.stackable([LayerPlan(4, 8)], named("h2o"))


@pytest.mark.parametrize("name, stage", STACKED_CASES)
def test_stacked_eviction_equals_layer_by_layer(tiny, random_ids, monkeypatch, name, stage):
    ids = random_ids(48, seed=31)
    policy = named(name)
    record = Record(monkeypatch)
    stacked = run(tiny, ids, policy, 0.3, stage, trace=True)
    assert record.calls["evict_layers"] > 0
    if policy.needs_attention and stage != "prefill":  # decode steps that collect statistics stage their rows
        assert record.calls["fold_staged"] > 0
    assert_same(stacked, per_layer(tiny, ids, policy, stage, monkeypatch))


@pytest.mark.parametrize("variant", VARIANTS)
def test_stacked_eviction_equals_layer_by_layer_quantised_and_reindexed(tiny, random_ids, monkeypatch, variant):
    name, extra = VARIANTS[variant]
    ids = random_ids(48, seed=32)
    policy = named(name, **extra)
    stacked = run(tiny, ids, policy, 0.3, "both", trace=True)
    assert_same(stacked, per_layer(tiny, ids, policy, "both", monkeypatch))


def test_compaction_in_blocks_equals_one_block(tiny, random_ids, monkeypatch):
    """The stack's compaction copies a few groups at a time; one group per block must change nothing."""
    ids = random_ids(48, seed=33)
    policy = named("scissorhands")
    whole = run(tiny, ids, policy, 0.3, "both", trace=True)
    monkeypatch.setattr(cache_module, "COMPACT_BLOCK_BYTES", 1)
    assert_same(run(tiny, ids, policy, 0.3, "both", trace=True), whole)


def feed(cache: BudgetedCache, heads: list[int], steps: int) -> list[list[torch.Tensor]]:
    """Feed every layer (layer l with heads[l] KV heads) a 6-token chunk then single tokens, with attention mass
    that favours odd positions and varies by layer; returns the kept positions after each step."""
    kept, fed = [], 0
    for step in range(steps):
        q = 6 if step == 0 else 1
        cache.begin_step(torch.arange(fed, fed + q), evicting=True, phase="prefill" if step == 0 else "decode")
        fed += q
        for l, h in enumerate(heads):
            layer = cache.layers[l]
            layer.update(torch.randn(1, h, q, 4), torch.randn(1, h, q, 4))
            n = layer.get_seq_length() + q
            positions = torch.arange(n, dtype=torch.float32)
            acc = ((positions % 2) + 0.1 * l + 0.01 * torch.arange(h).unsqueeze(1)).expand(h, n).contiguous()
            cache.after_attention(l, q, {"acc": acc})
        kept.append([p.clone() for p in cache.kept_positions()])
    return kept


def test_layers_of_different_shapes_fall_back_to_layer_by_layer(monkeypatch):
    """A layer whose shapes differ from the first layer's cannot share the stack: the cache gives it up in the
    first step, evicting the layers that have attended, and from then on every layer evicts itself."""
    heads = [2, 2, 3, 2]
    plans = [LayerPlan(budget=4, capacity=10)] * len(heads)
    policy = named("h2o")
    torch.manual_seed(0)
    cache = BudgetedCache(plans, policy)
    assert cache.stack is not None
    got = feed(cache, heads, 5)
    assert cache.stack is None
    monkeypatch.setattr(cache_module, "stackable", lambda plans, policy: False)
    torch.manual_seed(0)
    reference = feed(BudgetedCache(plans, policy), heads, 5)
    for a_step, r_step in zip(got, reference, strict=True):
        for a, r in zip(a_step, r_step, strict=True):
            assert torch.equal(a, r)
            assert a.shape[-1] == 4
