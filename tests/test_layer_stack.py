"""A stacked cache (every layer's buffers slices of one set, evicted and folded at once) must give exactly what
evicting layer by layer gives: the same tokens, logits and kept positions at every step, for every policy it
serves."""
from __future__ import annotations

import pytest
import torch

from kvbench.engine import cache as cache_module
from kvbench.engine.cache import BudgetedCache, LayerPlan
from kvbench.engine.generate import DecodeSettings, generate
from kvbench.policies.registry import build_policy

from test_policies import CASES, NEW, named, policy_cfg, run  # noqa: F401  (the tiny fixtures come from conftest)


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


def pyramid(name: str, **extra):
    """A named policy's parts with PyramidKV's layer budgets."""
    cfg = policy_cfg(name, **extra)
    cfg["allocation"] = {"kind": "pyramid", "beta": 20}
    return build_policy(cfg)


# Layers of different budgets, each scored on its own row, under scopes that shield alike at every budget.
RAGGED = {"pyramidkv": lambda: named("pyramidkv"),
          "pyramidkv max pooling": lambda: named("pyramidkv", score={"pooling": "max"}),
          "pyramidkv, no window": lambda: named("pyramidkv", scope={"window": 0}),
          "pyramidkv int8 reindex": lambda: named("pyramidkv", quantize="int8", positions="reindex"),
          "h2o, a window of 2": lambda: pyramid("h2o", scope={"window": 2}),
          "scissorhands": lambda: pyramid("scissorhands"),
          "vatp, 2 sinks": lambda: pyramid("vatp", scope={"n_sink": 2, "window": 0}),
          "knorm": lambda: pyramid("knorm")}


class Record:
    """Count the stacked evictions and folds the runs make."""

    def __init__(self, monkeypatch):
        self.calls = {"evict_layers": 0, "fold_staged": 0, "evict_one_each": 0}
        for name in self.calls:
            original = getattr(cache_module.LayerStack, name)

            def counted(stack, layers, _original=original, _name=name):
                self.calls[_name] += 1
                return _original(stack, layers)

            monkeypatch.setattr(cache_module.LayerStack, name, counted)


def per_layer(tiny, ids, policy, stage, monkeypatch, stride: int | None = 8):
    with monkeypatch.context() as m:
        m.setattr(cache_module, "stackable", lambda plans, policy: False)
        return generate_with(tiny, ids, policy, stage, stride)


def generate_with(tiny, ids, policy, stage, stride):
    return generate(tiny.model, None, ids, policy, 0.3, stage, DecodeSettings(max_new_tokens=NEW), stride=stride,
                    return_logits=True, trace=True)


def assert_same(stacked, reference):
    assert stacked.tokens == reference.tokens
    assert torch.equal(stacked.logits, reference.logits)
    for a_step, r_step in zip(stacked.trace, reference.trace, strict=True):
        for a, r in zip(a_step, r_step, strict=True):
            assert torch.equal(a, r)


def test_the_policies_a_stack_serves():
    """Uniform allocation, no merging, and one plan for every layer or a budget per layer that every row can be
    ranked under on its own: Ada-KV (per-head counts), merging, random draws, TOVA's layer-wide mean and scopes
    that shield differently at different budgets stay layer by layer."""
    served = {n for n, _ in STACKED_CASES}
    assert {"window", "h2o", "roco", "tova", "scissorhands", "snapkv", "random", "streamingllm", "pyramidkv"} <= served
    assert not served & {"full", "adakv"}
    assert not serves(named("h2o", merge=True))
    assert all(serves(make()) for make in RAGGED.values())
    for name in ("random", "tova", "roco"):  # random draws, a layer-wide mean, a std-protected count ∝ budget
        assert not serves(pyramid(name))
    assert not cache_module.stackable([LayerPlan(4, 8), LayerPlan(6, 8)], named("h2o"))  # window: half the budget
    assert cache_module.stackable([LayerPlan(4, 8), LayerPlan(6, 8)], named("h2o", scope={"window": 2}))
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


@pytest.mark.parametrize("stride", [8, None], ids=["chunked: capacities differ", "one chunk: capacities equal"])
@pytest.mark.parametrize("stage", ["both", "decode"])
@pytest.mark.parametrize("variant", RAGGED)
def test_layers_of_different_budgets_evict_together_as_layer_by_layer(tiny, random_ids, monkeypatch, variant, stage,
                                                                       stride):
    """PyramidKV-style budgets: every decode step in which each layer evicts one entry per head is ranked in one
    padded batch; tokens, logits and every kept set must be those of evicting layer by layer."""
    policy = RAGGED[variant]()
    if stage in policy.unsupported_stages:
        pytest.skip(f"{variant} does not run in stage {stage}")
    ids = random_ids(48, seed=34)
    record = Record(monkeypatch)
    stacked = generate_with(tiny, ids, policy, stage, stride)
    assert record.calls["evict_one_each"] > 0
    if policy.needs_attention:
        assert record.calls["fold_staged"] > 0
    assert_same(stacked, per_layer(tiny, ids, policy, stage, monkeypatch, stride))


def adaptive(name: str, **extra):
    """A named policy's parts with Ada-KV's split across heads."""
    cfg = policy_cfg(name, **extra)
    cfg["allocation"] = {"kind": "adaptive", "floor": 0.2}
    return build_policy(cfg)


POOLED = {"adakv": lambda: named("adakv"),
          "adakv, no floor": lambda: named("adakv", allocation={"floor": 0.0}),
          "adakv, floor = budget": lambda: named("adakv", allocation={"floor": 1.0}),
          "adakv, no window": lambda: named("adakv", scope={"window": 0}),
          "adakv int8": lambda: named("adakv", quantize="int8"),
          "h2o, a window of 2": lambda: adaptive("h2o", scope={"window": 2}),
          "roco": lambda: adaptive("roco"),
          "scissorhands": lambda: adaptive("scissorhands"),
          "knorm": lambda: adaptive("knorm")}


@pytest.mark.parametrize("stride", [8, None], ids=["chunked", "one chunk"])
@pytest.mark.parametrize("stage", ["both", "decode"])
@pytest.mark.parametrize("variant", POOLED)
def test_pooled_layers_evict_together_as_layer_by_layer(tiny, random_ids, monkeypatch, variant, stage, stride):
    """Ada-KV's pools: every decode step in which each layer holds one entry per head over its total is ranked
    in one go; tokens, logits and every kept set must be those of each layer evicting alone."""
    policy = POOLED[variant]()
    if stage in policy.unsupported_stages:
        pytest.skip(f"{variant} does not run in stage {stage}")
    ids = random_ids(48, seed=35)
    calls = []
    together = cache_module.evict_pools
    monkeypatch.setattr(cache_module, "evict_pools", lambda layers: calls.append(len(layers)) or together(layers))
    batched = generate_with(tiny, ids, policy, stage, stride)
    assert calls and max(calls) == tiny.model.config.num_hidden_layers
    with monkeypatch.context() as m:
        m.setattr(cache_module.PooledLayer, "over_by_one_each", lambda layer: False)
        alone = generate_with(tiny, ids, policy, stage, stride)
    assert_same(batched, alone)


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


def test_a_padded_state_holds_each_layer_and_nothing_past_it():
    """Layers of different budgets, ranked padded to the longest: each row's own entries are its layer's state,
    and past them every statistic reads exactly 0 and every position 0 (what was evicted there must not leak)."""
    budgets = (3, 4, 5, 6)
    cache = BudgetedCache([LayerPlan(budget=b, capacity=12) for b in budgets],
                          named("mean_window", scope={"window": 2}))
    torch.manual_seed(0)
    feed(cache, [2] * len(budgets), 4)
    lengths = tuple(layer.length for layer in cache.layers)
    assert lengths == budgets
    held, _, valid, *_ = cache.stack.rows(lengths)
    state = cache.stack.padded_state(max(lengths), held, valid)
    assert state.lengths().tolist() == [3, 3, 4, 4, 5, 5, 6, 6]
    for l, layer in enumerate(cache.layers):
        own, rows, n = layer.state(), slice(2 * l, 2 * l + 2), layer.length
        assert torch.equal(state.positions[rows, :n], own.positions)
        assert torch.equal(state.stats["acc"][rows, :n], own.stats["acc"])
        assert torch.equal(state.stats["count"][rows, :n], own.stats["count"])
        assert not state.positions[rows, n:].any()
        assert not state.stats["acc"][rows, n:].any() and not state.stats["count"][rows, n:].any()
        assert layer.positions[:, n:].any() and layer.stats["acc"][:, n:].any()  # there was something to hide


@pytest.mark.parametrize("variant", ["adakv", "mean_window"])
def test_a_pooled_state_holds_each_layer_and_nothing_past_it(tiny, random_ids, monkeypatch, variant):
    """Pooled layers scored as one: each row's own entries are what its layer's state holds, and past a head's
    entries every statistic reads exactly 0 and every position 0 (the padding reads some pool row)."""
    policy = named("adakv") if variant == "adakv" else adaptive("mean_window", scope={"window": 2})
    caches = []
    monkeypatch.setattr(cache_module.BudgetedCache, "summary",
                        lambda cache, _summary=cache_module.BudgetedCache.summary: caches.append(cache) or _summary(cache))
    generate_with(tiny, random_ids(48, seed=36), policy, "both", 8)
    layers = caches[-1].layers
    state, idx = cache_module.pooled_state(layers)
    heads = layers[0].heads
    names = ["qlog_sum"] if variant == "adakv" else ["acc", "count"]
    padded = 0
    for l, layer in enumerate(layers):
        own, rows = layer.state(), slice(l * heads, (l + 1) * heads)
        longest = own.length
        own_values = {"qlog_sum": own.derived("qlog_sum", lambda s: None)} | dict(own.stats)
        values = {"qlog_sum": state.derived("qlog_sum", lambda s: None)} | dict(state.stats)
        for h, n in enumerate(layer.lengths.tolist()):
            row = l * heads + h
            assert torch.equal(idx[row, :n], layer.head_rows[h, :n])
            assert torch.equal(state.positions[row, :n], own.positions[h, :n])
            assert not state.positions[row, n:].any()
            for name in names:
                assert torch.equal(values[name][row, :n], own_values[name][h, :n])
                assert not values[name][row, n:].any()
            padded += state.length - n
        assert torch.equal(state.valid_mask()[rows, :longest], own.valid_mask())
    assert padded > 0
