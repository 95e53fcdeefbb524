"""TriAttention (``policy=triattention``): the score against NumPy from the paper's equations on small tensors,
the calibration measured from the model's own queries, the decode-time rule on a tiny model (the prompt
protected, the budget every β steps, resident bytes counted by hand), and the refusals of a missing or another
model's calibration."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import tiny_policy_cfg
from engine_run import generate

from kvbench.engine.engine import DecodeSettings
from kvbench.families import policy_problem
from kvbench.models import tiny_llama_config
from kvbench.policies.positions import Rotary, RowRope
from kvbench.policies.query_centres import QueryCentres, describe
from kvbench.policies.registry import build_policy
from kvbench.policies.scores.triattention import TriAttentionScore
from kvbench.policies.state import TokenState
from kvbench.profile.query_centres import measure

pytestmark = pytest.mark.usefixtures("one_thread")
LAYERS, HEADS, QHEADS, D = 4, 2, 4, 16  # tiny-llama
ENTRY_BYTES = 2 * D * 4


def reference_scores(centre, pair_norm, keys_pre, positions, t, offsets, inv_freq, scale, kv_head):
    """The paper's score of each key of one KV head, from its equations: per query head h of the group and RoPE
    pair f (complex, rotate-half layout), with q̄ the centre and k the key before RoPE,
    mean over d of Σ_f s²|q̄_f||k_f| cos(ω_f (t - p + d) + arg q̄_f - arg k_f) + Σ_f s² (E|q_f| - |q̄_f|)|k_f|,
    the most over the group's query heads."""
    half = D // 2
    k = keys_pre[:, :half] + 1j * keys_pre[:, half:]  # [n, F]
    group = QHEADS // HEADS
    out = []
    for h in range(kv_head * group, (kv_head + 1) * group):
        q = centre[h, :half] + 1j * centre[h, half:]
        amp = np.abs(q)[None, :] * np.abs(k) * scale**2
        phase = np.angle(q)[None, :] - np.angle(k)
        delta = (t - positions)[:, None, None] + np.asarray(offsets)[None, :, None]  # [n, d, 1]
        series = (amp[:, None, :] * np.cos(delta * inv_freq[None, None, :] + phase[:, None, :])).sum(-1).mean(1)
        norm = ((pair_norm[h] - np.abs(q))[None, :] * np.abs(k) * scale**2).sum(-1)
        out.append(series + norm)
    return np.max(out, axis=0)


def rotate_half_np(x, positions, inv_freq, scale):
    half = D // 2
    angle = positions[:, None] * inv_freq[None, :]
    a, b = x[:, :half], x[:, half:]
    cos, sin = np.cos(angle) * scale, np.sin(angle) * scale
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=1)


@pytest.mark.parametrize("scale", [1.0, 1.3])
@pytest.mark.parametrize("max_offset", [1, 100, 65536])
def test_score_is_the_papers_series_plus_norm_term(tmp_path, scale, max_offset):
    rng = np.random.default_rng(7)
    n, layer, t = 9, 2, 57
    centre = rng.standard_normal((LAYERS, QHEADS, D)).astype(np.float32)
    pair_norm = (np.abs(rng.standard_normal((LAYERS, QHEADS, D // 2))) + 1.0).astype(np.float32)
    path = tmp_path / "c.npz"
    QueryCentres(torch.tensor(centre), torch.tensor(pair_norm), describe(tiny_llama_config()), 10).save(path)
    inv_freq = (1.0 / 10000 ** (np.arange(0, D, 2) / D)).astype(np.float32)
    positions = np.sort(rng.choice(t, n, replace=False)).astype(np.int64)
    pre = rng.standard_normal((HEADS, n, D)).astype(np.float32)
    stored = np.stack([rotate_half_np(pre[j], positions, inv_freq, scale) for j in range(HEADS)])
    rope = RowRope([(Rotary(torch.tensor(inv_freq), "half", scale), 0, HEADS)], stored_rotated=True)
    view = TokenState(
        keys=torch.tensor(stored),
        values=torch.zeros(HEADS, n, D),
        positions=torch.tensor(positions).expand(HEADS, n),
        phase="decode",
        seen=torch.full((HEADS, 1), t),
        row_keys=torch.tensor([[layer * HEADS], [layer * HEADS + 1]]),
        rope=rope,
    )
    got = TriAttentionScore(str(path), max_offset)(view).numpy()
    offsets = [2**i for i in range(max_offset.bit_length())]
    for j in range(HEADS):
        want = reference_scores(centre[layer], pair_norm[layer], pre[j], positions, t, offsets, inv_freq, scale, j)
        np.testing.assert_allclose(got[j], want, rtol=2e-4, atol=2e-4)


def test_calibration_is_the_mean_pre_rope_query_of_each_head(tiny, random_ids):
    """The model's own queries before RoPE (q_proj's output, read by a hook), averaged per head: the centre, and
    the mean modulus of each rotate-half pair."""
    ids = random_ids(40, seed=51)
    captured = {}
    hooks = [
        layer.self_attn.q_proj.register_forward_hook(lambda m, i, o, k=k: captured.__setitem__(k, o[0].detach()))
        for k, layer in enumerate(tiny.model.model.layers)
    ]
    try:
        with torch.no_grad():
            tiny.model(input_ids=torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    got = measure(tiny.model, ids)
    for layer in range(LAYERS):
        q = captured[layer].view(len(ids), QHEADS, D).numpy()
        np.testing.assert_allclose(got.centre[layer].numpy(), q.mean(axis=0), rtol=1e-4, atol=1e-5)
        moduli = np.sqrt(q[..., : D // 2] ** 2 + q[..., D // 2 :] ** 2).mean(axis=0)
        np.testing.assert_allclose(got.pair_norm[layer].numpy(), moduli, rtol=1e-4, atol=1e-5)
    assert got.model == describe(tiny.model.config) and got.tokens == len(ids)


@pytest.fixture
def calibrated(tiny, random_ids, tmp_path):
    path = tmp_path / "centres.npz"
    measure(tiny.model, random_ids(64, seed=52)).save(path)
    return str(path)


def test_decode_keeps_the_prompt_and_trims_to_the_budget_every_beta_steps(tiny, random_ids, calibrated):
    prompt, budget, beta, new = 12, 20, 4, 30
    cfg = tiny_policy_cfg("triattention", score={"calibration": calibrated}, interval=beta)
    g = generate(
        tiny.model,
        None,
        random_ids(prompt, seed=53),
        build_policy(cfg),
        budget,
        "decode",
        DecodeSettings(max_new_tokens=new),
        trace=True,
    )
    held = [[len(set(row.tolist())) for row in layer] for layer in g.trace[-1]]
    for layers in g.trace[1:]:  # the decode steps' forwards
        for layer in layers:
            for row in layer:
                kept = set(row.tolist())
                assert set(range(prompt)) <= kept  # the prompt is protected
                grown = len(kept) - budget
                assert grown < beta  # at most β - 1 past the budget between trims
    assert any(len({tuple(sorted(set(r.tolist()))) for r in layer}) > 1 for layer in g.trace[-1])  # heads differ
    assert g.measures.kv_resident_bytes == sum(map(sum, held)) * ENTRY_BYTES


def test_a_missing_or_foreign_calibration_is_refused_from_the_config(tmp_path, calibrated):
    config = tiny_llama_config()
    unset = build_policy(tiny_policy_cfg("triattention"))
    assert "measure them with python -m kvbench.profile.query_centres" in policy_problem(config, unset)
    missing = build_policy(tiny_policy_cfg("triattention", score={"calibration": str(tmp_path / "none.npz")}))
    assert "is not a file" in policy_problem(config, missing)
    other = tiny_llama_config()
    other.num_hidden_layers = 6
    mine = build_policy(tiny_policy_cfg("triattention", score={"calibration": calibrated}))
    assert policy_problem(config, mine) is None
    assert "measured on another model (layers 4 here, 6 in the model)" in policy_problem(other, mine)


def test_each_trim_keeps_the_papers_best_generated_keys_of_the_models_own(tiny, random_ids, calibrated):
    """At every trim, each row keeps the prompt and the generated keys the NumPy score ranks highest, computed from
    the keys the model's k_proj produced in this very run (hooked, before RoPE), the calibration file's centres,
    and tiny-llama's RoPE frequencies (θ = 10000): nothing of kvbench's cache or score on this side."""
    prompt, budget, beta, new = 12, 20, 4, 30
    keys: dict[int, list[torch.Tensor]] = {layer: [] for layer in range(LAYERS)}
    hooks = [
        layer.self_attn.k_proj.register_forward_hook(lambda m, i, o, k=k: keys[k].append(o[0].detach().clone()))
        for k, layer in enumerate(tiny.model.model.layers)
    ]
    cfg = tiny_policy_cfg("triattention", score={"calibration": calibrated}, interval=beta)
    try:
        g = generate(
            tiny.model,
            None,
            random_ids(prompt, seed=54),
            build_policy(cfg),
            budget,
            "decode",
            DecodeSettings(max_new_tokens=new),
            trace=True,
            fused=False,  # the model's own modules, so that the hooks see every key
        )
    finally:
        for h in hooks:
            h.remove()
    with np.load(calibrated) as c:
        centre, pair_norm = c["centre"], c["pair_norm"]
    inv_freq = 1.0 / 10000 ** (np.arange(0, D, 2) / D)
    offsets = [2**i for i in range((65536).bit_length())]
    trims = 0
    for k in range(beta, len(g.trace), beta):  # forward k is the k-th decode step: it feeds position prompt + k - 1
        fed = prompt + k - 1
        for layer in range(LAYERS):
            pre = torch.cat(keys[layer]).view(-1, HEADS, D).numpy()  # every position fed, in order
            for j in range(HEADS):
                candidates = np.array(sorted(set(g.trace[k - 1][layer][j].tolist()) | {fed}))
                generated = candidates[candidates >= prompt]
                scores = reference_scores(
                    centre[layer], pair_norm[layer], pre[generated, j], generated, fed + 1, offsets, inv_freq, 1.0, j
                )
                want = set(generated[np.argsort(-scores, kind="stable")[: budget - prompt]].tolist())
                got = set(g.trace[k][layer][j].tolist())
                assert got == set(range(prompt)) | want, (k, layer, j)
                trims += 1
    assert trims == LAYERS * HEADS * ((len(g.trace) - 1) // beta)
