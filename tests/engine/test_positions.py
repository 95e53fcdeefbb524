"""positions=reindex's RoPE (kvbench/policies/positions.py) against each family's own code in transformers.

The reference is never our formula: it is the model's rotary module and its modeling file's
``apply_rotary_pos_emb``, called directly on random keys, or caught inside a real forward pass."""

from __future__ import annotations

import importlib

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from kvbench.policies.positions import LAYOUTS, Rotary, layer_rotaries, reindex_refusal

BASE = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
GEMMA3_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
}
TWO_KINDS = ["sliding_attention", "full_attention"]
EXTRA = {
    "qwen3": dict(head_dim=8),
    "qwen3_moe": dict(head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
    "qwen2_moe": dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16
    ),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "gemma": dict(head_dim=8),
    "gemma2": dict(head_dim=8, sliding_window=16),
    "gemma3_text": dict(head_dim=8, sliding_window=16, layer_types=TWO_KINDS, rope_parameters=GEMMA3_ROPE),
    "cohere2": dict(sliding_window=16, layer_types=TWO_KINDS),
    "phi3": dict(partial_rotary_factor=0.5),
    "gpt_neox": dict(rotary_pct=0.5),
    "falcon": dict(alibi=False),
    "gptj": dict(n_embd=32, n_layer=2, n_head=4, n_inner=64, rotary_dim=4, n_positions=256),
}


def tiny_config(model_type: str, **overrides):
    args = dict(BASE) if model_type != "gptj" else dict(vocab_size=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    args.update(EXTRA.get(model_type, {}))
    args.update(overrides)
    return AutoConfig.for_model(model_type, **args)


def tiny_model(model_type: str, **overrides):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides)).eval()


def modeling(model):
    return importlib.import_module(type(model).__module__)


# ------------------------------------------------------------------ inside the model's own forward pass


@pytest.mark.parametrize("model_type", sorted(LAYOUTS))
def test_layer_rotaries_match_the_models_forward(model_type, monkeypatch):
    """Every supported family: catch what its attention feeds to and gets from ``apply_rotary_pos_emb``, layer
    by layer, at scattered positions; our layer's rotary must map the one to the other, and back."""
    model = tiny_model(model_type)
    module = modeling(model)
    original = module.apply_rotary_pos_emb
    layer = [None]
    caught: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        if model_type == "gptj":  # (tensor [B, S, H, rot], sin, cos) -> tensor
            pairs = [(args[0].transpose(1, 2), out.transpose(1, 2))]
        else:  # (q, k, cos, sin) -> (q, k), [B, H, S, D]
            pairs = [(args[0], out[0]), (args[1], out[1])]
        caught.setdefault(layer[0], []).extend(pairs)
        return out

    monkeypatch.setattr(module, "apply_rotary_pos_emb", spy)
    for m in model.modules():
        if hasattr(m, "layer_idx") and "attention" in type(m).__name__.lower():
            m.register_forward_pre_hook(lambda m, args: layer.__setitem__(0, m.layer_idx))
    positions = torch.tensor([3, 7, 8, 50, 51, 99, 100, 180])
    with torch.no_grad():
        model(input_ids=torch.arange(8).view(1, -1) + 3, position_ids=positions.view(1, -1))
    rotaries = layer_rotaries(model)
    assert len(rotaries) == model.config.num_hidden_layers
    assert sorted(caught) == [i for i, r in enumerate(rotaries) if r.rot_dim > 0]
    for i, pairs in caught.items():
        assert rotaries[i].layout == LAYOUTS[model_type]
        for raw, rotated in pairs:
            torch.testing.assert_close(rotaries[i].rotate(raw, positions), rotated, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(rotaries[i].unrotate(rotated, positions), raw, rtol=1e-5, atol=1e-5)


def test_cohere2_global_layers_have_no_rope():
    rotaries = layer_rotaries(tiny_model("cohere2"))
    assert rotaries[0].rot_dim == 8 and rotaries[1].rot_dim == 0
    x = torch.randn(2, 5, 8)
    assert torch.equal(rotaries[1].rotate(x, torch.arange(5)), x)


# ------------------------------------------------------------------ the rotary module + apply_rotary_pos_emb directly


def reference(model, layer: int):
    """The family's own RoPE for a layer: x [B, H, n, D] at positions [n] -> rotated x."""
    module, cfg = modeling(model), model.config
    rotary = next(m for m in model.modules() if "rotary" in type(m).__name__.lower())

    def apply(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            if cfg.model_type == "gptj":
                sin, cos = rotary(x, pos.view(1, -1))
                d = cfg.rotary_dim
                rot = module.apply_rotary_pos_emb(x[..., :d].transpose(1, 2), sin, cos).transpose(1, 2)
                return torch.cat((rot, x[..., d:]), dim=-1)
            if cfg.model_type == "gemma3_text":
                cos, sin = rotary(x, pos.view(1, -1), cfg.layer_types[layer])
            else:
                cos, sin = rotary(x, pos.view(1, -1))
            return module.apply_rotary_pos_emb(x, x, cos, sin)[1]  # phi3 / neox split off the pass dims here

    return apply


CASES = {
    "llama": ("llama", {}),
    "llama-linear": ("llama", dict(rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0})),
    "llama-llama3": (
        "llama",
        dict(
            rope_parameters={
                "rope_type": "llama3",
                "factor": 8.0,
                "rope_theta": 500000.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        ),
    ),
    "llama-yarn": (
        "llama",
        dict(
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "rope_theta": 10000.0,
                "original_max_position_embeddings": 64,
            }
        ),
    ),
    "cohere": ("cohere", {}),
    "gptj-partial": ("gptj", {}),
    "gpt_neox-partial": ("gpt_neox", {}),
    "phi3-partial": ("phi3", {}),
    "gemma3-sliding+full": ("gemma3_text", {}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_rotate_matches_the_familys_rotary(case):
    model_type, overrides = CASES[case]
    model = tiny_model(model_type, **overrides)
    g = torch.Generator().manual_seed(1)
    top = 256 if model_type == "gptj" else 5000  # GPT-J's table ends at n_positions
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    for layer, rot in enumerate(layer_rotaries(model)):
        ref = reference(model, layer)
        x = torch.randn(1, 2, 12, getattr(model.config, "head_dim", None) or head_dim, generator=g)
        p, p2 = torch.randint(0, top, (12,), generator=g), torch.randint(0, top, (12,), generator=g)
        at_p = ref(x, p)
        torch.testing.assert_close(rot.rotate(x, p), at_p, rtol=1e-5, atol=1e-5)
        if rot.rot_dim < x.shape[-1]:  # partial rotary: the tail passes through
            assert torch.equal(rot.rotate(x, p)[..., rot.rot_dim :], x[..., rot.rot_dim :])
        # What the cache does: undo the rotation a key was fed with, later rotate it to a new position.
        raw = rot.unrotate(at_p, p)
        torch.testing.assert_close(raw, x, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(rot.rotate(raw, p2), ref(x, p2), rtol=1e-5, atol=1e-5)
        if rot.scale == 1.0:  # the old contract: negative positions undo
            torch.testing.assert_close(rot.rotate(rot.rotate(at_p, -p), p2), ref(x, p2), rtol=1e-5, atol=1e-5)
        # Per-head positions (the pooled cache's layout): x [H, n, D], positions [H, n].
        ph = torch.randint(0, top, (2, 12), generator=g)
        per_head = torch.cat([ref(x[:, h : h + 1], ph[h]) for h in range(2)], dim=1)[0]
        torch.testing.assert_close(rot.rotate(x[0], ph), per_head, rtol=1e-5, atol=1e-5)


def test_the_tables_are_the_models_buffers():
    model = tiny_model("gemma3_text")
    rotary = model.model.rotary_emb
    sliding, full = layer_rotaries(model)
    assert torch.equal(sliding.inv_freq, rotary.sliding_attention_inv_freq)
    assert torch.equal(full.inv_freq, rotary.full_attention_inv_freq)
    assert not torch.equal(sliding.inv_freq, full.inv_freq)
    yarn = tiny_model("llama", **CASES["llama-yarn"][1])
    assert layer_rotaries(yarn)[0].scale == pytest.approx(yarn.model.rotary_emb.attention_scaling) != 1.0


def test_layout_matters():
    """A rotate-half rotary on Cohere (the old behaviour) does not reproduce its RoPE: the check has teeth."""
    model = tiny_model("cohere")
    x, p = torch.randn(1, 2, 6, 8), torch.arange(1, 7) * 5
    wrong = Rotary(model.model.rotary_emb.inv_freq, "half")
    assert not torch.allclose(wrong.rotate(x, p), reference(model, 0)(x, p), atol=1e-3)


def test_single_table_models_share_one_rotary():
    model = tiny_model("llama")
    rot = layer_rotaries(model)[0]
    assert rot is layer_rotaries(model)[1] or rot.same_as(layer_rotaries(model)[1])
    assert rot.layout == "half" and rot.scale == 1.0
    x = torch.randn(2, 4, 8, dtype=torch.bfloat16)
    assert rot.rotate(x, torch.arange(4).view(1, -1)).dtype == torch.bfloat16
    assert torch.equal(Rotary.identity().rotate(x, torch.arange(4)), x)


# ------------------------------------------------------------------ refusals, from configs alone

NO_ROPE_CONFIGS = {
    "opt": dict(num_hidden_layers=1, hidden_size=16, num_attention_heads=2, ffn_dim=32, vocab_size=64),
    "gpt2": dict(n_layer=1, n_embd=16, n_head=2, vocab_size=64),
    "bloom": dict(n_layer=1, hidden_size=16, n_head=2, vocab_size=64),
    "mpt": dict(n_layers=1, d_model=16, n_heads=2, vocab_size=64),
    "falcon": dict(num_hidden_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=64, alibi=True),
}


@pytest.mark.parametrize("model_type", sorted(NO_ROPE_CONFIGS))
def test_models_without_rope_are_refused(model_type):
    msg = reindex_refusal(AutoConfig.for_model(model_type, **NO_ROPE_CONFIGS[model_type]))
    assert msg and "\n" not in msg
    assert f"so {model_type} has no rotary position embedding" in msg and "policy.positions=absolute" in msg


def test_supported_configs_pass_and_others_are_refused():
    for model_type in LAYOUTS:
        assert reindex_refusal(tiny_config(model_type)) is None, model_type
    assert reindex_refusal(AutoConfig.for_model("falcon", alibi=False)) is None
    assert reindex_refusal(AutoConfig.for_model("gemma3")) is None  # multimodal: judged by its text config
    for model_type, rope, why in [
        ("llama", {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}, "recomputes its frequencies"),
        (
            "phi3",
            {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0] * 2,
                "long_factor": [2.0] * 2,
                "original_max_position_embeddings": 64,
            },
            "switches frequency tables",
        ),
        (
            "gemma3_text",
            {**GEMMA3_ROPE, "full_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6}},
            "recomputes",
        ),
    ]:
        msg = reindex_refusal(tiny_config(model_type, rope_parameters=rope), name="M")
        assert msg and "M uses rope_type=" in msg and why in msg and "policy.positions=absolute" in msg, msg
    msg = reindex_refusal(AutoConfig.for_model("mamba"))
    assert "model_type 'mamba'" in msg and "supported: " in msg and "gptj" in msg and "positions=absolute" in msg


def test_models_are_refused_with_the_class_name():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=32))
    expected = "GPT2LMHeadModel has no rotary position embedding; use positions=absolute"  # as test_policies
    with pytest.raises(ValueError, match=expected):
        layer_rotaries(gpt2)
