"""KVCompose (``policy=kvcompose``: the ``kvcompose`` score under ``allocation=composite``): the kept sets against
NumPy from the rule's statement on the model's own eager attention of a second pass, the resident bytes counted by
hand, a prompt that fits its budget fed once, and the composite allocation on scores made by hand."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import tiny_policy_cfg
from engine_run import generate
from transformers import DynamicCache

from kvbench.engine.engine import DecodeSettings
from kvbench.policies.allocations.composite import Composite
from kvbench.policies.registry import build_policy

pytestmark = pytest.mark.usefixtures("one_thread")
LAYERS, HEADS, GROUP, HEAD_DIM = 4, 2, 2, 16  # tiny-llama: 4 query heads over 2 KV heads
ENTRY_BYTES = 2 * HEAD_DIM * 4  # a key and a value of float32, per token and KV head
PROMPT = 40


def second_pass_attention(model, ids: list[int]) -> list[np.ndarray]:
    """Per layer, the model's own eager attention probabilities [query heads, n, 2n] of the prompt fed a second
    time after itself (transformers' cache, no kvbench code)."""
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            cache = DynamicCache()
            x = torch.tensor([ids])
            model(input_ids=x, past_key_values=cache, use_cache=True)
            out = model(input_ids=x, past_key_values=cache, use_cache=True, output_attentions=True)
    finally:
        model.set_attn_implementation(previous)
    return [a[0].numpy() for a in out.attentions]


def reference_kept(attentions: list[np.ndarray], budget: int, mean_across_heads: bool) -> list[list[set[int]]]:
    """KVCompose from its statement: a token's score is the most probability a second-pass query head gave it,
    averaged over its KV head's group (plus the layer's mean over KV heads); a layer's composite tokens are its
    heads' sorted scores averaged rank by rank, the first layer's raised to every layer's most; the
    ``layers × heads × budget`` best composite tokens give each layer its count (at least one), and each head
    keeps that many of its best."""
    n = attentions[0].shape[1]
    scores = []
    for probs in attentions:
        most = probs[:, :, :n].max(axis=1)  # [query heads, n]
        per_kv = most.reshape(HEADS, GROUP, n).mean(axis=1)
        if mean_across_heads:
            per_kv = per_kv + per_kv.mean(axis=0, keepdims=True)
        scores.append(per_kv)
    composite = np.stack([-np.sort(-s, axis=1).mean(axis=0) for s in scores])  # [layers, n]
    composite[0] = composite.max(axis=0)
    best = np.argsort(-composite.reshape(-1), kind="stable")[: LAYERS * budget]
    counts = np.maximum(np.bincount(best // n, minlength=LAYERS), 1)
    return [
        [set(np.argsort(-s[h], kind="stable")[: counts[layer]].tolist()) for h in range(HEADS)]
        for layer, s in enumerate(scores)
    ]


def kept_sets(generation) -> list[list[set[int]]]:
    return [[set(row.tolist()) for row in layer] for layer in generation.trace[0]]


@pytest.mark.parametrize("mean_across_heads", [True, False])
@pytest.mark.parametrize("seed, budget", [(41, 12), (42, 25)])
def test_kept_sets_are_the_rule_on_the_models_own_second_pass(tiny, random_ids, mean_across_heads, seed, budget):
    ids = random_ids(PROMPT, seed=seed)
    cfg = tiny_policy_cfg("kvcompose", score={"mean_across_heads": mean_across_heads})
    g = generate(
        tiny.model, None, ids, build_policy(cfg), budget, "prefill", DecodeSettings(max_new_tokens=1), trace=True
    )
    want = reference_kept(second_pass_attention(tiny.model, ids), budget, mean_across_heads)
    got = kept_sets(g)
    assert len(g.trace) == 1  # one prompt forward as the run records it, the second pass folded into it
    assert got == want
    per_layer = [len(layer[0]) for layer in got]
    assert all(len(h) == per_layer[i] for i, layer in enumerate(got) for h in layer)  # a layer's heads: one count
    assert len(set(per_layer)) > 1 and sum(per_layer) == LAYERS * budget  # layers really differ
    assert g.measures.kv_resident_bytes == HEADS * sum(per_layer) * ENTRY_BYTES  # rows hold what they keep


def test_a_reread_prompt_goes_on_from_its_end_and_a_prompt_that_fits_is_fed_once(tiny, random_ids):
    """A budget of the prompt evicts nothing: the prompt is fed once and decodes as the full cache. One token
    short, the second pass runs and is dropped: the first token comes from the first pass (the full cache's
    logits), and the decode steps feed positions n, n + 1, ... (not 2n)."""
    ids = random_ids(PROMPT, seed=43)
    settings = DecodeSettings(max_new_tokens=6)
    policy = build_policy(tiny_policy_cfg("kvcompose"))
    full = generate(
        tiny.model, None, ids, build_policy(tiny_policy_cfg("full")), 1.0, "prefill", settings, return_logits=True
    )
    fits = generate(tiny.model, None, ids, policy, PROMPT, "prefill", settings)
    assert fits.tokens == full.tokens
    g = generate(tiny.model, None, ids, policy, PROMPT - 1, "prefill", settings, trace=True, return_logits=True)
    torch.testing.assert_close(g.logits[0], full.logits[0])
    assert sum(len(set(row.tolist())) for layer in g.trace[0] for row in layer) == LAYERS * HEADS * (PROMPT - 1)
    assert all(int(row.max()) == PROMPT + 4 for layer in g.trace[-1] for row in layer)  # 5 decode steps: n .. n + 4


@pytest.mark.parametrize("seed", range(4))
def test_composite_counts_on_scores_made_by_hand(seed):
    """Three layers of two heads; protected entries (+inf) rank first and padding never counts."""
    rng = np.random.default_rng(seed)
    units, n, budget = 3, 12, 4
    scores = rng.standard_normal((units * HEADS, n)).astype(np.float32)
    scores[1, 3] = np.inf
    got = Composite().keep(torch.tensor(scores), None, budget, units=units).numpy()
    composite = np.stack([-np.sort(-scores[u * HEADS : (u + 1) * HEADS], axis=1).mean(axis=0) for u in range(units)])
    composite[0] = composite.max(axis=0)
    best = np.argsort(-composite.reshape(-1), kind="stable")[: units * budget]  # ties to the lower layer
    counts = np.maximum(np.bincount(best // n, minlength=units), 1)
    for row in range(units * HEADS):
        want = np.zeros(n, dtype=bool)
        want[np.argsort(-scores[row], kind="stable")[: counts[row // HEADS]]] = True
        assert np.array_equal(got[row], want), row
    assert got[1, 3]


def test_decode_and_a_stride_are_refused():
    policy = build_policy(tiny_policy_cfg("kvcompose"))
    assert set(policy.unsupported_stages or ()) == {"decode", "both"}
    assert policy.whole_prompt and policy.rereads
