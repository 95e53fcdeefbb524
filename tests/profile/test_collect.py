"""A tiny model's profile, gathered in query blocks through the profiling attention, against the family's own
eager attention (``output_attentions``) reduced and measured in NumPy; its output against the family's logits."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from family_models import build

from kvbench.engine import blocked
from kvbench.families import layer_windows
from kvbench.profile.collect import record
from kvbench.profile.consistency import bare_scores, layer_budgets, layer_recall

PROMPT, CONTINUATION, N_SINK, N_RECENT, MAX_AGE = 30, 10, 2, 5, 12


def eager_attention(model, ids: list[int]) -> list[np.ndarray]:
    """Per layer, the family's probabilities [KV heads, n, n]: the mean over each GQA group's query heads."""
    model.set_attn_implementation("eager")
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), output_attentions=True, use_cache=False)
    hkv = model.config.num_key_value_heads
    return [a[0].double().numpy().reshape(hkv, -1, len(ids), len(ids)).mean(axis=1) for a in out.attentions]


def numpy_profile(attn: np.ndarray, window: int | None) -> dict[str, np.ndarray]:
    rows = attn[:, :PROMPT, :PROMPT]
    q = np.arange(PROMPT)[:, None]
    k = np.arange(PROMPT)[None, :]
    visible = (k <= q) & ((q - k < window) if window else True)
    with np.errstate(divide="ignore", invalid="ignore"):
        ent = -np.where(rows > 0, rows * np.log(rows), 0.0).sum(-1)
    ranked = -np.sort(-rows, axis=-1)
    cover = ((np.cumsum(ranked, -1) < 0.9 * ranked.sum(-1, keepdims=True) - 1e-6).sum(-1) + 1) / visible.sum(-1)
    std = np.full((attn.shape[0], MAX_AGE), np.nan)
    for age in range(MAX_AGE):
        sel = visible & (q - k == age)
        if sel.any():
            std[:, age] = rows[:, sel].std(axis=-1)
    return {
        "entropy": ent.mean(-1),
        "sink": rows[..., :N_SINK].sum(-1).mean(-1),
        "recent": np.where((q - k < N_RECENT) & visible, rows, 0).sum(-1).mean(-1),
        "coverage90": cover.mean(-1),
        "std": std,
        "future": attn[:, PROMPT:, :PROMPT].sum(1),
    }


@pytest.mark.parametrize("family", ["llama", "gemma2-softcap", "gemma3", "mistral-window"])
def test_profile_matches_eager_attention(family, random_ids, one_thread, monkeypatch):
    monkeypatch.setattr(blocked, "STATS_BLOCK_ELEMENTS", 4 * 16 * 7)  # several query blocks per layer
    model = build(family)
    if family == "gemma2-softcap":  # a cap the tiny model's small logits reach, so that softcapping shows
        for layer in model.model.layers:
            layer.self_attn.attn_logit_softcapping = 0.05
    ids = random_ids(PROMPT + CONTINUATION, seed=3)
    got = record(
        model, ids[:PROMPT], ids[PROMPT:], lambda layer, p, e: p, max_age=MAX_AGE, n_sink=N_SINK, n_recent=N_RECENT
    )
    windows = layer_windows(model.config)
    for layer, attn in enumerate(eager_attention(model, ids)):
        ref, p = numpy_profile(attn, windows[layer]), got[layer]
        assert np.allclose(p.entropy.numpy() / PROMPT, ref["entropy"], atol=1e-5)
        assert np.allclose(p.sink.numpy() / PROMPT, ref["sink"], atol=1e-5)
        assert np.allclose(p.recent.numpy() / PROMPT, ref["recent"], atol=1e-5)
        assert np.allclose(p.coverage[0].numpy() / PROMPT, ref["coverage90"], atol=1e-5)
        count, total, squares = p.age.numpy()
        with np.errstate(invalid="ignore"):  # ages no token reached: NaN on both sides
            std = np.sqrt(np.maximum(squares / count - (total / count) ** 2, 0))
        assert np.allclose(std, ref["std"], atol=1e-5, equal_nan=True)
        assert np.allclose(p.future.numpy(), ref["future"], atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_profiled_forward_gives_the_family_logits(family, random_ids, one_thread):
    model = build(family)
    ids = random_ids(PROMPT + CONTINUATION, seed=4)
    with torch.no_grad():
        want = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]
    from kvbench.profile.collect import PROFILE_ATTN

    model.set_attn_implementation(PROFILE_ATTN)
    from kvbench.profile.collect import Recorder

    recorder = Recorder(PROMPT, layer_windows(model.config), 4, 8, 4, 8, lambda layer, p, e: None)
    with torch.no_grad():
        got = model(input_ids=torch.tensor([ids]), use_cache=False, kvbench_profile=recorder).logits[0, -1]
    assert torch.allclose(got, want, atol=1e-4)


def test_accumulated_recall_matches_numpy(random_ids, one_thread):
    """H2O's kept set (top-B of the attention the prompt's queries paid each key), measured against the future
    mass, both from the family's eager attention."""
    model = build("llama")
    ids = random_ids(PROMPT + CONTINUATION, seed=5)
    policies = bare_scores(["accumulated", "recency"])
    asked = [3, 10, 29, 30]
    budgets = layer_budgets(policies, asked, PROMPT, layer_windows(model.config))
    got = record(
        model, ids[:PROMPT], ids[PROMPT:], lambda layer, p, e: layer_recall(layer, p.future, e, policies, budgets)
    )
    for layer, attn in enumerate(eager_attention(model, ids)):
        acc = attn[:, :PROMPT, :PROMPT].sum(1)
        future = attn[:, PROMPT:, :PROMPT].sum(1)
        for i, b in enumerate(asked):
            kept = np.argsort(-acc, axis=-1)[:, :b]
            recent = np.arange(PROMPT - b, PROMPT)
            want = np.mean([future[h, kept[h]].sum() / future[h].sum() for h in range(future.shape[0])])
            want_recent = np.mean(future[:, recent].sum(-1) / future.sum(-1))
            assert got[layer]["accumulated"][i] == pytest.approx(want, abs=1e-5)
            assert got[layer]["recency"][i] == pytest.approx(want_recent, abs=1e-5)
            assert got[layer]["oracle"][i] >= max(got[layer]["accumulated"][i], got[layer]["recency"][i]) - 1e-6
        assert got[layer]["accumulated"][-1] == pytest.approx(1.0)
