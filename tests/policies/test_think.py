"""ThinK's key-channel pruning (policy.channels): the channels each row keeps against NumPy from the paper's rule on
the model's own queries and keys, the pruned attention against the family's eager attention with those channels
zeroed (tokens masked too where a token policy evicts; a question fed after the context too), decode-time evictions
against NumPy's KeyDiff and K-norm over the keys as stored (narrowed), and the resident bytes against a hand
count."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import torch
import transformers as tf
from conftest import tiny_policy_cfg
from engine_run import generate
from family_models import eager_replay

from kvbench.engine.cache.cache import KVCache
from kvbench.engine.engine import DecodeSettings
from kvbench.policies.registry import build_policy

PROMPT, NEW = 20, 6


def think(ratio: float, window: int, **extra: Any) -> dict:
    return {"name": "think", "channels": {"kind": "think", "ratio": ratio, "window": window}, **extra}


SNAPKV = {"score": {"kind": "snapkv", "window": 4}, "scope": {"kind": "sinks_window", "n_sink": 0, "window": 4}}


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return torch.randint(0, 200, (PROMPT,), generator=torch.Generator().manual_seed(1)).tolist()


@contextmanager
def recorded_channels(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[list[torch.Tensor]]]:
    """Per pruned prompt cache, each layer's kept channels [KV heads, kept] as its store holds them."""
    pruned: list[list[torch.Tensor]] = []
    original = KVCache.prune_channels

    def recording(cache: KVCache) -> None:
        original(cache)
        pruned.append([layer.store.channels.long().clone() for layer in cache.kv_layers])

    monkeypatch.setattr(KVCache, "prune_channels", recording)
    yield pruned


@contextmanager
def eager(model: Any) -> Iterator[None]:
    """The family's eager attention for the block (the shared model's setting restored after)."""
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


@contextmanager
def family_eager(model: Any, wrap: Any) -> Iterator[None]:
    """The family's ``eager_attention_forward`` wrapped by ``wrap(eager, attn, query, key, value, mask, **kw)``."""
    module = sys.modules[type(model).__module__]
    eager = module.eager_attention_forward
    module.eager_attention_forward = lambda *a, **kw: wrap(eager, *a, **kw)
    try:
        yield
    finally:
        module.eager_attention_forward = eager


def numpy_channels(queries: np.ndarray, keys: np.ndarray, ratio: float, window: int) -> np.ndarray:
    """ThinK's rule: query heads [Hq, n, D] and keys [Hkv, n, D] after RoPE; per KV head, the D - int(D ratio)
    channels of largest mean_window(q²) (averaged over the GQA group) × mean_n(k²), ascending."""
    hq, _, d = queries.shape
    hkv = keys.shape[0]
    q_energy = (queries[:, -window:].astype(np.float64) ** 2).mean(axis=1).reshape(hkv, hq // hkv, d).mean(axis=1)
    k_energy = (keys.astype(np.float64) ** 2).mean(axis=1)
    order = np.argsort(-(q_energy * k_energy), axis=-1, kind="stable")
    return np.sort(order[:, : d - int(d * ratio)], axis=-1)


@pytest.mark.parametrize("stride", [None, 7])
def test_kept_channels_are_thinks_rule_on_the_models_queries_and_keys(tiny, prompt, monkeypatch, stride):
    """A window of 10 queries spans the last two chunks at stride 7: the window is the context's, not a chunk's."""
    ratio, window = 0.4, 10
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def spy(eager, attn, query, key, value, mask, **kw):
        seen[attn.layer_idx] = (query[0].clone(), key[0].clone())
        return eager(attn, query, key, value, mask, **kw)

    with torch.inference_mode(), eager(tiny.model), family_eager(tiny.model, spy):
        tiny.model(input_ids=torch.tensor([prompt]))
    with recorded_channels(monkeypatch) as pruned:
        generate(tiny.model, None, prompt, build_policy(think(ratio, window)), 1.0, "prefill", stride=stride)
    assert len(pruned) == 1
    for layer, kept in enumerate(pruned[0]):
        q, k = seen[layer]
        expected = numpy_channels(q.numpy(), k.numpy(), ratio, window)
        assert kept.shape == (k.shape[0], 16 - 6)
        np.testing.assert_array_equal(kept.numpy(), expected, err_msg=f"layer {layer}")


def zeroing(pruned: list[torch.Tensor], context: int) -> Any:
    """An eager wrapper that, once the context is in (keys past it), zeroes each KV head's pruned key channels."""

    def wrap(eager, attn, query, key, value, mask, **kw):
        if key.shape[2] > context:
            kept = pruned[attn.layer_idx]
            drop = torch.ones(key.shape[1], key.shape[-1], dtype=torch.bool)
            drop.scatter_(1, kept, False)
            key = key.masked_fill(drop[None, :, None, :], 0)
        return eager(attn, query, key, value, mask, **kw)

    return wrap


@pytest.mark.parametrize(
    "cfg, budget, stage, stride",
    [
        (think(0.5, 8), 1.0, "prefill", None),
        (think(0.5, 8), 1.0, "both", 7),
        (think(0.75, 4, **SNAPKV), 9, "prefill", None),
        (think(0.25, 4, **SNAPKV), 9, "both", 7),
    ],
    ids=["think", "think-chunked", "think-snapkv", "think-snapkv-both-chunked"],
)
def test_pruned_attention_equals_eager_attention_with_the_pruned_channels_zeroed(
    tiny, prompt, monkeypatch, cfg, budget, stage, stride
):
    with recorded_channels(monkeypatch) as pruned:
        g = generate(
            tiny.model,
            None,
            prompt,
            build_policy(cfg),
            budget,
            stage,
            DecodeSettings(max_new_tokens=NEW),
            stride=stride,
            return_logits=True,
            trace=True,
        )
    trace = g.trace if "score" in cfg else None  # where a token policy evicts, the kept tokens are masked too
    with eager(tiny.model), family_eager(tiny.model, zeroing(pruned[0], PROMPT)):
        replayed = eager_replay(tiny.model, prompt, g.tokens, trace, stride)
    torch.testing.assert_close(g.logits, replayed, rtol=1e-4, atol=1e-4)


def test_a_question_fed_after_the_context_meets_pruned_keys_its_own_too(tiny, prompt, monkeypatch):
    """The path of task.ask=each (a question as ``suffix_ids``, fed once the context is compressed): the family's
    eager attention over context, question and decode, each forward after the context's with the pruned channels
    zeroed in every key (tests/engine/test_shared_context.py holds the shared run to this one)."""
    question = [5, 17, 33, 2]
    with recorded_channels(monkeypatch) as pruned:
        g = generate(
            tiny.model,
            None,
            prompt,
            build_policy(think(0.5, 8)),
            1.0,
            "prefill",
            DecodeSettings(max_new_tokens=NEW),
            suffix_ids=question,
            return_logits=True,
        )
    sequence = prompt + question + g.tokens
    steps = [(0, PROMPT), (PROMPT, PROMPT + len(question))]
    steps += [(s, s + 1) for s in range(PROMPT + len(question), len(sequence) - 1)]
    cache, logits = tf.DynamicCache(config=tiny.model.config), []
    with torch.inference_mode(), eager(tiny.model), family_eager(tiny.model, zeroing(pruned[0], PROMPT)):
        for start, end in steps:
            out = tiny.model(input_ids=torch.tensor([sequence[start:end]]), past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            logits.append(out.logits[0, -1].float())
    torch.testing.assert_close(g.logits, torch.stack(logits[1:]), rtol=1e-4, atol=1e-4)


def test_the_zeroed_reference_has_teeth(tiny, prompt, monkeypatch):
    """Without zeroing the pruned channels the family's attention gives other logits than a pruned run."""
    with recorded_channels(monkeypatch):
        g = generate(
            tiny.model,
            None,
            prompt,
            build_policy(think(0.5, 8)),
            1.0,
            "prefill",
            DecodeSettings(max_new_tokens=NEW),
            return_logits=True,
        )
    with eager(tiny.model):
        unpruned = eager_replay(tiny.model, prompt, g.tokens, None, None)
    assert (g.logits[1:] - unpruned[1:]).abs().max() > 1e-3
    torch.testing.assert_close(g.logits[0], unpruned[0], rtol=1e-4, atol=1e-4)  # the context attends unpruned


@pytest.mark.parametrize("ratio, quantize", [(0.5, "none"), (0.75, "int8"), (0.0, "none")])
def test_resident_bytes_are_the_hand_count_of_what_each_row_holds(tiny, prompt, ratio, quantize):
    """tiny-llama: 4 layers × 2 KV heads, D = 16, float32. Every row holds its kept entries' keys on the kept
    channels and their whole values (int8 codes plus one float32 scale each, quantised), and its int16 index."""
    cfg = think(ratio, 8, quantize=quantize, **SNAPKV)
    g = generate(tiny.model, None, prompt, build_policy(cfg), 9, "prefill", DecodeSettings(max_new_tokens=NEW))
    layers, heads, dim = 4, 2, 16
    kept = dim - int(dim * ratio)
    entries = 9 + NEW - 1  # the prompt's budget, then every decoded token but the last (never fed)
    per_entry = (kept + dim) * 4 if quantize == "none" else (kept + dim) * 1 + 2 * 4
    expected = layers * heads * (entries * per_entry + kept * 2)
    assert g.measures.kv_resident_bytes == expected


def keydiff_rule(keys: np.ndarray) -> np.ndarray:
    """KeyDiff's score of each key [n, d]: minus its cosine similarity to the mean of the unit keys."""
    unit = keys / np.linalg.norm(keys, axis=-1, keepdims=True)
    anchor = unit.mean(axis=0)
    return -(unit @ anchor) / np.linalg.norm(anchor)


def knorm_rule(keys: np.ndarray) -> np.ndarray:
    """K-norm's score: minus the key's L2 norm (the lowest norms kept)."""
    return -np.linalg.norm(keys, axis=-1)


def top(scores: np.ndarray, positions: np.ndarray, budget: int) -> set[int]:
    return set(positions[np.argsort(-scores, kind="stable")[:budget]].tolist())


@pytest.mark.parametrize("name, rule", [("keydiff", keydiff_rule), ("knorm", knorm_rule)])
def test_decode_eviction_ranks_the_keys_as_stored_narrowed(tiny, prompt, monkeypatch, name, rule):
    """stage=both: the prompt is evicted to the budget before its channels are chosen (the rule over whole keys);
    each decode step after evicts by the rule over the keys as the cache stores them, the kept channels alone
    (KeyDiff's running sum of unit keys summed again over them, K-norm's norms taken again). Reference: NumPy's
    rule on the family's own keys (the eager replay of the run), narrowed to the recorded channels."""
    budget, new = 9, 10
    cfg = tiny_policy_cfg(name, channels={"kind": "think", "ratio": 0.5, "window": 8})
    with recorded_channels(monkeypatch) as pruned:
        g = generate(
            tiny.model, None, prompt, build_policy(cfg), budget, "both", DecodeSettings(max_new_tokens=new), trace=True
        )
    keys: dict[int, torch.Tensor] = {}

    def spy(eager, attn, query, key, value, mask, **kw):
        keys[attn.layer_idx] = key[0].clone()  # the last forward's: every position fed, whole channels
        return eager(attn, query, key, value, mask, **kw)

    with eager(tiny.model), family_eager(tiny.model, zeroing(pruned[0], PROMPT)), family_eager(tiny.model, spy):
        eager_replay(tiny.model, prompt, g.tokens, g.trace, None)
    assert g.trace is not None and len(g.trace) == new
    whole_keys_differ = 0
    for layer, kept_channels in enumerate(pruned[0]):
        k = keys[layer].double().numpy()
        for head, channels in enumerate(kept_channels.numpy()):
            held = np.arange(PROMPT)
            assert set(g.trace[0][layer][head].tolist()) == top(rule(k[head, held]), held, budget)
            for step in range(1, new):
                held = np.array(sorted({*g.trace[step - 1][layer][head].tolist(), PROMPT + step - 1}))
                stored = k[head][held][:, channels]
                got = set(g.trace[step][layer][head].tolist())
                assert got == top(rule(stored), held, budget), f"layer {layer} head {head} step {step}"
                whole_keys_differ += got != top(rule(k[head, held]), held, budget)
    assert whole_keys_differ  # the rule over whole keys would have evicted otherwise: the test tells them apart
