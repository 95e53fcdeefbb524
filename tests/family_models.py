"""Tiny random models of many transformers families, and a reference for kvbench's kept sets that shares no
code with kvbench: the family's own eager attention over transformers' own cache, with the kept set as a mask.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import transformers as tf

WINDOW = 6  # shorter than every test prompt
VOCAB = 300
_LLAMA_LIKE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
_GEMMA = dict(_LLAMA_LIKE, head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW)

# name: (config class, model class, config options). GQA wherever the family has it; windows < the prompt.
FAMILIES: dict[str, tuple[type, type, dict[str, Any]]] = {
    "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, _LLAMA_LIKE),
    "mistral-window": (tf.MistralConfig, tf.MistralForCausalLM, dict(_LLAMA_LIKE, sliding_window=WINDOW)),
    "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, _LLAMA_LIKE),
    "qwen2-window": (
        tf.Qwen2Config,
        tf.Qwen2ForCausalLM,
        dict(_LLAMA_LIKE, num_hidden_layers=3, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    ),
    "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, dict(_LLAMA_LIKE, head_dim=16)),
    "gemma2-softcap": (
        tf.Gemma2Config,
        tf.Gemma2ForCausalLM,
        dict(_GEMMA, attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
    ),
    "gemma3": (
        tf.Gemma3TextConfig,
        tf.Gemma3ForCausalLM,
        dict(
            _GEMMA,
            num_hidden_layers=3,
            num_key_value_heads=1,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        ),
    ),
    "phi3-window": (tf.Phi3Config, tf.Phi3ForCausalLM, dict(_LLAMA_LIKE, sliding_window=WINDOW, pad_token_id=0)),
    "starcoder2": (tf.Starcoder2Config, tf.Starcoder2ForCausalLM, dict(_LLAMA_LIKE, sliding_window=WINDOW)),
    "olmo2": (tf.Olmo2Config, tf.Olmo2ForCausalLM, _LLAMA_LIKE),
    "gpt-neox": (
        tf.GPTNeoXConfig,
        tf.GPTNeoXForCausalLM,
        dict(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=512,
            rotary_pct=0.5,
        ),
    ),
    "cohere": (tf.CohereConfig, tf.CohereForCausalLM, _LLAMA_LIKE),
    "gptj": (
        tf.GPTJConfig,
        tf.GPTJForCausalLM,
        dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=512, rotary_dim=8),
    ),
    "opt": (
        tf.OPTConfig,
        tf.OPTForCausalLM,
        dict(
            vocab_size=VOCAB,
            hidden_size=64,
            ffn_dim=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=512,
            word_embed_proj_dim=64,
        ),
    ),
    "gpt2": (
        tf.GPT2Config,
        tf.GPT2LMHeadModel,
        dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=512),
    ),
}
# Families whose attention does not go through transformers' attention interface: refused from the config.
REFUSED: dict[str, tuple[type, dict[str, Any]]] = {
    "falcon": (tf.FalconConfig, dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)),
    "bloom": (tf.BloomConfig, dict(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4)),
    "mpt": (tf.MptConfig, dict(vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4)),
}
SLIDING = [name for name, (_, _, options) in FAMILIES.items() if options.get("sliding_window")]


def family_config(name: str) -> Any:
    config_cls, _, options = FAMILIES[name]
    return config_cls(**options)


def build(name: str) -> Any:
    """The family's tiny model, deterministic, with its own eager attention as its implementation."""
    config = family_config(name)
    config._attn_implementation = "eager"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = FAMILIES[name][1](config).eval()
    model.generation_config.eos_token_id = None  # never stop early: every run has the same length
    return model


def family_greedy(model: Any, ids: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    out = model.generate(
        torch.tensor([ids]), max_new_tokens=n, do_sample=False, output_logits=True, return_dict_in_generate=True
    )
    return out.sequences[0, len(ids) :].tolist(), torch.stack(out.logits)[:, 0].float()


@contextmanager
def kept_set_masks(model: Any, trace: list[list[torch.Tensor]], steps: list[tuple[int, int]]) -> Iterator[None]:
    """While active, the family's own ``eager_attention_forward`` also hides from forward i (feeding positions
    ``steps[i]``) every past key that kvbench's layer did not hold after forward i - 1 (``trace[i - 1]``: per
    layer, per KV head, the kept positions). Keys are placed by position from transformers' own cache, which
    holds a sliding layer's last window - 1 keys and a full layer's every key."""
    module = sys.modules[type(model).__module__]
    family_eager = module.eager_attention_forward
    step = {"i": 0}

    def masked(
        attn: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, **kwargs: Any
    ) -> Any:
        i = step["i"]
        if i > 0:
            start, end = steps[i]
            n, hq = key.shape[2], query.shape[1]
            positions = torch.arange(end - n, end)
            held = trace[i - 1][attn.layer_idx]  # [kv heads, kept]
            visible = (positions.view(1, -1, 1) == held.unsqueeze(1)).any(-1) | (positions >= start)
            visible = visible.repeat_interleave(hq // visible.shape[0], dim=0)  # [query heads, n]
            hide = torch.zeros(visible.shape, dtype=query.dtype).masked_fill(~visible, torch.finfo(query.dtype).min)
            hide = hide[None, :, None, :]
            mask = hide if mask is None else mask + hide
        return family_eager(attn, query, key, value, mask, **kwargs)

    module.eager_attention_forward = masked
    try:
        yield step
    finally:
        module.eager_attention_forward = family_eager


@torch.inference_mode()
def eager_replay(
    model: Any, ids: list[int], tokens: list[int], trace: list[list[torch.Tensor]] | None, stride: int | None
) -> torch.Tensor:
    """The family's logits at each of kvbench's forwards (prompt chunks, then one token each), with transformers'
    own cache and eager attention; ``trace`` masks each forward down to what kvbench held (None: no mask)."""
    chunk = stride or len(ids)
    steps = [(s, min(len(ids), s + chunk)) for s in range(0, len(ids), chunk)]
    steps += [(len(ids) + j, len(ids) + j + 1) for j in range(len(tokens) - 1)]
    sequence = ids + tokens
    cache = tf.DynamicCache(config=model.config)
    logits = []
    with kept_set_masks(model, trace or [], steps if trace else []) as step:
        for i, (start, end) in enumerate(steps):
            step["i"] = i if trace else 0
            out = model(
                input_ids=torch.tensor([sequence[start:end]]),
                position_ids=torch.arange(start, end)[None],
                past_key_values=cache,
                use_cache=True,
            )
            cache = out.past_key_values
            if end >= len(ids):
                logits.append(out.logits[0, -1].float())
    return torch.stack(logits)
