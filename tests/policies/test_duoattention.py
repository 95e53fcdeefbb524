"""DuoAttention (configs/policy/duoattention.yaml) against its rule in NumPy, as kvpress's on-the-fly scoring reads
it: per KV head, the mean prompt query (before RoPE) rotated to position L - 1 attends L copies of the mean prompt key
rotated to positions 0 … L - 1; the head's score is the mean of that attention's cumulative sum over its GQA group;
the lowest ``round(heads × head_ratio)`` of a sequence's heads, every layer ranked together, keep their sinks and
recent window, the others everything."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import CONFIG_DIR
from engine_run import generate
from omegaconf import OmegaConf

from kvbench.engine.engine import DecodeSettings
from kvbench.policies.positions import Rotary, RowRope
from kvbench.policies.registry import build_policy
from kvbench.policies.state import TokenState

pytestmark = pytest.mark.usefixtures("one_thread")


def rope(x: np.ndarray, positions: np.ndarray, theta: float) -> np.ndarray:
    """x [..., D] rotated at ``positions`` [...] by Llama's RoPE (halves paired)."""
    half = x.shape[-1] // 2
    angle = positions[..., None] * theta ** (-np.arange(half) / half)
    cos, sin = np.cos(angle), np.sin(angle)
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def numpy_head_scores(queries: np.ndarray, keys: np.ndarray, length: int, theta: float) -> np.ndarray:
    """One layer: ``queries`` [query heads, n, D] and ``keys`` [KV heads, n, D], both before RoPE. [KV heads]."""
    group = queries.shape[0] // keys.shape[0]
    q = rope(queries.mean(axis=1), np.array(length - 1.0), theta)  # [Hq, D]
    k = rope(np.repeat(keys.mean(axis=1), group, axis=0)[:, None, :], np.arange(length, dtype=float), theta)
    logits = np.einsum("hd,hnd->hn", q, k) / np.sqrt(q.shape[-1])
    p = np.exp(logits - logits.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    return np.cumsum(p, axis=-1).mean(axis=-1).reshape(-1, group).mean(axis=1)


def numpy_kept(scores: np.ndarray, ratio: float, n: int, n_sink: int, n_recent: int) -> list[set[int]]:
    """Per row (every layer's KV heads, flattened), the positions it keeps."""
    streaming = set(np.argsort(scores, kind="stable")[: round(scores.size * ratio)].tolist())
    window = set(range(min(n_sink, n))) | set(range(max(n - n_recent, 0), n))
    return [window if row in streaming else set(range(n)) for row in range(scores.size)]


def policy(**score):
    cfg = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "policy" / "duoattention.yaml"), resolve=True)
    cfg["score"].update(score)
    return build_policy(cfg)


def hand_state(rng: np.random.Generator, layers: int, heads: int, group: int, n: int, dim: int, theta: float):
    """A state of ``layers`` units of ``heads`` rows, keys stored rotated at 0 … n - 1, queries before RoPE."""
    queries = rng.normal(size=(layers * heads, group, n, dim))
    queries[: heads * 2] += rng.normal(size=dim) * 2  # some heads with a strong mean query: spread scores
    keys = rng.normal(size=(layers * heads, n, dim)) + rng.normal(size=(layers * heads, 1, dim))
    inv_freq = torch.tensor(theta ** (-np.arange(dim // 2) / (dim // 2)), dtype=torch.float32)
    stored = rope(keys, np.arange(n, dtype=float), theta)
    state = TokenState(
        keys=torch.tensor(stored, dtype=torch.float32),
        values=torch.zeros(layers * heads, n, dim),
        positions=torch.arange(n).expand(layers * heads, n),
        queries=torch.tensor(queries, dtype=torch.float32),
        rope=RowRope([(Rotary(inv_freq), 0, layers * heads)], stored_rotated=True),
        units=layers,
    )
    return state, queries, keys


@pytest.mark.parametrize("ratio", [0.0, 0.25, 0.5, 1.0])
def test_hand_tensors_head_scores_and_kept_sets(ratio):
    """Three layers of two KV heads (GQA groups of two) over 20 tokens: the head scores equal NumPy's, and each
    row keeps what the NumPy rule keeps, the split ranked over every layer at once."""
    layers, heads, group, n, dim, theta, length = 3, 2, 2, 20, 8, 100.0, 30
    state, queries, keys = hand_state(np.random.default_rng(7), layers, heads, group, n, dim, theta)
    p = policy(head_ratio=ratio, n_sink=2, n_recent=5, length=length)
    ours = p.score.head_scores(state).numpy()
    expected = np.concatenate(
        [
            numpy_head_scores(
                queries[layer * heads : (layer + 1) * heads].reshape(heads * group, n, dim),
                keys[layer * heads : (layer + 1) * heads],
                length,
                theta,
            )
            for layer in range(layers)
        ]
    )
    np.testing.assert_allclose(ours, expected, rtol=1e-5)
    assert np.ptp(expected) > 1e-3  # the heads differ: the split is decided by the scores
    mask = p.keep_mask(state, n)
    for row, kept in enumerate(numpy_kept(expected, ratio, n, 2, 5)):
        assert set(mask[row].nonzero().flatten().tolist()) == kept, row


def test_a_budget_caps_every_row_to_its_sinks_window_and_newest_entries():
    """Under a cap of 9 of 20 entries a retrieval head keeps its 2 sinks and 5 recent entries, then its newest 2; a
    streaming head its sinks and window."""
    state, queries, keys = hand_state(np.random.default_rng(3), 2, 2, 2, 20, 8, 100.0)
    mask = policy(head_ratio=0.5, n_sink=2, n_recent=5, length=30).keep_mask(state, 9)
    kept = {frozenset(mask[row].nonzero().flatten().tolist()) for row in range(4)}
    window = {0, 1, *range(15, 20)}
    assert kept == {frozenset(window), frozenset(window | {13, 14})}


def eager_projections(model, ids: list[int]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Every layer's queries [heads, n, D] and keys [KV heads, n, D] before RoPE, read off the model's own
    projections (hooks on q_proj and k_proj: the reference only)."""
    config = model.config
    dim = config.hidden_size // config.num_attention_heads
    queries: list[np.ndarray] = []
    keys: list[np.ndarray] = []
    hooks = []

    def keeping(out: list[np.ndarray]):
        return lambda module, inputs, o: out.append(o[0].double().numpy().reshape(o.shape[1], -1, dim).swapaxes(0, 1))

    for layer in model.model.layers:
        for proj, out in ((layer.self_attn.q_proj, queries), (layer.self_attn.k_proj, keys)):
            hooks.append(proj.register_forward_hook(keeping(out)))
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        for hook in hooks:
            hook.remove()
    return queries, keys


def test_tiny_model_kept_sets_and_resident_bytes(tiny, random_ids):
    """The tiny Llama's prompt, compressed (stage=prefill, budget=1.0): each row keeps what the NumPy rule keeps
    on the model's own projections, and the resident KV bytes are the hand count of what the rows hold (a streaming
    head its sinks and window, a retrieval head the prompt, each the decoded tokens too)."""
    ids, new, n_sink, n_recent, length = random_ids(48, seed=11), 4, 3, 6, 64
    config = tiny.model.config
    theta = float(config.rope_parameters["rope_theta"])
    queries, keys = eager_projections(tiny.model, ids)
    scores = np.concatenate([numpy_head_scores(q, k, length, theta) for q, k in zip(queries, keys)])
    gaps = np.diff(np.sort(scores))
    cut = int(np.argmax(gaps)) + 1  # the split in the widest gap: it does not hang on float differences
    ratio = cut / scores.size
    assert 0 < cut < scores.size and gaps[cut - 1] > 1e-5
    p = policy(head_ratio=ratio, n_sink=n_sink, n_recent=n_recent, length=length)
    g = generate(tiny.model, None, ids, p, 1.0, "prefill", DecodeSettings(max_new_tokens=new), trace=True)
    heads, n = config.num_key_value_heads, len(ids)
    expected = numpy_kept(scores, ratio, n, n_sink, n_recent)
    held = 0
    for layer, positions in enumerate(g.trace[0]):
        for head in range(heads):
            kept = expected[layer * heads + head]
            assert set(positions[head][positions[head] >= 0].tolist()) == kept, (layer, head)
            held += len(kept) + new - 1  # the decoded tokens fed after the prompt stay
    head_dim = config.hidden_size // config.num_attention_heads
    assert g.measures.kv_resident_bytes == held * head_dim * 2 * 4  # keys and values, float32


def test_no_streaming_head_is_the_full_cache(tiny, random_ids):
    """head_ratio=0: every head is a retrieval head, so the generation is the full cache's."""
    ids, settings = random_ids(40, seed=3), DecodeSettings(max_new_tokens=5)
    full = generate(tiny.model, None, ids, build_policy({"name": "full"}), 1.0, "prefill", settings)
    g = generate(tiny.model, None, ids, policy(head_ratio=0.0, n_sink=2, n_recent=4), 1.0, "prefill", settings)
    assert g.tokens == full.tokens and g.measures.kv_resident_bytes == full.measures.kv_resident_bytes


@pytest.mark.parametrize(
    "option, message",
    [
        ({"head_ratio": -0.1}, "head_ratio=-0.1 must be in [0, 1]"),
        ({"head_ratio": 1.5}, "head_ratio=1.5 must be in [0, 1]"),
        ({"n_sink": -1}, "n_sink=-1 and n_recent=256 must be >= 0"),
        ({"length": 0}, "length=0 must be >= 1"),
    ],
)
def test_bad_options_are_refused(option, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        policy(**option)


def test_only_prompt_compression():
    assert policy().unsupported_stages == ("decode", "both")
