"""Engine invariants: exactness at full budget, masked-replay equivalence, absolute positions, budgets."""

from __future__ import annotations

import pytest
import torch
from engine_run import generate

from kvbench.budget import budget_tokens as resolve_budget
from kvbench.engine.engine import DecodeSettings, Engine, EngineSettings, Request
from kvbench.engine.plan import plan_capacity
from kvbench.policies.registry import build_policy

POLICIES = {
    "full": {"name": "full"},
    "window": {"name": "window", "score": "recency", "scope": "all"},
    "streamingllm": {"name": "streamingllm", "score": "recency", "scope": {"kind": "sinks_window", "n_sink": 4}},
    "random": {"name": "random", "score": "random", "scope": "all"},
}
EVICTING = ["window", "streamingllm", "random"]
STAGES = ["prefill", "decode", "both"]


def hf_greedy(model, ids: list[int], n: int):
    out = model.generate(
        torch.tensor([ids]), max_new_tokens=n, do_sample=False, output_logits=True, return_dict_in_generate=True
    )
    return out.sequences[0, len(ids) :].tolist(), torch.stack(out.logits)[:, 0].float()


@pytest.mark.parametrize("stride", [None, 7])
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("name", list(POLICIES))
def test_budget_at_least_length_equals_generate_tiny(tiny, random_ids, name, stage, stride):
    ids = random_ids(40)
    ref_tokens, ref_logits = hf_greedy(tiny.model, ids, 12)
    # In "both" a fraction is of the prompt, held during decoding too, so only a token count covers it all.
    for budget in (1.0, 40 + 12) if stage != "both" else (40 + 12, 100):
        g = generate(
            tiny.model,
            tiny.tokenizer,
            ids,
            build_policy(POLICIES[name]),
            budget,
            stage,
            DecodeSettings(max_new_tokens=12),
            stride=stride,
            return_logits=True,
        )
        assert g.tokens == ref_tokens
        torch.testing.assert_close(g.logits, ref_logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(POLICIES))
def test_budget_at_least_length_equals_generate_smollm(smollm, name):
    tok = smollm.tokenizer
    ids = tok("The capital of France is Paris. The capital of Italy is")["input_ids"]
    ref_tokens, ref_logits = hf_greedy(smollm.model, ids, 8)
    for stage in STAGES:
        g = generate(
            smollm.model,
            tok,
            ids,
            build_policy(POLICIES[name]),
            len(ids) + 8,
            stage,
            DecodeSettings(max_new_tokens=8),
            return_logits=True,
        )
        assert g.tokens == ref_tokens[: len(g.tokens)]
        torch.testing.assert_close(g.logits, ref_logits[: len(g.tokens)], rtol=1e-4, atol=1e-4)


def replay(tiny, ids, g, stage, stride):
    return generate(
        tiny.model,
        None,
        ids,
        build_policy(POLICIES["full"]),
        1.0,
        stage,
        DecodeSettings(max_new_tokens=len(g.tokens)),
        stride=stride,
        return_logits=True,
        forced_tokens=g.tokens,
        replay_trace=g.trace,
    )


@pytest.mark.parametrize("stride", [None, 8])
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("name", EVICTING)
def test_eviction_equals_masked_replay(tiny, random_ids, name, stage, stride):
    ids = random_ids(48, seed=1)
    g = generate(
        tiny.model,
        None,
        ids,
        build_policy(POLICIES[name]),
        0.3,
        stage,
        DecodeSettings(max_new_tokens=16),
        stride=stride,
        return_logits=True,
        trace=True,
    )
    r = replay(tiny, ids, g, stage, stride)
    torch.testing.assert_close(g.logits, r.logits, rtol=1e-4, atol=1e-4)
    # The comparison has teeth: the unmasked full cache gives different logits.
    full = generate(
        tiny.model,
        None,
        ids,
        build_policy(POLICIES["full"]),
        1.0,
        stage,
        DecodeSettings(max_new_tokens=16),
        stride=stride,
        return_logits=True,
        forced_tokens=g.tokens,
    )
    assert (full.logits - g.logits).abs().max() > 1e-2


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("name", EVICTING)
def test_cache_never_exceeds_budget(tiny, random_ids, name, stage):
    ids = random_ids(50, seed=2)
    g = generate(
        tiny.model,
        None,
        ids,
        build_policy(POLICIES[name]),
        0.25,
        stage,
        DecodeSettings(max_new_tokens=20),
        stride=10,
        trace=True,
    )
    budget = g.measures.budget_tokens
    prefill_steps = 5  # 50 tokens in chunks of 10
    for step, layers in enumerate(g.trace):
        evicting = (step < prefill_steps and stage != "decode") or (step >= prefill_steps and stage != "prefill")
        for held in layers:
            if evicting:
                assert held.shape[-1] <= budget
            assert held.unique(dim=-1).shape[-1] == held.shape[-1] if held.shape[0] == 1 else True
            assert torch.all(held[:, 1:] > held[:, :-1])  # sequence order, no duplicates


def test_window_and_streamingllm_keep_exact_positions(tiny, random_ids):
    ids = random_ids(30, seed=3)
    g = generate(
        tiny.model,
        None,
        ids,
        build_policy(POLICIES["window"]),
        10,
        "both",
        DecodeSettings(max_new_tokens=6),
        trace=True,
    )
    # 30 prompt tokens + 5 fed decode tokens = positions 0..34; the window holds the last 10.
    assert g.trace[-1][0].tolist() == [list(range(25, 35))] * 2
    g = generate(
        tiny.model,
        None,
        ids,
        build_policy(POLICIES["streamingllm"]),
        10,
        "both",
        DecodeSettings(max_new_tokens=6),
        trace=True,
    )
    assert g.trace[-1][0].tolist() == [[0, 1, 2, 3] + list(range(29, 35))] * 2


def test_kept_keys_keep_their_rotation(tiny, random_ids):
    """Layer 0 keys depend only on token and position, so the evicting cache's kept keys must equal
    the full cache's keys at the same absolute positions: no re-rotation, true positions for new tokens."""
    from kvbench.engine.cache.cache import KVCache

    ids = random_ids(40, seed=4)
    captured = {}
    original = KVCache.summary

    def spy(self, slot=0):
        captured["cache"] = self
        return original(self, slot)

    KVCache.summary = spy
    try:
        g = generate(
            tiny.model, None, ids, build_policy(POLICIES["streamingllm"]), 12, "both", DecodeSettings(max_new_tokens=8)
        )
        evicting = captured["cache"].layer_state(0)
        generate(
            tiny.model,
            None,
            ids,
            build_policy(POLICIES["full"]),
            1.0,
            "both",
            DecodeSettings(max_new_tokens=8),
            forced_tokens=g.tokens,
        )
        full = captured["cache"].layer_state(0)
    finally:
        KVCache.summary = original
    positions = evicting.positions
    assert positions.max().item() == 40 + 8 - 2  # the last fed token sits at its true index
    assert full.positions[0].tolist() == list(range(40 + 8 - 1))
    expected = full.keys.gather(1, positions.unsqueeze(-1).expand(-1, -1, full.keys.shape[-1]))
    torch.testing.assert_close(evicting.keys, expected, rtol=1e-6, atol=1e-6)


def test_budget_resolution_and_capacity():
    assert resolve_budget(0.25, 100) == 25 and resolve_budget(0.251, 100) == 26 and resolve_budget(64, 100) == 64
    for bad in (0.0, 1.5, 0, -3):
        with pytest.raises(ValueError, match="fraction in \\(0, 1\\]"):
            resolve_budget(bad, 100)
    # prefill: budget 25 + chunk 10 held during prefill, then 25 + 5 suffix + 20 new tokens.
    # (most held while the prompt is fed, most held while decoding)
    assert plan_capacity("prefill", 25, 100, 5, 20, 10) == (35, 50)
    # decode: the whole prompt, then one more before each eviction.
    assert plan_capacity("decode", 25, 100, 0, 20, 100) == (100, 101)
    assert plan_capacity("both", 25, 100, 0, 20, 10) == (35, 26)
    assert plan_capacity("prefill", None, 100, 5, 20, 10) == (105, 125)


def test_budget_below_protected_set_is_refused(tiny, random_ids):
    with pytest.raises(ValueError, match="below the 5 tokens policy .streamingllm. always protects"):
        generate(
            tiny.model,
            None,
            random_ids(20),
            build_policy(POLICIES["streamingllm"]),
            3,
            "prefill",
            DecodeSettings(max_new_tokens=2),
        )


def test_achieved_budget_and_resident_bytes(tiny, random_ids):
    ids = random_ids(100, seed=5)
    g = generate(
        tiny.model, None, ids, build_policy(POLICIES["window"]), 0.25, "prefill", DecodeSettings(max_new_tokens=5)
    )
    assert g.measures.budget_tokens == 25 and g.measures.budget_achieved == pytest.approx(0.25)
    per_token = 2 * 2 * 16 * 4  # kv heads × (K + V) × head_dim × float32 bytes, per layer
    assert g.measures.kv_resident_bytes == 4 * (25 + 4) * per_token  # 4 fed decode tokens appended after prefill
    full = generate(
        tiny.model, None, ids, build_policy(POLICIES["full"]), 1.0, "prefill", DecodeSettings(max_new_tokens=5)
    )
    assert full.measures.kv_resident_bytes == 4 * 104 * per_token > g.measures.kv_resident_bytes


def test_suffix_is_appended_after_compression(tiny, random_ids):
    ids, suffix = random_ids(40, seed=6), random_ids(6, seed=7)
    g = generate(
        tiny.model,
        None,
        ids,
        build_policy(POLICIES["window"]),
        10,
        "prefill",
        DecodeSettings(max_new_tokens=3),
        suffix_ids=suffix,
        trace=True,
    )
    # After the context is cut to 10, the 6 suffix tokens are added without eviction.
    assert g.trace[1][0].tolist() == [list(range(30, 46))] * 2


def test_sampling_is_seeded(tiny, random_ids):
    ids = random_ids(20, seed=8)
    policy = build_policy(POLICIES["full"])
    runs = [
        generate(
            tiny.model,
            None,
            ids,
            policy,
            1.0,
            "prefill",
            DecodeSettings(max_new_tokens=10, do_sample=True, temperature=1.5, top_p=0.9, seed=s),
        ).tokens
        for s in (1, 1, 2)
    ]
    assert runs[0] == runs[1] and runs[0] != runs[2]


@pytest.mark.parametrize("name", ["full", "streamingllm"])
def test_fused_forward_matches_the_model_modules(smollm, name):
    """The fused projections only reorder float sums: same tokens, logits within float32 rounding."""
    ids = smollm.tokenizer("Once upon a time, in a small village by the sea, there lived")["input_ids"]
    runs = {
        f: generate(
            smollm.model,
            smollm.tokenizer,
            ids,
            build_policy(POLICIES[name]),
            0.5,
            "both",
            DecodeSettings(max_new_tokens=10),
            return_logits=True,
            fused=f,
        )
        for f in (False, True)
    }
    assert runs[True].tokens == runs[False].tokens
    torch.testing.assert_close(runs[True].logits, runs[False].logits, rtol=1e-4, atol=2e-4)


def test_fused_forward_refuses_other_architectures():
    from transformers import GPT2Config, GPT2LMHeadModel

    from kvbench.engine.fused_llama import supports

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=300, n_positions=64))
    assert supports(gpt2) == (False, "model_type 'gpt2' is not one of ('llama',)")
    with pytest.raises(ValueError, match="fused=true but model_type 'gpt2'"):
        generate(
            gpt2,
            None,
            [1, 2, 3],
            build_policy(POLICIES["full"]),
            1.0,
            "prefill",
            DecodeSettings(max_new_tokens=2),
            fused=True,
        )


def test_interleaved_generations_equal_each_run_alone(tiny, random_ids):
    """``Engine.steps`` pauses after the prompt and each decode step; stepping several runs in turn (as the
    benchmark does) must give each run exactly what it gives alone: no state is shared between runs."""
    ids = random_ids(40, seed=23)
    h2o = {"name": "h2o", "score": "accumulated", "scope": {"kind": "sinks_window", "n_sink": 2, "window": 0.5}}
    ada = {
        "name": "ada",
        "score": "accumulated",
        "scope": {"kind": "sinks_window", "n_sink": 2},
        "allocation": {"kind": "adaptive"},
    }
    runs = [(h2o, "both"), (ada, "both"), (POLICIES["random"], "decode")]
    settings = DecodeSettings(max_new_tokens=6)

    request = Request(ids, settings=settings)

    def engine(cfg, stage):
        return Engine(tiny.model, None, EngineSettings(build_policy(cfg), 0.4, stage, stride=16, return_logits=True))

    alone = [engine(cfg, stage).run([request])[0] for cfg, stage in runs]
    live, done = [engine(cfg, stage).steps([request]) for cfg, stage in runs], {}
    while len(done) < len(live):
        for i, steps in enumerate(live):
            if i not in done:
                for _, g in next(steps):
                    done[i] = g
    for i, ref in enumerate(alone):
        assert done[i].tokens == ref.tokens
        torch.testing.assert_close(done[i].logits, ref.logits, rtol=0, atol=0)


def test_the_fused_forward_is_the_default_on_cpu_only():
    """Off an accelerator's device by default (its fused copies would double the weights there); asked for, built."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvbench.engine.fused_llama import fused_forward_for

    config = LlamaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=64
    )
    model = LlamaForCausalLM(config)
    assert fused_forward_for(model, None) is not None and fused_forward_for(model, False) is None
    on_meta = LlamaForCausalLM(config).to("meta")  # any device that is not the CPU
    assert fused_forward_for(on_meta, None) is None
    assert fused_forward_for(on_meta, True) is not None
