"""KVgrad (configs/policy/kvgrad.yaml) against transformers' eager attention and autograd: each replay pass is the
prompt followed by the pass's ids, one eager forward from the embeddings (a leaf) with ``output_attentions``;
Φ = Σ ‖h‖² over the pass's positions of the last decoder layer's output is back-propagated, and each pass query's
weight is the norm of the gradient at its attention module's output (a hook keeps it). A pass's reconstruction
softmax is the eager probabilities renormalised over the sinks, the chunk and its own tokens; an entry's score is
the largest over the pass's queries and its KV head's query heads of probability × ‖W_o v‖ × weight."""

from __future__ import annotations

import copy

import pytest
import torch
from engine_run import generate
from family_models import build
from test_kvzip import CHUNK, N_SINK, ONE, chunk_probabilities, config, kept_sets, kvbench_scores, value_output_norms

from kvbench.engine.replay import passes
from kvbench.policies.registry import build_policy

pytestmark = pytest.mark.usefixtures("one_thread")


def autograd_scores(model, ids: list[int], cfg: dict) -> torch.Tensor:
    """The scores from eager attention and autograd, one forward and one backward of prompt + pass per pass."""
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    eager.requires_grad_(False)
    conf = eager.config
    layers, hkv, hq = conf.num_hidden_layers, conf.num_key_value_heads, conf.num_attention_heads
    group = hq // hkv
    n = len(ids)
    want = torch.zeros(layers, hkv, n)
    attn_modules = [layer.self_attn for layer in eager.model.layers]
    replay = build_policy(cfg).replay
    assert replay is not None and replay.gradient
    for span, replayed in passes(None, ids, replay):
        outputs: dict[int, torch.Tensor] = {}
        last: list[torch.Tensor] = []

        def keep(module, args, output, i, got=outputs):
            output[0].retain_grad()
            got[i] = output[0]

        hooks = [m.register_forward_hook(lambda mod, a, o, i=i: keep(mod, a, o, i)) for i, m in enumerate(attn_modules)]
        hooks.append(eager.model.layers[-1].register_forward_hook(lambda mod, a, o, got=last: got.append(o)))
        embeds = eager.model.embed_tokens(torch.tensor([ids + replayed])).detach().requires_grad_(True)
        out = eager(inputs_embeds=embeds, output_attentions=True, use_cache=True)
        last[0][0, n:].square().sum().backward()
        for h in hooks:
            h.remove()
        q = len(replayed)
        with torch.no_grad():
            for layer in range(layers):
                if (getattr(conf, "layer_types", None) or ["full_attention"] * layers)[layer] != "full_attention":
                    continue  # a sliding layer keeps its window (its cache holds only that): not scored
                chunk = chunk_probabilities(out.attentions[layer][0], span, n)  # [hq, q, c]
                wov = value_output_norms(out, attn_modules[layer], layer, span, group)  # [hq, c]
                weight = outputs[layer].grad[0, n:].norm(dim=-1)  # [q]
                chunk = chunk * wov.unsqueeze(1) * weight.view(1, q, 1)
                best = chunk.amax(dim=1).view(hkv, group, -1).amax(dim=1)
                want[layer, :, span.start : span.end] = best
    return want


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2-softcap", "gemma3"])
def test_scores_equal_eager_attention_times_autograd_gradients(random_ids, family):
    """Three passes of 7 tokens over a 20-token prompt: every entry's score equals the autograd reference (sinks
    outside the first chunk score 0 there: no pass repeats them). Families with q/k norms (Qwen3), softcapped
    logits and a post-attention norm (Gemma 2), and sliding layers (Gemma 2 and 3: a sliding layer keeps its
    window and is not scored, but the gradient flows through it)."""
    model = build(family)
    ids = random_ids(20, seed=3)
    cfg = config("kvgrad", chunk=CHUNK, n_sink=N_SINK, postfix=3)
    got = kvbench_scores(model, ids, cfg)
    want = autograd_scores(model, ids, cfg)
    scored = ~got.isnan().all(dim=-1).all(dim=-1)  # the layers whose policy evicts by the score
    assert bool(scored.any()) and bool(want[scored].gt(0).any())
    torch.testing.assert_close(got[scored], want[scored], rtol=1e-4, atol=1e-7)


def test_the_gradient_weighs_the_queries(tiny, random_ids):
    """The gradient's weights matter: KVgrad's scores are not KVzip's times one constant per layer (a reference
    whose gradient were ignored would pass the test above only where every query's weight is equal)."""
    ids = random_ids(20, seed=3)
    grad = kvbench_scores(tiny.model, ids, config("kvgrad", chunk=CHUNK, n_sink=N_SINK, postfix=3))
    plain = kvbench_scores(tiny.model, ids, config("kvzip", chunk=CHUNK, n_sink=N_SINK, postfix=3))
    ratio = grad[:, :, N_SINK:] / plain[:, :, N_SINK:]
    assert float((ratio.amax(dim=-1) / ratio.amin(dim=-1)).min()) > 1.01


def test_the_model_is_left_as_it_was(tiny, random_ids):
    """The backward freezes the weights only for its pass: they require gradients again after, and hold none."""
    before = [p.requires_grad for p in tiny.model.parameters()]
    generate(tiny.model, None, random_ids(20, seed=4), build_policy(config("kvgrad", chunk=CHUNK)), 6, "prefill", ONE)
    assert [p.requires_grad for p in tiny.model.parameters()] == before
    assert all(p.grad is None for p in tiny.model.parameters())


@pytest.mark.parametrize(("n", "budget", "per_row"), [(20, 6, 6), (21, 0.5, 11)])
def test_resident_bytes_are_the_entries_the_rows_hold(tiny, random_ids, n, budget, per_row):
    """As KVzip's: one top-k over every layer and KV head, sinks kept, no pass entry left; resident bytes are the
    held entries × a float32 key and value; the peak is the whole prompt."""
    cfg = config("kvgrad", chunk=CHUNK, n_sink=N_SINK)
    g = generate(tiny.model, None, random_ids(n, seed=5), build_policy(cfg), budget, "prefill", ONE, trace=True)
    layers, heads = tiny.model.config.num_hidden_layers, tiny.model.config.num_key_value_heads
    entry_bytes = 2 * (tiny.model.config.hidden_size // tiny.model.config.num_attention_heads) * 4
    kept = kept_sets(g)
    held = sum(len(row) for layer in kept for row in layer)
    assert held == layers * heads * per_row
    assert all(set(range(N_SINK)) <= row for layer in kept for row in layer)
    assert all(p < n for layer in kept for row in layer for p in row)
    assert g.measures.kv_resident_bytes == held * entry_bytes
    assert g.measures.kv_resident_peak_bytes == layers * heads * n * entry_bytes


@pytest.mark.parametrize(
    ("extra", "needle"),
    [({"quantize": "int8"}, "policy.quantize"), ({"positions": "reindex"}, "policy.positions")],
)
def test_a_cache_that_stores_keys_changed_is_refused(extra, needle):
    with pytest.raises(ValueError, match=needle):
        build_policy({**config("kvgrad"), **extra})
