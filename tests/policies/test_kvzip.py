"""KVzip and KVzip+ (configs/policy/kvzip.yaml, kvzip_plus.yaml) against the model's own eager attention: each
replay pass is the prompt followed by the pass's ids, run by transformers with ``attn_implementation="eager"``
and ``output_attentions=True``; a pass's softmax over the sinks, its chunk and its own tokens is the eager
probabilities renormalised over those keys, and an entry's score is the largest over the pass's queries and the
KV head's query heads. KVzip+ divides by the norm of the attention's input (read by a hook on the model's
attention module) and multiplies by ‖W_o v‖ of the query head (the module's own o_proj)."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import CONFIG_DIR
from engine_run import generate
from omegaconf import OmegaConf

from kvbench.engine import replay_pass
from kvbench.engine.engine import DecodeSettings
from kvbench.engine.replay import passes
from kvbench.policies.base import ScoreWrapper
from kvbench.policies.registry import build_policy

pytestmark = pytest.mark.usefixtures("one_thread")
CHUNK, N_SINK = 7, 2
ONE = DecodeSettings(max_new_tokens=1)


def config(name: str, **score) -> dict:
    cfg = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "policy" / f"{name}.yaml"), resolve=True)
    cfg["score"].update(score)
    cfg["scope"]["n_sink"] = cfg["score"]["n_sink"]
    return cfg


class Probe(ScoreWrapper):
    """The inner score, recording what it gives each (layer, KV head, position) at the eviction."""

    def __init__(self, inner, layers: int, heads: int, n: int):
        super().__init__(inner)
        self.heads = heads
        self.got = torch.full((layers, heads, n), float("nan"))

    def __call__(self, view):
        out = self.inner(view)
        valid = view.valid_mask()
        for row, key in enumerate(view.row_keys[:, 0].tolist()):
            layer, head = divmod(int(key), self.heads)
            self.got[layer, head, view.positions[row][valid[row]]] = out[row][valid[row]].float()
        return out


def kvbench_scores(model, ids: list[int], cfg: dict) -> torch.Tensor:
    """replay_max [layers, kv heads, n] as the eviction read it."""
    policy = build_policy(cfg)
    probe = Probe(policy.score, model.config.num_hidden_layers, model.config.num_key_value_heads, len(ids))
    policy.score = probe
    generate(model, None, ids, policy, 0.5, "prefill", DecodeSettings(max_new_tokens=1))
    return probe.got


def eager_scores(model, ids: list[int], policy_cfg: dict) -> torch.Tensor:
    """The same from transformers' eager attention, one forward of prompt + pass per replay pass."""
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    cfg = eager.config
    layers, hkv, hq = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.num_attention_heads
    group = hq // hkv
    n = len(ids)
    want = torch.zeros(layers, hkv, n)
    attn_modules = [layer.self_attn for layer in eager.model.layers]
    plus, replay = policy_cfg["score"]["plus"], build_policy(policy_cfg).replay
    assert replay is not None
    for span, replayed in passes(None, ids, replay):
        inputs: dict[int, torch.Tensor] = {}
        hooks = [
            m.register_forward_pre_hook(
                lambda mod, args, kwargs, i=i, got=inputs: got.__setitem__(i, kwargs["hidden_states"][0]),
                with_kwargs=True,
            )
            for i, m in enumerate(attn_modules)
        ]
        with torch.no_grad():
            out = eager(torch.tensor([ids + replayed]), output_attentions=True, use_cache=True)
        for h in hooks:
            h.remove()
        q = len(replayed)
        for layer in range(layers):
            chunk = chunk_probabilities(out.attentions[layer][0], span, n)  # [hq, q, c]
            if plus:
                wov = value_output_norms(out, attn_modules[layer], layer, span, group)  # [hq, c]
                chunk = chunk / inputs[layer][n:].norm(dim=-1).view(1, q, 1) * wov.unsqueeze(1)
            best = chunk.amax(dim=1).view(hkv, group, -1).amax(dim=1)
            want[layer, :, span.start : span.end] = best
    return want


def chunk_probabilities(attentions: torch.Tensor, span, n: int) -> torch.Tensor:
    """A pass's eager probabilities [hq, n + q, n + q] renormalised over the sinks, the chunk and the pass's own
    tokens, at the pass's queries and the chunk's keys: [hq, q, c]."""
    subset = torch.zeros(attentions.shape[-1], dtype=torch.bool)
    subset[: span.sinks] = True
    subset[span.start : span.end] = True
    subset[n:] = True
    probs = attentions[:, n:, :] * subset
    return (probs / probs.sum(dim=-1, keepdim=True))[:, :, span.start : span.end]


def value_output_norms(out, attn, layer: int, span, group: int) -> torch.Tensor:
    """‖W_o v‖ of the chunk's values per query head [hq, c], from the eager cache and the module's o_proj."""
    values = out.past_key_values.layers[layer].values[0, :, span.start : span.end]  # [hkv, c, D]
    hq = values.shape[0] * group
    w_o = attn.o_proj.weight.view(attn.o_proj.weight.shape[0], hq, values.shape[-1])
    return torch.stack([(values[head // group] @ w_o[:, head].T).norm(dim=-1) for head in range(hq)])


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "materialised"])
@pytest.mark.parametrize("name", ["kvzip", "kvzip_plus"])
def test_replay_scores_equal_the_models_eager_attention(tiny, random_ids, name, fused, monkeypatch):
    """Three passes of 7 tokens over a 20-token prompt (the last pass shorter, each after the previous chunk's
    last tokens): every entry's score equals the eager reference, sinks included (they are protected: +inf
    would be the shield's, the score itself is what the passes gave them: 0 outside every chunk). Both ways a
    pass is computed: fused attention (CPU) and materialised logits (elsewhere, or softcapped, or windowed)."""
    if not fused:
        monkeypatch.setattr(replay_pass, "_fusable", lambda query, access: False)
    ids = random_ids(20, seed=3)
    cfg = config(name, chunk=CHUNK, n_sink=N_SINK, postfix=3)
    got = kvbench_scores(tiny.model, ids, cfg)
    want = eager_scores(tiny.model, ids, cfg)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def kept_sets(generation) -> list[list[set[int]]]:
    """Per layer and KV head, the positions held after the prompt, its last forward's trace entry (one token
    generated: no decode forward; the trace pads a short row with its newest position)."""
    return [[set(row.tolist()) for row in layer] for layer in generation.trace[-1]]


@pytest.mark.parametrize(("n", "budget", "per_row"), [(20, 6, 6), (21, 0.5, 11)])
@pytest.mark.parametrize("name", ["kvzip", "kvzip_plus"])
def test_resident_bytes_are_the_entries_the_rows_hold(tiny, random_ids, name, n, budget, per_row):
    """After the passes, the rows hold the budget in all (one top-k over every layer and KV head, the sinks among
    the kept, not on top; a fraction of the prompt rounds up: half of 21 is 11 a row) and none of the passes'
    own entries: resident KV bytes are the held entries counted from the kept positions times a key and a value
    of float32 each; the most held at a step's end is the whole prompt (kept through the passes)."""
    cfg = config(name, chunk=CHUNK, n_sink=N_SINK)
    g = generate(tiny.model, None, random_ids(n, seed=5), build_policy(cfg), budget, "prefill", ONE, trace=True)
    layers, heads = tiny.model.config.num_hidden_layers, tiny.model.config.num_key_value_heads
    entry_bytes = 2 * (tiny.model.config.hidden_size // tiny.model.config.num_attention_heads) * 4
    kept = kept_sets(g)
    held = sum(len(row) for layer in kept for row in layer)
    assert held == layers * heads * per_row
    assert all(sinks <= row for layer in kept for row in layer for sinks in [set(range(N_SINK))])
    assert all(p < n for layer in kept for row in layer for p in row)  # no pass entry is left
    assert g.measures.kv_resident_bytes == held * entry_bytes
    assert g.measures.kv_resident_peak_bytes == layers * heads * n * entry_bytes


@pytest.mark.parametrize("name", ["kvzip", "kvzip_plus"])
def test_a_prefill_stride_keeps_what_one_chunk_keeps(tiny, random_ids, name):
    """The passes run after the whole prompt is fed, whatever the stride: a prompt fed 6 tokens at a time keeps
    the same entries as one fed at once (the scores agree to float rounding; the kept sets exactly)."""
    ids = random_ids(20, seed=6)
    cfg = config(name, chunk=CHUNK, n_sink=N_SINK)
    runs = [
        generate(tiny.model, None, ids, build_policy(cfg), 6, "prefill", ONE, stride=stride, trace=True)
        for stride in (None, 6)
    ]
    assert kept_sets(runs[1]) == kept_sets(runs[0])
