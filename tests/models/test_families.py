"""Every supported family exact, or refused before its weights load.

References are the family's own: ``model.generate`` with its eager attention, and masked replay through the
family's eager attention over transformers' own cache (tests/family_models.py), never kvbench's attention.
"""

from __future__ import annotations

import functools
import glob
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import CONFIG_DIR, fit_layers, keeping_all, with_calibration
from engine_run import generate
from family_models import FAMILIES, REFUSED, SLIDING, WINDOW, build, eager_replay, family_config, family_greedy
from omegaconf import OmegaConf

from kvbench.engine.engine import DecodeSettings
from kvbench.engine.plan import budget_layers
from kvbench.families import layer_windows, support_error
from kvbench.policies.registry import build_policy

NAMED = {}
for path in sorted(glob.glob(str(CONFIG_DIR / "policy" / "*.yaml"))):
    cfg = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    NAMED[cfg["name"]] = cfg
PROMPT, NEW = 20, 8
NO_ROPE = ("opt", "gpt2")


def named(name: str, **extra) -> dict:
    return NAMED[name] | extra


def for_family(family: str, policy: dict) -> dict:
    """``policy`` with a per-layer budget list fitted to the layers the family's budget is split over, and the
    family's tiny model's calibration where its score needs one."""
    fitted = fit_layers(policy, len(budget_layers(build_policy(policy), layer_windows(family_config(family)))))
    return with_calibration(fitted, tiny(family))


def stages(policy: dict) -> list[str]:
    return [s for s in ("prefill", "decode", "both") if s not in build_policy(policy).unsupported_stages]


def runs_on(family: str, policy: dict) -> bool:
    """A policy whose score reads the queries before RoPE is refused on a family without RoPE, a merging one on a
    family whose every layer slides, and one that re-reads the prompt on a family with sliding layers (the
    refusals tested below)."""
    built = build_policy(policy)
    windows = layer_windows(family_config(family))
    if built.merge and all(w is not None for w in windows):
        return False
    if built.rereads and any(w is not None for w in windows):
        return False
    if built.positions == "reindex" and family in NO_ROPE:  # refused there (tested below)
        return False
    return family not in NO_ROPE or built.queries is None or built.queries.rope


QUESTION = 3  # the prompt's last tokens, fed as the question to a policy that observes one (Finch)


def asked(policy: dict, prompt: list[int]) -> tuple[list[int], list[int]]:
    """The prompt as (context, question): a policy observing the question gets its last QUESTION tokens apart
    (the engine compresses them with the context, so the forwards are the whole prompt's as for any policy)."""
    if build_policy(policy).question:
        return prompt[:-QUESTION], prompt[-QUESTION:]
    return prompt, []


def traced(model, prompt: list[int], policy, budget: float, stage: str, stride: int | None, question=()):
    """kvbench's run with its logits and the kept positions of every step, for the masked eager replay."""
    settings = DecodeSettings(max_new_tokens=NEW)
    return generate(
        model, None, prompt, policy, budget, stage, settings, list(question), stride, return_logits=True, trace=True
    )


# Which cells of the method × family matrix run by default (docs/testing.md): every method on the families whose
# attention code differs (GQA with RoPE, all-sliding, softcapped, hybrid local/global, partial and interleaved
# rotary, no RoPE), and the methods that predate 2024 on every family. The other cells are marked ``slow`` and run
# under ``pytest -m slow``; none is left out.
DISTINCT = ("llama", "mistral-window", "gemma2-softcap", "gemma3", "gpt-neox", "gptj", "gpt2")
CORE = (
    "full",
    "window",
    "streamingllm",
    "random",
    "h2o",
    "scissorhands",
    "tova",
    "roco",
    "mean_window",
    "accumulated_robust",
    "vatp",
    "knorm",
    "snapkv",
    "pyramidkv",
    "adakv",
)


def cells(variants: Callable[[str], list[tuple[str, dict]]]) -> list:
    """One test per (family, policy variant) that runs there; ``slow`` outside the default cells."""
    params = []
    for family in FAMILIES:
        for name, extra in variants(family):
            if runs_on(family, named(name, **extra)):
                marks = () if family in DISTINCT or name in CORE else (pytest.mark.slow,)
                label = "-".join([family, name, *(f"{k}={v}" for k, v in extra.items())])
                params.append(pytest.param(family, name, extra, marks=marks, id=label))
    return params


def generate_variants(family: str) -> list[tuple[str, dict]]:
    variants: list[tuple[str, dict]] = [(name, {}) for name in NAMED]
    if family in SLIDING:
        variants += [(name, {"sliding_layers": "evict"}) for name in ("h2o", "tova", "snapkv", "adakv", "window")]
    if family not in NO_ROPE:  # kept keys re-rotated in the family's own RoPE layout (per layer where it differs)
        variants += [(name, {"positions": "reindex"}) for name in ("streamingllm", "h2o", "adakv")]
    # Quest leaves its first two layers dense, which are most of a tiny model's: here every layer chooses pages.
    variants.append(("quest", {"sparsity": NAMED["quest"]["sparsity"] | {"dense_layers": 0, "page_size": 4}}))
    return variants


# Every policy that evicts (a new policy config is replayed without an entry here), except those that merge or prune
# key channels: they change the values or keys they keep, which a mask cannot replay (tests/policies/test_cam.py
# checks each merge instead, tests/policies/test_think.py the pruned channels against eager attention zeroing them).
REPLAYED = [
    name
    for name, cfg in NAMED.items()
    if cfg.get("score", "none") not in (None, "none") and not cfg.get("merge") and not cfg.get("channels")
]


def replay_variants(family: str) -> list[tuple[str, dict]]:
    # eager attention replays at the true positions: a re-indexing config (Finch's) is replayed with them, its
    # kept sets the same (its score reads no RoPE)
    absolute = {"positions": "absolute"}
    variants: list[tuple[str, dict]] = [
        (name, absolute if NAMED[name].get("positions") == "reindex" else {}) for name in REPLAYED
    ]
    if family in SLIDING:
        variants += [(name, {"sliding_layers": "evict"}) for name in ("h2o", "adakv", "window")]
    return variants


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return torch.randint(0, 300, (PROMPT,), generator=torch.Generator().manual_seed(0)).tolist()


@functools.cache
def tiny(family: str) -> Any:
    """One tiny model per family for the module's many cells (no test changes its weights)."""
    return build(family)


@functools.cache
def greedy(family: str, prompt: tuple[int, ...]) -> tuple[list[int], torch.Tensor]:
    return family_greedy(tiny(family), list(prompt), NEW)


@pytest.mark.parametrize("family, name, extra", cells(generate_variants))
def test_every_policy_at_a_budget_of_the_length_equals_the_familys_generate(family, name, extra, prompt):
    model = tiny(family)
    ref_tokens, ref_logits = greedy(family, tuple(prompt))
    policy = keeping_all(for_family(family, named(name, **extra)))
    context, question = asked(policy, prompt)
    for stage in stages(policy):
        stride = None if stage == "prefill" else 7  # one chunk, and chunks shorter than the window and longer
        g = generate(
            model,
            None,
            context,
            build_policy(policy),
            PROMPT + NEW,
            stage,
            DecodeSettings(max_new_tokens=NEW),
            question,
            stride=stride,
            return_logits=True,
        )
        where = f"{family} {name} {extra} {stage} stride={stride}"
        assert g.tokens == ref_tokens, where
        torch.testing.assert_close(g.logits, ref_logits, rtol=1e-5, atol=1e-5, msg=where)


@pytest.mark.parametrize("family, name, extra", cells(replay_variants))
def test_eviction_equals_the_familys_eager_attention_masked_to_the_kept_set(family, name, extra, prompt):
    model = tiny(family)
    policy = for_family(family, named(name, **extra))
    checked = 0
    for stage, stride in (("both", 7), (stages(policy)[-1], None), ("prefill", None)):
        if stage not in stages(policy):
            continue
        built = build_policy(policy)
        budget = max(4, built.scope.min_budget())
        context, question = asked(policy, prompt)
        g = traced(model, context, built, budget, stage, stride, question)
        where = f"{family} {name} {extra} {stage} stride={stride}"
        replayed = eager_replay(model, prompt, g.tokens, g.trace, stride)
        torch.testing.assert_close(g.logits, replayed, rtol=1e-4, atol=1e-4, msg=where)
        checked += 1
    assert checked


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_kept_set_mask_has_teeth(family, prompt):
    """Without the kept-set mask the family's attention gives other logits than an evicting run: the replay
    comparison above can fail."""
    model = tiny(family)
    g = traced(model, prompt, build_policy(named("h2o")), 4, "both", 7)
    unmasked = eager_replay(model, prompt, g.tokens, None, 7)
    assert float((unmasked - g.logits).abs().max()) > 1e-2


@pytest.mark.parametrize("family", SLIDING)
def test_sliding_layers_never_hold_more_than_their_window(family, prompt):
    model = build(family)
    windows = layer_windows(model.config)
    for policy in (named("full"), named("h2o"), named("h2o", sliding_layers="evict"), named("adakv")):
        for stage in stages(policy):
            g = generate(
                model,
                None,
                prompt,
                build_policy(policy),
                0.5,
                stage,
                DecodeSettings(max_new_tokens=NEW),
                stride=5,
                trace=True,
            )
            for layers in g.trace:
                for window, held in zip(windows, layers):
                    if window is not None:
                        assert held.shape[-1] <= window - 1, (family, policy["name"], stage)
            assert g.measures.kv_resident_bytes_sliding is not None


def test_budget_applies_to_full_attention_layers_of_a_hybrid_model(prompt):
    """Gemma 3's sliding layers hold their window (5 entries); the full layer holds the policy's budget; with
    sliding_layers=evict the sliding layers hold min(budget, window - 1)."""
    model = build("gemma3")
    for extra, sliding_held in (({}, WINDOW - 1), ({"sliding_layers": "evict"}, 3)):
        g = generate(
            model,
            None,
            prompt,
            build_policy(named("h2o", **extra)),
            3,
            "both",
            DecodeSettings(max_new_tokens=NEW),
            trace=True,
        )
        *sliding, full = g.trace[-1]
        assert full.shape[-1] == 3
        assert all(layer.shape[-1] == sliding_held for layer in sliding)
        # What the sliding layers keep is what their next query can still see: the budget is not spent outside.
        assert all(bool((layer > PROMPT + NEW - 1 - WINDOW).all()) for layer in sliding)
        row_bytes = 2 * 16 * 4  # K and V of one head, float32
        assert g.measures.kv_resident_bytes_full == 3 * row_bytes
        assert g.measures.kv_resident_bytes_sliding == 2 * sliding_held * row_bytes
        assert g.measures.kv_resident_bytes == g.measures.kv_resident_bytes_full + g.measures.kv_resident_bytes_sliding
        seen = PROMPT + NEW - 1
        assert g.measures.budget_achieved_full == pytest.approx(3 / seen)
        assert g.measures.budget_achieved_sliding == pytest.approx(sliding_held / seen)


def test_an_all_sliding_model_holds_the_budget_or_its_window(prompt):
    model = build("mistral-window")
    for budget, held in ((3, 3), (100, WINDOW - 1)):
        g = generate(
            model,
            None,
            prompt,
            build_policy(named("h2o")),
            budget,
            "both",
            DecodeSettings(max_new_tokens=NEW),
            trace=True,
        )
        assert all(layer.shape[-1] == held for layer in g.trace[-1])
        assert g.measures.kv_resident_bytes_full is None


@pytest.mark.parametrize("family", list(FAMILIES))
def test_layer_windows_from_the_config_are_the_windows_the_model_attends_with(family):
    """What kvbench plans from the config alone equals what each attention module hands the interface."""
    seen = {}

    def spy(module, query, key, value, mask, **kwargs):
        seen[module.layer_idx] = kwargs.get("sliding_window")
        return torch.zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1]), None

    from transformers import AttentionInterface

    AttentionInterface.register("kvbench_spy", spy)
    model = build(family)
    model.set_attn_implementation("kvbench_spy")
    model(torch.tensor([[1, 2, 3]]))
    assert [seen[i] for i in range(len(seen))] == layer_windows(family_config(family))


@pytest.mark.parametrize("family", list(REFUSED))
def test_families_that_bypass_the_attention_interface_are_refused_from_the_config(family):
    config_cls, options = REFUSED[family]
    problem = support_error(config_cls(**options))
    assert problem and "attention interface" in problem and family in problem


def test_supported_families_pass_the_config_check():
    for family in FAMILIES:
        assert support_error(family_config(family)) is None, family


def test_a_refused_family_fails_in_generate_before_running(prompt):
    config_cls, options = REFUSED["falcon"]
    model = tf_model(config_cls(**options))
    with pytest.raises(ValueError, match="attention interface"):
        generate(model, None, prompt, build_policy(named("full")), 1.0, "prefill", DecodeSettings(max_new_tokens=2))


def tf_model(config):
    import transformers

    from kvbench.families import causal_lm_class

    assert causal_lm_class(config) is not None
    return getattr(transformers, causal_lm_class(config).__name__)(config).eval()


@pytest.mark.parametrize("family", NO_ROPE)
def test_reindex_is_refused_on_families_without_rope(family, prompt):
    from kvbench.policies.positions import reindex_refusal

    assert "positions=absolute" in reindex_refusal(family_config(family))
    with pytest.raises(ValueError, match="positions=absolute"):
        generate(
            build(family),
            None,
            prompt,
            build_policy(named("streamingllm", positions="reindex")),
            0.5,
            "prefill",
            DecodeSettings(max_new_tokens=2),
        )


@pytest.mark.parametrize("family", NO_ROPE)
def test_scores_reading_queries_before_rope_are_refused_on_families_without_rope(family, prompt):
    from kvbench.families import policy_problem

    policy = build_policy(named("expected_attention"))
    assert "reads no pre-RoPE queries" in policy_problem(family_config(family), policy)
    with pytest.raises(ValueError, match="reads no pre-RoPE queries"):
        generate(build(family), None, prompt, policy, 0.5, "prefill", DecodeSettings(max_new_tokens=2))


def test_merge_is_refused_where_sliding_layers_would_evict(prompt):
    model = build("mistral-window")
    with pytest.raises(ValueError, match="merge"):
        generate(
            model, None, prompt, build_policy(named("h2o", merge=True)), 0.5, "both", DecodeSettings(max_new_tokens=2)
        )
    # On a hybrid model merging runs in the full-attention layers (the sliding ones hold their window).
    g = generate(
        build("gemma3"),
        None,
        prompt,
        build_policy(named("h2o", merge=True)),
        0.5,
        "both",
        DecodeSettings(max_new_tokens=2),
    )
    assert len(g.tokens) == 2


@pytest.mark.parametrize("family", SLIDING)
def test_rereading_the_prompt_is_refused_on_families_with_sliding_layers(family, prompt):
    from kvbench.families import policy_problem

    policy = build_policy(named("kvcompose"))
    assert "sliding-window layer" in str(policy_problem(family_config(family), policy))
    with pytest.raises(ValueError, match="sliding-window layer"):
        generate(build(family), None, prompt, policy, 0.5, "prefill", DecodeSettings(max_new_tokens=2))


def test_family_table_in_the_docs_lists_every_tested_family():
    from conftest import REPO

    table = (REPO / "docs" / "models.md").read_text()
    for family in list(FAMILIES) + list(REFUSED):
        assert f"`{family}`" in table, family


@pytest.mark.parametrize(
    "family, overrides, message",
    [
        ("falcon", ["policy=full"], "attention interface"),
        ("bloom", ["policy=h2o"], "attention interface"),
        ("gpt2", ["policy=streamingllm", "policy.positions=reindex"], "positions=absolute"),
        ("opt", ["policy=window", "policy.positions=reindex"], "positions=absolute"),
        ("gpt2", ["policy=expected_attention"], "reads no pre-RoPE queries"),
        ("mistral-window", ["policy=h2o", "policy.merge=true"], "merge"),
    ],
)
def test_the_runner_refuses_from_the_config_before_any_weights_load(tmp_path, monkeypatch, family, overrides, message):
    """A local directory holding only config.json: a refusal that needed the weights would fail differently."""
    from hydra import compose, initialize_config_dir

    from kvbench.config import ConfigError
    from kvbench.runner import model_cache
    from kvbench.runner.cell import run_cell

    config = REFUSED[family][0](**REFUSED[family][1]) if family in REFUSED else family_config(family)
    config.save_pretrained(tmp_path / "model")
    monkeypatch.setattr(model_cache, "get_model", lambda *_: pytest.fail("the model loaded before the refusal"))
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(
            "config",
            overrides=[
                "model=hf",
                f"model.name_or_path={tmp_path / 'model'}",
                "task.n=1",
                f"results_dir={tmp_path / 'results'}",
                *overrides,
            ],
        )
    with pytest.raises(ConfigError, match=message):
        run_cell(cfg, tmp_path / "cell", "t")


def test_unimplemented_attention_arguments_are_refused_never_ignored():
    from kvbench.engine.attention import family_arguments

    assert family_arguments(0, {"sliding_window": 6, "softcap": 5.0, "position_ids": torch.zeros(1)}, 6) == (6, 5.0)
    with pytest.raises(ValueError, match="s_aux"):
        family_arguments(0, {"s_aux": torch.zeros(4)}, None)
    with pytest.raises(ValueError, match="dropout"):
        family_arguments(0, {"dropout": 0.1}, None)
    with pytest.raises(RuntimeError, match="planned for None"):
        family_arguments(3, {"sliding_window": 6}, None)


def np_attention(q, k, v, scaling, softcap, window, q_pos, k_pos):
    """NumPy reference: per query head, capped logits, causal + window mask by position, softmax."""
    import numpy as np

    logits = np.einsum("hqd,hnd->hqn", q, k) * scaling
    if softcap is not None:
        logits = softcap * np.tanh(logits / softcap)
    gap = q_pos[:, None] - k_pos[None, :]
    visible = (gap >= 0) & (gap < window)
    logits = np.where(visible[None], logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return p, np.einsum("hqn,hnd->hqd", p, v), visible


@pytest.mark.parametrize("block", [1 << 22, 40])  # one block, and blocks of a few queries
def test_statistics_and_output_are_the_softcapped_windowed_attention_numpy_computes(block, monkeypatch):
    import numpy as np

    from kvbench.engine import attention, blocked
    from kvbench.engine.visibility import KeyAccess, Window
    from kvbench.policies.statistics import Collecting

    monkeypatch.setattr(blocked, "STATS_BLOCK_ELEMENTS", block)
    rng = np.random.default_rng(3)
    hq, hkv, past, q, d, window, cap = 4, 2, 5, 7, 8, 4, 2.0
    n = past + q
    k_pos = np.array([0, 2, 3, 6, 7] + list(range(8, 8 + q)))  # a kept past with holes, then the chunk
    q_pos = k_pos[past:]
    Q, K, V = (rng.normal(size=s).astype(np.float32) * 2 for s in ((hq, q, d), (hkv, n, d), (hkv, n, d)))
    K_rep, V_rep = np.repeat(K, hq // hkv, 0), np.repeat(V, hq // hkv, 0)
    probs, out, visible = np_attention(Q, K_rep, V_rep, d**-0.5, cap, window, q_pos, k_pos)
    group_mean = probs.reshape(hkv, hq // hkv, q, n).mean(1)
    t = lambda a: torch.tensor(a).unsqueeze(0)  # noqa: E731
    win = Window(window, torch.tensor(k_pos).unsqueeze(0), torch.tensor(q_pos).unsqueeze(0))
    got = attention.attention_statistics(
        t(Q),
        t(K),
        KeyAccess(d**-0.5, past, window=win, softcap=cap),
        Collecting(frozenset({"acc", "sumsq", "last", "qlog"}), history=3),
        t(V),
    )
    np.testing.assert_allclose(got["acc"], group_mean.sum(1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["sumsq"], (group_mean**2).sum(1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["last"], group_mean[:, -1], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["qlog"], group_mean[:, -3:], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["qlog_nvis"], np.broadcast_to(visible[-3:].sum(-1), (hkv, 3)))
    np.testing.assert_allclose(got["output"][0].transpose(0, 1), out, rtol=1e-5, atol=1e-5)
    # The decode step (the chunk's last query alone over every key) computes the same row and output.
    last = Window(window, torch.tensor(k_pos).unsqueeze(0), torch.tensor(q_pos[-1:]).unsqueeze(0))
    output, stats = attention.decode_attention(
        t(Q[:, -1:]), t(K), t(V), KeyAccess(d**-0.5, window=last, softcap=cap), Collecting(frozenset({"acc"}))
    )
    np.testing.assert_allclose(stats["acc"], group_mean[:, -1], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(output[0, 0], out[:, -1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "config, message",
    [
        (lambda: __import__("transformers").GptOssConfig(), "s_aux"),
        (lambda: __import__("transformers").Qwen2MoeConfig(use_sliding_window=True, sliding_window=8), "mask alone"),
    ],
)
def test_arguments_the_family_hands_its_attention_are_checked_from_its_code(config, message):
    """Read from the family's modeling source, before any weights: learned sinks, a window kept in the mask."""
    assert message in support_error(config())


@pytest.mark.parametrize("family", ["mistral-window", "gemma3"])
def test_kvbench_masked_replay_holds_on_sliding_layers(family, prompt):
    model = build(family)
    g = generate(
        model,
        None,
        prompt,
        build_policy(named("h2o")),
        3,
        "both",
        DecodeSettings(max_new_tokens=NEW),
        trace=True,
        return_logits=True,
    )
    r = generate(
        model,
        None,
        prompt,
        build_policy(named("full")),
        1.0,
        "both",
        DecodeSettings(max_new_tokens=NEW),
        forced_tokens=g.tokens,
        replay_trace=g.trace,
        return_logits=True,
    )
    torch.testing.assert_close(r.logits, g.logits, rtol=1e-4, atol=1e-4)


def test_pyramid_on_an_all_sliding_model_keeps_the_uniform_total():
    from kvbench.engine.plan import plan_layers

    config = family_config("mistral-window")
    config.num_hidden_layers = 4
    small = named("pyramidkv")  # an observation window of 1, so that the pyramid has budget to spread
    small = small | {"score": small["score"] | {"window": 1}, "scope": small["scope"] | {"window": 1}}
    for budget in (4, 5, 8):
        plans = plan_layers(build_policy(small), budget, layer_windows(config), "both", 20, 0, 8, 20)
        assert sum(p.budget for p in plans) == 4 * min(budget, WINDOW - 1), budget


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_decode_schedule_equals_masked_replay_and_generate_at_the_length(family, prompt):
    """``policy.interval=3``: rows grow past the budget between evictions. The family's eager attention, masked
    after each step to what kvbench held then, gives kvbench's logits at every step; a budget of the length is
    the family's generate."""
    model = build(family)
    ref_tokens, ref_logits = family_greedy(model, prompt, NEW)
    moved, has_full = 0.0, None in layer_windows(model.config)
    for name in ("h2o", "streamingllm", "tova"):
        policy = named(name, interval=3)
        for stage, stride in (("both", 7), ("decode", None)):
            g = traced(model, prompt, build_policy(policy), 6, stage, stride)
            where = f"{family} {name} interval=3 {stage} stride={stride}"
            if has_full:  # a full-attention layer grew: the last step did not evict
                assert max(held.shape[-1] for held in g.trace[-1]) > 6, where
            replayed = eager_replay(model, prompt, g.tokens, g.trace, stride)
            torch.testing.assert_close(g.logits, replayed, rtol=1e-4, atol=1e-4, msg=where)
            every = generate(
                model,
                None,
                prompt,
                build_policy(named(name)),
                6,
                stage,
                DecodeSettings(max_new_tokens=NEW),
                stride=stride,
                return_logits=True,
                forced_tokens=g.tokens,
            )
            moved = max(moved, float((every.logits - g.logits).abs().max()))
        g = generate(
            model,
            None,
            prompt,
            build_policy(policy),
            PROMPT + NEW,
            "both",
            DecodeSettings(max_new_tokens=NEW),
            stride=7,
            return_logits=True,
        )
        assert g.tokens == ref_tokens, f"{family} {name}"
        torch.testing.assert_close(g.logits, ref_logits, rtol=1e-5, atol=1e-5)
    # The schedule has teeth: evicting every step gives other logits (where a layer holds more than its window).
    assert moved > 1e-3 or not has_full


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_policy_per_phase_equals_masked_replay(family, prompt):
    """SnapKV compresses the prompt, then H2O or the window evicts while decoding (``policy.prefill`` /
    ``policy.decode``): the family's eager attention masked to the kept set gives kvbench's logits."""
    model = build(family)
    snapkv = named(
        "snapkv", score=NAMED["snapkv"]["score"] | {"window": 4}, scope={"kind": "sinks_window", "window": 4}
    )
    for decode in ("h2o", "window"):
        policy = build_policy(named("snapkv", prefill=snapkv, decode=NAMED[decode]))
        for stride in (None, 7):
            g = generate(
                model,
                None,
                prompt,
                policy,
                6,
                "both",
                DecodeSettings(max_new_tokens=NEW),
                stride=stride,
                return_logits=True,
                trace=True,
            )
            replayed = eager_replay(model, prompt, g.tokens, g.trace, stride)
            torch.testing.assert_close(g.logits, replayed, rtol=1e-4, atol=1e-4, msg=f"{family} {decode} {stride}")
