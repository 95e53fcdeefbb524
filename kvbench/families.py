"""Which model families kvbench runs exactly, decided from the config alone, before any weights load.

kvbench computes attention itself (``kvbench.engine.attention``), so it can only run a family whose attention
goes through transformers' attention interface, and only with the arguments that interface hands over
implemented (sliding window, softcap, scaling). A family whose modules compute attention in their own code
(Falcon, Bloom, MPT) would bypass the cache entirely: it is refused here, never run and labelled ``ok``.
"""

from __future__ import annotations

import inspect
import re
import sys
from typing import Any

LAYER_TYPES = ("full_attention", "sliding_attention")
# What kvbench's attention implements of the arguments a family may hand the attention interface.
IMPLEMENTED_ARGUMENTS = frozenset({"dropout", "scaling", "sliding_window", "softcap"})


class UnsupportedModel(ValueError):
    """A model kvbench cannot run exactly; the message says why and what to do."""


def text_config(config: Any) -> Any:
    """The decoder's config (multimodal configs nest it)."""
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


def causal_lm_class(config: Any) -> type | None:
    """The class ``AutoModelForCausalLM`` would build for this config (imported, not instantiated)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
    if isinstance(name, (list, tuple)):
        name = name[0]
    return getattr(transformers, name, None) if name else None


def support_error(config: Any) -> str | None:
    """Why kvbench cannot run this model exactly (one line naming what to do), or None."""
    family = getattr(config, "model_type", "?")
    if getattr(config, "is_encoder_decoder", False):
        return f"model family {family!r} is an encoder-decoder; kvbench runs decoder-only causal LMs"
    cls = causal_lm_class(config)
    if cls is None:
        return f"model family {family!r} has no causal-LM class in transformers; kvbench runs decoder-only LMs"
    if not getattr(cls, "_supports_attention_backend", False):
        return (
            f"model family {family!r} ({cls.__name__}) computes attention in its own code, not through "
            "transformers' attention interface, so kvbench could neither see nor evict its cache; use a family "
            "listed in docs/models.md's family table"
        )
    from kvbench.engine.attention import PASSIVE_ARGUMENTS

    arguments = interface_arguments(cls)
    if arguments is not None:
        missing = sorted(arguments - IMPLEMENTED_ARGUMENTS - PASSIVE_ARGUMENTS)
        if missing:
            return (
                f"model family {family!r} hands its attention {', '.join(missing)}, which kvbench's attention "
                "does not implement (e.g. learned attention sinks); use a family listed in docs/models.md's family "
                "table"
            )
        if "sliding_window" not in arguments and any(w is not None for w in layer_windows(config)):
            return (
                f"model family {family!r} applies its sliding window through the mask alone, which kvbench "
                "does not read; use a family listed in docs/models.md's family table"
            )
    unknown = sorted(set(getattr(text_config(config), "layer_types", None) or ()) - set(LAYER_TYPES))
    if unknown:
        return (
            f"model family {family!r} has layers of type {', '.join(unknown)}; kvbench implements "
            f"{', '.join(LAYER_TYPES)} only"
        )
    return None


def interface_arguments(cls: type) -> set[str] | None:
    """The keyword arguments the family's modeling code hands transformers' attention interface, read from its
    source (None where the source cannot be read: the attention function then refuses at the first call)."""
    try:
        source = inspect.getsource(sys.modules[cls.__module__])
    except (OSError, TypeError, KeyError):
        return None
    names: set[str] = set()
    for call in re.finditer(r"attention_interface\(", source):
        depth, top, i = 1, [], call.end()
        while depth and i < len(source):  # the call's text at its own nesting level only
            char = source[i]
            depth += char == "("
            depth -= char == ")"
            if depth == 1 and char != "(":
                top.append(char)
            i += 1
        names |= set(re.findall(r"(?<![=!<>])\b(\w+)\s*=(?!=)", "".join(top)))
    return names


def check_supported(config: Any) -> None:
    problem = support_error(config)
    if problem:
        raise UnsupportedModel(problem)


def layer_windows(config: Any) -> list[int | None]:
    """Each decoder layer's sliding window (None: full attention), as the model's attention modules apply it:
    per ``layer_types`` where the config has them, else the config's ``sliding_window`` on every layer (Mistral,
    Phi-3, Starcoder2). The attention function checks every step that the model agrees."""
    config = text_config(config)
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    n = config.num_hidden_layers
    if types:
        return [window if kind == "sliding_attention" else None for kind in types]
    return [window] * n


def kv_heads(config: Any) -> int:
    """The model's KV heads per layer (its query heads where the config names no GQA)."""
    config = text_config(config)
    for name in ("num_key_value_heads", "num_attention_heads", "n_head"):
        if getattr(config, name, None):
            return int(getattr(config, name))
    raise ValueError(f"{type(config).__name__} names no attention head count")


def policy_problem(config: Any, policy: Any) -> str | None:
    """Why this policy cannot run exactly on this model (a family that bypasses the attention interface,
    re-indexed positions or pre-RoPE queries without a RoPE kvbench can undo, merging inside sliding layers, a
    per-layer budget list of another length than the layers under the budget, per-head weights measured on a
    model of other layer or head counts), or None."""
    from kvbench.engine.plan import layers_problem, sliding_problem
    from kvbench.policies.positions import QUERIES_BEFORE_ROPE, reindex_refusal, rope_refusal

    problem = support_error(config)
    if problem is None and policy.evicts and policy.positions == "reindex":
        problem = reindex_refusal(config)
    if problem is None and policy.queries is not None and not policy.queries.rope:
        problem = rope_refusal(config, None, *QUERIES_BEFORE_ROPE)
    windows = layer_windows(config)
    problem = problem or sliding_problem(policy, windows) or layers_problem(policy, windows)
    if problem is None and policy.evicts:
        problem = policy.allocation.heads_problem(len(windows), kv_heads(config))
    return problem or policy.model_problem(config)
