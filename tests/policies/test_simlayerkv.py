"""SimLayerKV (configs/policy/simlayerkv.yaml) against the paper's rule in NumPy, as kvpress's SimLayerKVPress reads
it: a layer is lazy when the last ``n_last`` queries' attention (mean over them and over the query heads) on the
first ``n_initial`` keys and the ``n_recent`` keys before those queries exceeds the threshold; a lazy layer keeps
the sinks and its newest ``n_recent - n_last`` entries, the others everything (the budget caps them)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import CONFIG_DIR, tiny_policy_cfg
from engine_run import generate
from omegaconf import OmegaConf

from kvbench.engine.engine import DecodeSettings
from kvbench.policies.registry import build_policy
from kvbench.policies.state import TokenState

pytestmark = pytest.mark.usefixtures("one_thread")


def numpy_rule(attention: np.ndarray, tau: float, n_initial: int, n_recent: int, n_last: int) -> tuple[bool, set[int]]:
    """One layer: ``attention`` [heads, n, n], every query's probabilities (a query's row over the keys it saw).
    Whether the layer is lazy, and the positions it keeps."""
    n = attention.shape[-1]
    row = attention[:, n - n_last :, : n - n_last].mean(axis=(0, 1))  # the last queries, the keys before them
    concentration = row[:n_initial].sum() + row[-n_recent:].sum()
    lazy = n > n_initial + n_recent + n_last and concentration > tau
    kept = set(range(n_initial)) | set(range(n - (n_recent - n_last), n)) if lazy else set(range(n))
    return bool(lazy), kept


def causal_rows(rng: np.random.Generator, heads: int, n: int, sink_boost: float) -> np.ndarray:
    """[heads, n, n] random causal attention; ``sink_boost`` raises the first two keys' share."""
    logits = rng.normal(size=(heads, n, n))
    logits[..., :2] += sink_boost
    logits = np.where(np.tril(np.ones((n, n), dtype=bool)), logits, -np.inf)
    probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return probs / probs.sum(axis=-1, keepdims=True)


def policy(**score):
    cfg = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "policy" / "simlayerkv.yaml"), resolve=True)
    cfg["score"].update(score)
    return build_policy(cfg)


@pytest.mark.parametrize("n_last", [1, 3])
def test_hand_tensors_keep_what_the_rule_keeps(n_last):
    """Three layers of two heads over 20 tokens, rows made by hand: one drawn to its sinks, two not; the
    threshold sits between their concentrations. kvbench's keep mask per row equals the NumPy rule."""
    n, heads, n_initial, n_recent = 20, 2, 2, 5
    rng = np.random.default_rng(n_last)
    layers = [causal_rows(rng, heads, n, boost) for boost in (6.0, 0.0, 3.0)]
    concentrations = []
    for att in layers:
        row = att[:, n - n_last :, : n - n_last].mean(axis=(0, 1))
        concentrations.append(row[:n_initial].sum() + row[-n_recent:].sum())
    low, high = sorted(concentrations)[1:]
    tau = (low + high) / 2  # one lazy layer, the one drawn most to its sinks
    qlog = torch.tensor(np.concatenate([att[:, n - n_last :, :] for att in layers]), dtype=torch.float32)
    positions = torch.arange(n).expand(3 * heads, n)
    state = TokenState(positions=positions, stats={"qlog": qlog, "count": (n - positions).float()}, units=3)
    p = policy(lazy_threshold=float(tau), n_initial=n_initial, n_recent=n_recent, n_last=n_last)
    mask = p.keep_mask(state, n)
    lazies = []
    for layer, att in enumerate(layers):
        lazy, kept = numpy_rule(att, tau, n_initial, n_recent, n_last)
        lazies.append(lazy)
        for head in range(heads):
            assert set(mask[layer * heads + head].nonzero().flatten().tolist()) == kept, (layer, head)
    assert lazies == [True, False, False]


def test_a_row_no_longer_than_sinks_window_and_queries_is_never_lazy():
    """As kvpress: a layer holding at most ``n_initial + n_recent + n_last`` entries keeps them all, however
    concentrated its attention; one entry more and the same attention makes it lazy."""
    n_initial, n_recent = 2, 5
    for n, lazy in ((8, False), (9, True)):
        att = causal_rows(np.random.default_rng(n), 2, n, 8.0)  # nearly all on the sinks
        qlog = torch.tensor(att[:, n - 1 :, :], dtype=torch.float32)
        positions = torch.arange(n).expand(2, n)
        state = TokenState(positions=positions, stats={"qlog": qlog, "count": (n - positions).float()})
        mask = policy(lazy_threshold=0.5, n_initial=n_initial, n_recent=n_recent, n_last=1).keep_mask(state, n)
        assert numpy_rule(att, 0.5, n_initial, n_recent, 1)[0] is lazy
        assert int(mask.sum()) == 2 * (n_initial + n_recent - 1 if lazy else n)


def test_a_budget_caps_a_layer_that_is_not_lazy_by_the_heads_mean_attention():
    """A non-lazy layer over the budget keeps its sinks and window, then the entries the last query's head-mean
    attention ranks highest: one set for every head."""
    n, heads, n_initial, n_recent, budget = 16, 2, 2, 4, 9
    att = causal_rows(np.random.default_rng(5), heads, n, 0.0)
    qlog = torch.tensor(att[:, n - 1 :, :], dtype=torch.float32)
    positions = torch.arange(n).expand(heads, n)
    state = TokenState(positions=positions, stats={"qlog": qlog, "count": (n - positions).float()})
    mask = policy(lazy_threshold=1.0, n_initial=n_initial, n_recent=n_recent, n_last=1).keep_mask(state, budget)
    protected = set(range(n_initial)) | set(range(n - (n_recent - 1), n))
    mean = att[:, -1].mean(axis=0)
    rest = sorted(set(range(n)) - protected, key=lambda i: -mean[i])[: budget - len(protected)]
    for head in range(heads):
        assert set(mask[head].nonzero().flatten().tolist()) == protected | set(rest)


def eager_attentions(model, ids: list[int]) -> list[np.ndarray]:
    """Every layer's attention matrix [query heads, n, n] over ``ids`` (eager attention, the reference only)."""
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_attentions=True).attentions
    finally:
        model.set_attn_implementation(previous)
    return [a[0].double().numpy() for a in out]


@pytest.mark.parametrize("n_last", [1, 3])
def test_tiny_model_lazy_layers_kept_sets_and_resident_bytes(tiny, random_ids, n_last):
    """The tiny Llama's prompt, compressed (stage=prefill, budget=1.0): the lazy layers and each layer's kept set
    are those of the NumPy rule on the model's own eager attention, and the resident KV bytes are the hand count of
    what the rows hold (a lazy layer its sinks and window, the others the prompt, each the decoded tokens too)."""
    ids, new, n_initial, n_recent = random_ids(48, seed=21), 4, 2, 6
    attentions = eager_attentions(tiny.model, ids)
    n = len(ids)
    concentrations = []
    for att in attentions:
        row = att[:, n - n_last :, : n - n_last].mean(axis=(0, 1))
        concentrations.append(row[:n_initial].sum() + row[-n_recent:].sum())
    ranked = sorted(concentrations)
    gap = int(np.argmax(np.diff(ranked)))
    tau = float(ranked[gap] + ranked[gap + 1]) / 2  # in the widest gap: some layers lazy, some not
    p = policy(lazy_threshold=tau, n_initial=n_initial, n_recent=n_recent, n_last=n_last)
    g = generate(tiny.model, None, ids, p, 1.0, "prefill", DecodeSettings(max_new_tokens=new), trace=True)
    config = tiny.model.config
    heads, head_dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    held, lazies = 0, []
    for layer, (att, positions) in enumerate(zip(attentions, g.trace[0])):
        lazy, kept = numpy_rule(att, tau, n_initial, n_recent, n_last)
        lazies.append(lazy)
        for head in range(heads):
            assert set(positions[head].tolist()) == kept, (layer, head)
        held += heads * (len(kept) + new - 1)  # the decoded tokens fed after the prompt stay
    assert any(lazies) and not all(lazies)
    assert g.measures.kv_resident_bytes == held * head_dim * 2 * 4  # keys and values, float32


def test_kvpress_threshold_of_one_keeps_everything(tiny, random_ids):
    """lazy_threshold=1.0 (kvpress's default): no layer is lazy, so the generation is the full cache's."""
    ids = random_ids(40, seed=3)
    settings = DecodeSettings(max_new_tokens=5)
    full = generate(tiny.model, None, ids, build_policy({"name": "full"}), 1.0, "prefill", settings)
    g = generate(
        tiny.model,
        None,
        ids,
        build_policy(tiny_policy_cfg("simlayerkv", score={"lazy_threshold": 1.0})),
        1.0,
        "prefill",
        settings,
    )
    assert g.tokens == full.tokens and g.measures.kv_resident_bytes == full.measures.kv_resident_bytes


@pytest.mark.parametrize(
    "option, message",
    [
        ({"lazy_threshold": 0.0}, "lazy_threshold=0.0 must be in (0, 1]"),
        ({"lazy_threshold": 1.5}, "lazy_threshold=1.5 must be in (0, 1]"),
        ({"n_initial": -1}, "n_initial=-1 must be >= 0"),
        ({"n_recent": -4}, "n_recent=-4 must be >= n_last=1"),
        ({"n_last": 0}, "n_last=0 must be >= 1"),
    ],
)
def test_bad_options_are_refused(option, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        policy(**option)


def test_only_prompt_compression():
    assert policy().unsupported_stages == ("decode", "both")
