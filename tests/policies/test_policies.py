"""The policy zoo: every named policy on tiny-llama in every stage it supports, and each extra's own math.

Checks per named policy and stage: masked replay over a full cache gives the evicting run's logits, the
budget is never exceeded (per layer, or per layer total under per-head allocation), sinks and recent
windows are never evicted, and a budget at least the sequence length gives the full cache's tokens.
Merging and quantisation change stored values, so they are checked against their own formulas instead.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import CONFIG_DIR, fit_layers, keeping_all, tiny_policy_cfg
from engine_run import generate
from omegaconf import OmegaConf

from kvbench.engine import attention as attention_module
from kvbench.engine.cache.cache import KVCache
from kvbench.engine.engine import DecodeSettings
from kvbench.engine.plan import LayerPlan
from kvbench.engine.step import Phase, Step
from kvbench.policies.derived import attention_variance, mean_attention
from kvbench.policies.quantize import Int8
from kvbench.policies.registry import build_policy
from kvbench.policies.scopes.robust import Robust
from kvbench.policies.scopes.sinks_window import SinksWindow

pytestmark = pytest.mark.usefixtures("one_thread")
NAMED = sorted(p.stem for p in (CONFIG_DIR / "policy").glob("*.yaml"))
STAGES = ("prefill", "decode", "both")
PROMPT, NEW, STRIDE = 48, 12, 8
TINY_LAYERS = 4


def policy_cfg(name: str, **extra) -> dict:
    """A named policy's tiny config, a per-layer budget list fitted to tiny-llama's layers."""
    return fit_layers(tiny_policy_cfg(name, **extra), TINY_LAYERS)


def named(name: str, **extra):
    return build_policy(policy_cfg(name, **extra))


CASES = [(n, s) for n in NAMED for s in STAGES if s not in named(n).unsupported_stages]


def stride_of(policy) -> int:
    """The prompt in chunks, or in one for a score that reads every prompt query (``Score.whole_prompt``)."""
    return PROMPT if policy.whole_prompt else STRIDE


def run(tiny, ids, policy, budget, stage, stride=None, **kw):
    """``ids`` generated from; a policy observing the question (Finch) gets their last 4 as it, fed apart (the
    engine compresses them with the rest: the same forwards)."""
    asked = len(ids) - (4 if policy.question else 0)
    return generate(
        tiny.model,
        None,
        ids[:asked],
        policy,
        budget,
        stage,
        DecodeSettings(max_new_tokens=NEW),
        ids[asked:],
        stride=stride or stride_of(policy),
        return_logits=True,
        **kw,
    )


class Spy:
    """Capture the last cache a generate() read its summary from (its sequence still in slot 0)."""

    def __init__(self, monkeypatch):
        self.cache = None
        original = KVCache.summary

        def summary(cache, slot=0):
            self.cache = cache
            return original(cache, slot)

        monkeypatch.setattr(KVCache, "summary", summary)


def test_every_named_policy_has_a_config():
    assert set(NAMED) >= {
        "full",
        "window",
        "streamingllm",
        "random",
        "h2o",
        "scissorhands",
        "tova",
        "roco",
        "snapkv",
        "knorm",
        "vatp",
        "pyramidkv",
        "adakv",
        "mean_window",
        "accumulated_robust",
    }
    for name in NAMED:
        cfg = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "policy" / f"{name}.yaml"), resolve=True)
        assert cfg["name"] == name
        # A file names its parts; the allocation and the extras default in kvbench/config/schema.py (tests/config).
        assert {"name", "score", "scope"} <= set(cfg)


def test_tiny_configs_cap_token_counts_and_nothing_else():
    snap, hits, roco, h2o = (tiny_policy_cfg(n) for n in ("snapkv", "scissorhands", "roco", "h2o"))
    assert (snap["score"]["window"], snap["scope"]["window"], snap["score"]["kernel_size"]) == (6, 6, 5)
    assert (hits["score"]["history"], hits["scope"]["window"], hits["score"]["threshold"]) == (6, 6, 1.0)
    assert (roco["scope"]["n_recent"], roco["scope"]["n_sink"]) == (4, 4)
    assert h2o["scope"]["window"] == 0.5 and tiny_policy_cfg("snapkv", score={"window": 3})["scope"]["window"] == 3


def protected_positions(policy, budget: int, fed: int) -> set[int]:
    """Positions the scope must hold after an evicting step that has fed positions 0..fed-1."""
    scope = policy.scope
    if isinstance(scope, SinksWindow):
        sinks, window = min(scope.n_sink, budget), scope.window_size(budget)
    elif isinstance(scope, Robust):
        sinks = min(scope.n_sink, budget)
        window = min(scope.n_recent, budget - sinks)
    else:
        return set()
    return set(range(sinks)) | set(range(fed - window, fed))


@pytest.mark.parametrize("name, stage", CASES)
def test_named_policy_equals_masked_replay_and_keeps_its_promises(tiny, random_ids, name, stage):
    policy = named(name)
    if policy.positions == "reindex":  # the replay runs at the true positions (Finch's kept sets read no RoPE)
        policy = named(name, positions="absolute")
    ids = random_ids(PROMPT, seed=11)
    g = run(tiny, ids, policy, 0.3, stage, trace=True)
    full = build_policy({"name": "full"})
    r = run(tiny, ids, full, 1.0, stage, stride_of(policy), forced_tokens=g.tokens, replay_trace=g.trace)
    # merging changes kept values, pruned key channels the kept keys: tests/policies/test_cam.py and test_think.py
    if policy.evicts and not policy.merge and policy.channels is None:
        torch.testing.assert_close(g.logits, r.logits, rtol=1e-4, atol=1e-4)
    limit = PROMPT if stage == "prefill" else PROMPT + NEW
    budgets = policy.layer_budgets(g.measures.budget_tokens, TINY_LAYERS, limit) if policy.evicts else [None] * 4
    stride = stride_of(policy)
    prefill_steps = PROMPT // stride
    for step, layers in enumerate(g.trace):
        fed = stride * (step + 1) if step < prefill_steps else PROMPT + step - prefill_steps + 1
        # A replaying score (KVzip) evicts the prompt once, after its passes: at the prompt's last chunk.
        prompt_evicts = policy.replay is None or step == prefill_steps - 1
        evicting = (step < prefill_steps and stage != "decode" and prompt_evicts) or (
            step >= prefill_steps and stage != "prefill"
        )
        for held, b in zip(layers, budgets):
            heads = [set(h.tolist()) for h in held]
            assert all(max(h) < fed for h in heads)
            if not (evicting and policy.evicts):
                continue
            grown = policy.interval - 1 if step >= prefill_steps else 0  # decode steps between evictions
            if policy.allocation.pools_layers:  # layers differ; the sequence's total holds
                held_all = sum(len(set(row.tolist())) for kept in layers for row in kept)
                assert held_all <= 2 * (sum(budgets) + TINY_LAYERS * grown)
            elif policy.allocation.per_head:  # heads differ; the layer total holds
                assert sum(len(h) for h in heads) <= 2 * (b + grown)
            else:
                assert held.shape[-1] <= b + grown and torch.all(held[:, 1:] > held[:, :-1])
            must = protected_positions(policy, b, fed)
            for h in heads:
                assert must <= h, f"step {step}: protected {sorted(must - h)} evicted"


FULL_REFERENCE: dict[str, list[int]] = {}


@pytest.mark.parametrize("name, stage", CASES)
def test_budget_at_least_length_gives_full_tokens(tiny, random_ids, name, stage):
    ids = random_ids(PROMPT, seed=12)
    if stage not in FULL_REFERENCE:
        FULL_REFERENCE[stage] = run(tiny, ids, build_policy({"name": "full"}), 1.0, stage)
    ref = FULL_REFERENCE[stage]
    g = run(tiny, ids, build_policy(keeping_all(policy_cfg(name))), PROMPT + NEW, stage)
    assert g.tokens == ref.tokens
    torch.testing.assert_close(g.logits, ref.logits, rtol=1e-5, atol=1e-5)


def test_stage_refusal_and_command_line_overrides():
    from hydra import compose, initialize_config_dir

    from kvbench.config import ConfigError, validate

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        bad = compose("config", overrides=["model=tiny-llama", "policy=snapkv", "stage=decode"])
        cfg = compose(
            "config",
            overrides=[
                "model=tiny-llama",
                "policy=snapkv",
                "policy.score.window=16",
                "policy.score.pooling=max",
                "policy.scope.n_sink=8",
            ],
        )
        roco = compose(
            "config",
            overrides=[
                "policy=roco",
                "policy.scope.rho_decode=0.5",
                "policy.merge=true",
                "policy.quantize=int8",
                "policy.positions=reindex",
            ],
        )
    with pytest.raises(ConfigError, match="policy=snapkv cannot run in stage=decode"):
        validate(bad)
    for name in ("snapkv", "pyramidkv", "adakv"):
        assert named(name).unsupported_stages == ("decode",)
    p = build_policy(OmegaConf.to_container(cfg.policy, resolve=True))
    assert (p.score.window, p.score.pooling, p.scope.n_sink, p.scope.window) == (16, "max", 8, 16)
    p = build_policy(OmegaConf.to_container(roco.policy, resolve=True))
    assert p.scope.rho_decode == 0.5 and p.merge and isinstance(p.quantize, Int8) and p.positions == "reindex"
    with pytest.raises(ValueError, match="score 'snapkv' has no option bogus"):
        build_policy(policy_cfg("snapkv", score={"bogus": 1}))
    with pytest.raises(ValueError, match="unknown quantize 'int4'"):
        build_policy(policy_cfg("h2o", quantize="int4"))


def test_policies_without_attention_statistics_never_compute_them(tiny, random_ids, monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("attention statistics computed for a policy that needs none")

    monkeypatch.setattr(attention_module, "attention_statistics", boom)
    for name in ("window", "knorm", "random", "streamingllm", "full"):
        assert not named(name).needs_attention
        run(tiny, random_ids(30), named(name), 0.5, "both")


# ------------------------------------------------------------------ RoCo's statistics vs eager attention


def eager_attentions(model, seq: list[int]) -> tuple[torch.Tensor, ...]:
    """Every layer's full attention matrix over ``seq`` (eager attention, for references only)."""
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            return model(torch.tensor([seq]), output_attentions=True).attentions
    finally:
        model.set_attn_implementation(previous)


def test_mean_and_std_match_eager_attention(tiny, random_ids, monkeypatch):
    """acc/count and the std from sumsq equal NumPy over the full attention matrices (eager, this test only)."""
    spy = Spy(monkeypatch)
    ids = random_ids(21, seed=13)
    g = generate(tiny.model, None, ids, named("roco"), 100, "both", DecodeSettings(max_new_tokens=5), stride=5)
    seq = ids + g.tokens[:-1]  # every token fed
    attentions = eager_attentions(tiny.model, seq)
    n = len(seq)
    for layer, att in zip(spy.cache.layers, attentions):
        probs = att[0].double().numpy()  # [q_heads, n, n]
        grouped = probs.reshape(2, 2, n, n).mean(axis=1)  # GQA: mean over each KV head's query heads
        mean_ref = np.zeros((2, n))
        std_ref = np.zeros((2, n))
        for j in range(n):
            column = grouped[:, j:, j]  # queries i >= j saw key j
            mean_ref[:, j], std_ref[:, j] = column.mean(axis=1), column.std(axis=1)
        state = spy.cache.layer_state(layer.layer_idx)
        mean, std = mean_attention(state), attention_variance(state).clamp_min(0.0).sqrt()
        assert state.positions[0].tolist() == list(range(n))
        np.testing.assert_allclose(mean.numpy(), mean_ref, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(std.numpy(), std_ref, rtol=1e-3, atol=1e-5)
        np.testing.assert_allclose(state.stats["count"].numpy(), np.tile(np.arange(n, 0, -1), (2, 1)))


def test_hit_counts_match_eager_attention(tiny, random_ids, monkeypatch):
    """ScissorHands' hits from the cache's query log (across prompt chunks and decode steps) equal the hits
    counted over the last ``history`` rows of the full attention matrices."""
    spy = Spy(monkeypatch)
    history = 6
    ids = random_ids(19, seed=17)
    g = generate(
        tiny.model,
        None,
        ids,
        named("scissorhands", score={"history": history}),
        100,
        "both",
        DecodeSettings(max_new_tokens=5),
        stride=4,
    )
    seq = ids + g.tokens[:-1]
    attentions = eager_attentions(tiny.model, seq)
    n = len(seq)
    for layer, att in zip(spy.cache.layers, attentions):
        rows = att[0].double().numpy().reshape(2, 2, n, n).mean(axis=1)[:, n - history :]  # [kv, history, n]
        seen = np.arange(n - history, n) + 1  # keys each logged query saw
        expected = ((rows >= 1.0 / seen[None, :, None]) & (rows > 0)).sum(axis=1)
        state = spy.cache.layer_state(layer.layer_idx)
        assert layer.policy.score(state).tolist() == expected.tolist()


@pytest.mark.parametrize(
    "cfg",
    [
        {"name": "vatp", "score": {"kind": "value_aware", "p": 1}, "scope": {"kind": "sinks_window", "n_sink": 2}},
        {
            "name": "vatp_int8_merge",
            "score": {"kind": "value_aware", "p": 2},
            "scope": {"kind": "sinks_window", "n_sink": 2},
            "quantize": "int8",
            "merge": True,
        },
        {"name": "knorm", "score": "key_norm"},
        {
            "name": "ada_vatp",
            "score": {"kind": "value_aware", "p": 1},
            "scope": {"kind": "sinks_window", "n_sink": 2},
            "allocation": {"kind": "adaptive"},
        },
    ],
)
def test_write_time_features_follow_their_entries(tiny, random_ids, monkeypatch, cfg):
    """Value and key norms are taken once, when an entry is written; through compaction, merging and
    quantisation they must still be the norms of the entries the cache holds."""
    spy = Spy(monkeypatch)
    generate(
        tiny.model,
        None,
        random_ids(40, seed=18),
        build_policy(cfg),
        0.3,
        "both",
        DecodeSettings(max_new_tokens=6),
        stride=8,
    )
    for layer in spy.cache.layers:
        state = spy.cache.layer_state(layer.layer_idx)
        valid = state.valid_mask()
        if "value_norm" in state.stats:
            p = build_policy(cfg).score.p
            expected = state.values.float().norm(p=p, dim=-1)
            torch.testing.assert_close(state.stats["value_norm"][valid], expected[valid])
        else:
            torch.testing.assert_close(state.stats["key_norm"][valid], state.keys.float().norm(dim=-1)[valid])


def test_robust_scope_sees_the_phase_the_cache_is_in(tiny, random_ids, monkeypatch):
    """stage=both: the prompt is compressed with rho_prefill, decoding holds the budget with rho_decode."""
    seen = []
    original = Robust.shield

    def spy(scope, scores, state, budget):
        seen.append((state.phase, scope.std_count(budget, state.phase)))
        return original(scope, scores, state, budget)

    monkeypatch.setattr(Robust, "shield", spy)
    run(tiny, random_ids(PROMPT, seed=20), named("roco"), 40, "both")
    assert seen[0] == ("prefill", 4) and seen[-1] == ("decode", 12)  # floor(0.1 * 40), floor(0.3 * 40)
    assert [p for p, _ in seen] == sorted((p for p, _ in seen), key=["prefill", "decode"].index)


# ------------------------------------------------------------------ per-head allocation really shrinks memory


def test_adakv_stores_only_kept_entries(tiny, random_ids, monkeypatch):
    spy = Spy(monkeypatch)
    ids = random_ids(64, seed=14)
    ada = generate(tiny.model, None, ids, named("adakv"), 0.25, "prefill", DecodeSettings(max_new_tokens=1))
    lengths = [spy.cache.layer_state(layer).lengths().tolist() for layer in range(len(spy.cache.layers))]
    assert any(len(set(h)) > 1 for h in lengths), "per-head budgets should differ somewhere"
    assert all(sum(h) == 2 * ada.measures.budget_tokens for h in lengths)  # layer total = heads × budget
    per_entry = 2 * 16 * 4  # K + V, head_dim 16, float32
    assert ada.measures.kv_resident_bytes == sum(sum(h) for h in lengths) * per_entry
    uniform = generate(tiny.model, None, ids, named("snapkv"), 0.25, "prefill", DecodeSettings(max_new_tokens=1))
    full = generate(tiny.model, None, ids, named("full"), 1.0, "prefill", DecodeSettings(max_new_tokens=1))
    assert ada.measures.kv_resident_bytes == uniform.measures.kv_resident_bytes < full.measures.kv_resident_bytes
    # Rows are allocated for the most one head may come to hold (its layer's total): more than uniform's.
    assert uniform.measures.kv_capacity_bytes < ada.measures.kv_capacity_bytes <= full.measures.kv_capacity_bytes


@pytest.mark.parametrize("stage", ["prefill", "both"])
def test_adakv_with_a_full_floor_is_snapkv(tiny, random_ids, monkeypatch, stage):
    """floor = 1 guarantees every head its own budget, leaving nothing to move between heads: the pooled
    layout (its row lists, free rows, summed query log) must then keep exactly what SnapKV keeps."""
    spy = Spy(monkeypatch)
    ids = random_ids(44, seed=19)
    ada = run(tiny, ids, named("adakv", allocation={"floor": 1.0}), 0.3, stage, trace=True)
    state = spy.cache.layer_state(1)
    torch.testing.assert_close(state.derived("qlog_sum", lambda s: None), state.stats["qlog"].sum(dim=1))
    snap = run(tiny, ids, named("snapkv"), 0.3, stage, trace=True)
    assert ada.tokens == snap.tokens
    torch.testing.assert_close(ada.logits, snap.logits, rtol=1e-5, atol=1e-5)
    for a_layers, s_layers in zip(ada.trace, snap.trace):
        for a, s in zip(a_layers, s_layers):
            assert [sorted(h.tolist()) for h in a] == [sorted(h.tolist()) for h in s]


def test_adakv_decode_steps_never_see_freed_slots(tiny, random_ids, monkeypatch):
    """Heads drop unevenly, so decode steps attend rows with free slots in them: no head may see them (their
    K/V are evicted entries). Masked replay of the kept sets over a full cache must give the same logits."""
    holes = []
    update = KVCache.update

    def record(cache, key_states, value_states, layer, *args, **kwargs):
        out = update(cache, key_states, value_states, layer, *args, **kwargs)
        if key_states.shape[2] == 1:
            holes.append(cache.layers[layer].visible is not None)
        return out

    monkeypatch.setattr(KVCache, "update", record)
    ids = random_ids(PROMPT, seed=22)
    g = generate(
        tiny.model,
        None,
        ids,
        named("adakv"),
        0.6,
        "both",
        DecodeSettings(max_new_tokens=NEW),
        stride=2,
        return_logits=True,
        trace=True,
    )
    assert any(holes)  # decode steps attended rows with free slots
    r = generate(
        tiny.model,
        None,
        ids,
        build_policy({"name": "full"}),
        1.0,
        "both",
        DecodeSettings(max_new_tokens=NEW),
        stride=2,
        return_logits=True,
        forced_tokens=g.tokens,
        replay_trace=g.trace,
    )
    torch.testing.assert_close(g.logits, r.logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("stage, collects", [("prefill", False), ("both", True)])
def test_statistics_are_collected_only_while_a_later_step_evicts(tiny, random_ids, monkeypatch, stage, collects):
    """Stage prefill: decode steps never evict, so they compute no statistics; stage both: they do."""
    calls = {"prefill": 0, "decode": 0}
    current = {}
    for fn in ("attention_statistics", "decode_attention"):
        original = getattr(attention_module, fn)

        def counted(*args, _original=original, **kwargs):
            out = _original(*args, **kwargs)
            stats = out[1] if isinstance(out, tuple) else out
            calls[current["step"].phase] += bool(stats)
            return out

        monkeypatch.setattr(attention_module, fn, counted)
    begin = KVCache.begin

    def spy_begin(cache, step):
        current["step"] = step
        return begin(cache, step)

    monkeypatch.setattr(KVCache, "begin", spy_begin)
    for name in ("h2o", "adakv"):
        calls.update(prefill=0, decode=0)
        run(tiny, random_ids(PROMPT, seed=22), named(name), 0.3, stage)
        assert calls["prefill"] > 0 and (calls["decode"] > 0) == collects, (name, calls)


def test_adaptive_allocation_in_decode_holds_the_layer_total(tiny, random_ids):
    policy = build_policy(
        {
            "name": "ada-h2o",
            "score": "accumulated",
            "scope": {"kind": "sinks_window", "n_sink": 2},
            "allocation": {"kind": "adaptive", "floor": 0.2},
        }
    )
    ids = random_ids(40, seed=15)
    g = run(tiny, ids, policy, 0.3, "decode", trace=True)
    r = run(tiny, ids, build_policy({"name": "full"}), 1.0, "decode", forced_tokens=g.tokens, replay_trace=g.trace)
    torch.testing.assert_close(g.logits, r.logits, rtol=1e-4, atol=1e-4)
    for layers in g.trace[40 // STRIDE :]:  # decode steps
        for held in layers:
            heads = [set(h.tolist()) for h in held]
            assert sum(len(h) for h in heads) <= 2 * g.measures.budget_tokens and all({0, 1} <= h for h in heads)


# ------------------------------------------------------------------ quantised KV


@pytest.mark.parametrize("kind, name, stage", [("int8", "full", "prefill"), ("fp8", "h2o", "both")])
def test_quantised_cache_bytes_and_values(tiny, random_ids, monkeypatch, kind, name, stage):
    spy = Spy(monkeypatch)
    ids = random_ids(40, seed=16)
    q = generate(tiny.model, None, ids, named(name, quantize=kind), 0.5, stage, DecodeSettings(max_new_tokens=6))
    qcache = spy.cache
    full = generate(
        tiny.model, None, ids, named("full"), 1.0, stage, DecodeSettings(max_new_tokens=6), forced_tokens=q.tokens
    )
    fcache = spy.cache
    held = sum(
        sum(qcache.layer_state(layer).lengths().tolist()) for layer in range(len(qcache.layers))
    )  # entries (token × KV head)
    assert q.measures.kv_resident_bytes == held * 2 * (16 * 1 + 4)  # K and V: 16 one-byte codes + a float32 scale
    assert (
        q.measures.kv_resident_bytes <= full.measures.kv_resident_bytes * (16 + 4) / 64
    )  # float32 entries take 64 bytes
    # Layer 0's keys depend only on token and position: the stored codes dequantise to the full cache's
    # keys at the kept positions, within the quantiser's bound.
    state, ref = qcache.layer_state(0), fcache.layer_state(0)
    keys, values, pos = state.keys, state.values, state.positions
    exact_k = ref.keys.gather(1, pos.unsqueeze(-1).expand(-1, -1, 16))
    exact_v = ref.values.gather(1, pos.unsqueeze(-1).expand(-1, -1, 16))
    quant = named(name, quantize=kind).quantize
    assert torch.all((keys - exact_k).abs() <= quant.error_bound(exact_k))
    assert torch.all((values - exact_v).abs() <= quant.error_bound(exact_v))
    assert (keys - exact_k).abs().max() > 0  # really quantised


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_quantiser_round_trip_within_bound(kind):
    from kvbench.policies.quantize import build_quantizer

    quant = build_quantizer(kind)
    x = torch.randn(3, 50, 64) * torch.logspace(-3, 2, 50).view(1, 50, 1)
    x[0, 0] = 0.0  # an all-zero vector must survive
    codes, scale = quant.quantize(x)
    back = quant.dequantize(codes, scale, torch.float32)
    assert codes.element_size() == 1 and scale.shape == (3, 50, 1)
    assert torch.all((back - x).abs() <= quant.error_bound(x))
    assert torch.equal(back[0, 0], torch.zeros(64))
    # Per-token absmax: every vector's largest element is represented exactly (up to float rounding).
    top = x.abs().amax(-1)
    torch.testing.assert_close(back.abs().amax(-1), top, rtol=1e-6, atol=0)


# ------------------------------------------------------------------ merging


def test_merge_in_the_cache_is_the_attention_weighted_average():
    """Two evictions through a real BudgetedCache layer: the kept entry becomes the weighted average of itself
    and the entries folded into it (weights: acc, plus the mass it absorbed before)."""
    policy = build_policy({"name": "h2o-merge", "score": "accumulated", "scope": "all", "merge": True})
    plans = [LayerPlan(budget=2, prefill=8, decode=8, total=8)]
    cache = KVCache([plans], policy)
    cache.assign(0, plans)
    layer = cache.layers[0]
    keys = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.9, 0.2], [0.1, 1.0]])
    values = torch.tensor([[1.0, 1.0], [2.0, 0.0], [3.0, 5.0], [0.0, 4.0]])
    acc = torch.tensor([0.5, 0.4, 0.1, 0.2])
    step = Step(range(1), [[0, 1, 2, 3]], Phase.prefill, evicts=True, collects=True)
    cache.begin(step)
    cache.update(keys.view(1, 1, 4, 2), values.view(1, 1, 4, 2), 0)
    layer.record({"acc": acc.view(1, 4)})
    cache.finish(step)
    # Kept: tokens 0 and 1 (highest acc). Token 2 is closest to key 0, token 3 to key 1.
    k0 = (0.5 * keys[0] + 0.1 * keys[2]) / 0.6
    k1 = (0.4 * keys[1] + 0.2 * keys[3]) / 0.6
    v0 = (0.5 * values[0] + 0.1 * values[2]) / 0.6
    v1 = (0.4 * values[1] + 0.2 * values[3]) / 0.6
    state = cache.layer_state(0)
    assert state.positions[0].tolist() == [0, 1]
    torch.testing.assert_close(state.keys[0], torch.stack([k0, k1]))
    torch.testing.assert_close(state.values[0], torch.stack([v0, v1]))
    torch.testing.assert_close(state.stats["mass"][0], torch.tensor([0.1, 0.2]))
    # Second step: a new token (acc 1.0, key along token 0) evicts token 1; token 1's weight is its acc
    # (0.4 + 0.05 this step) plus the 0.2 it absorbed. It takes the lowest free slot (2): its stats come there.
    new_k, new_v = torch.tensor([[0.0, 2.0]]), torch.tensor([[7.0, 7.0]])
    step = Step(range(1), [[4]], Phase.prefill, evicts=True, collects=True)
    cache.begin(step)
    cache.update(new_k.view(1, 1, 1, 2), new_v.view(1, 1, 1, 2), 0)
    layer.record({"acc": torch.tensor([[0.6, 0.05, 1.0]])})
    cache.finish(step)
    # acc now: token0 1.1, token1 0.45, token4 1.0 -> keep 0 and 4; token 1 (key ~ [0.03, 1]) joins token 4.
    w1 = 0.45 + 0.2
    expected_k4 = (1.0 * new_k[0] + w1 * k1) / (1.0 + w1)
    expected_v4 = (1.0 * new_v[0] + w1 * v1) / (1.0 + w1)
    state = cache.layer_state(0)
    assert state.positions[0].tolist() == [0, 4]
    torch.testing.assert_close(state.keys[0, 1], expected_k4)
    torch.testing.assert_close(state.values[0, 1], expected_v4)
    torch.testing.assert_close(state.keys[0, 0], k0)
    torch.testing.assert_close(state.stats["mass"][0], torch.tensor([0.1, w1]))


@pytest.mark.parametrize("name, stage", [("h2o", "both"), ("adakv", "prefill"), ("roco", "decode")])
def test_merging_runs_with_any_policy_within_budget(tiny, random_ids, name, stage):
    ids = random_ids(40, seed=17)
    g = run(tiny, ids, named(name, merge=True), 0.3, stage, trace=True)
    plain = run(tiny, ids, named(name), 0.3, stage, forced_tokens=g.tokens)
    assert (g.logits - plain.logits).abs().max() > 1e-4  # merged values change the output
    last_evicting = 40 // STRIDE - 1 if stage == "prefill" else -1
    for held in g.trace[last_evicting]:
        assert sum(len(set(h.tolist())) for h in held) <= 2 * g.measures.budget_tokens


# ------------------------------------------------------------------ positions: reindex


def test_reindex_feeds_contiguous_positions_and_rerotates_kept_keys(tiny, random_ids, monkeypatch):
    from transformers import AttentionInterface
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    seen = {}

    def capture(module, query, key, value, attention_mask, **kwargs):
        if module.layer_idx == 0:
            seen["key"] = key.clone()
            seen["positions"] = attention_module.attended_cache().layers[0].key_positions[0].clone()
        return attention_module.kvbench_attention(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(attention_module.ATTN_NAME, capture)
    fed = []
    begin = KVCache.begin

    def spy_begin(cache, step):
        out = begin(cache, step)
        fed.append((step.positions[0], out[0].tolist()))
        return out

    monkeypatch.setattr(KVCache, "begin", spy_begin)
    spy = Spy(monkeypatch)
    try:
        ids = random_ids(30, seed=18)
        g = generate(
            tiny.model,
            None,
            ids,
            named("streamingllm", positions="reindex"),
            10,
            "both",
            DecodeSettings(max_new_tokens=6),
        )
    finally:
        AttentionInterface.register(attention_module.ATTN_NAME, attention_module.kvbench_attention)
    # The prompt at 0..29 (nothing held yet), then each decoded token right after the 10 held: position 10.
    assert fed[0] == (list(range(30)), list(range(30)))
    assert [f[1] for f in fed[1:]] == [[10]] * 5
    # Last step: the cache held sinks 0-3 and positions 28-33, then got token 34: keys at contiguous 0..10.
    seq = ids + g.tokens[:-1]
    model = tiny.model.model
    with torch.no_grad():
        hidden = model.layers[0].input_layernorm(model.embed_tokens(torch.tensor([seq])))
        raw = model.layers[0].self_attn.k_proj(hidden).view(1, len(seq), 2, 16).transpose(1, 2)
        held = [0, 1, 2, 3, 28, 29, 30, 31, 32, 33, 34]
        where = torch.arange(len(held)).unsqueeze(0)
        cos, sin = model.rotary_emb(hidden, where)
        _, expected = apply_rotary_pos_emb(raw[:, :, held], raw[:, :, held], cos, sin)
    in_order = seen["positions"].argsort()  # keys come in the cache's slot order
    assert seen["positions"][in_order].tolist() == held
    torch.testing.assert_close(seen["key"][:, :, in_order], expected, rtol=1e-5, atol=1e-5)
    # The cache still records true positions (for scores and traces) and stores keys un-rotated.
    state = spy.cache.layer_state(0)
    assert state.positions[0].tolist() == [0, 1, 2, 3, 29, 30, 31, 32, 33, 34]
    torch.testing.assert_close(state.keys, raw[0][:, [0, 1, 2, 3, 29, 30, 31, 32, 33, 34]], rtol=1e-5, atol=1e-5)


def test_reindex_at_full_budget_matches_full_and_needs_rope(tiny, random_ids):
    from transformers import GPT2Config, GPT2LMHeadModel

    ids = random_ids(30, seed=19)
    ref = run(tiny, ids, named("full"), 1.0, "both")
    g = run(tiny, ids, named("h2o", positions="reindex"), 30 + NEW, "both")
    assert g.tokens == ref.tokens
    torch.testing.assert_close(g.logits, ref.logits, rtol=1e-4, atol=1e-4)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=300, n_positions=64)).eval()
    with pytest.raises(ValueError, match="GPT2LMHeadModel has no rotary position embedding; use positions=absolute"):
        generate(
            gpt2, None, ids, named("streamingllm", positions="reindex"), 10, "both", DecodeSettings(max_new_tokens=2)
        )
