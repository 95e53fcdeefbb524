"""What a score declared besides statistics (``policies.inputs``), as the cache holds it for the score: the
layer weights its features read (found in the model's attention modules, handed over one KV head at a time) and
the evicting step's queries (kept by the attention until the step's eviction)."""

from __future__ import annotations

from typing import Any

import torch

from kvbench.policies.policy import Policy
from kvbench.policies.positions import QUERIES_BEFORE_ROPE, Rotary, rope_refusal, score_rotaries

# Where each declared weight lives in a transformers attention module: the first of these its family has.
ATTRIBUTES = {"output_projection": ("o_proj", "dense", "out_proj", "c_proj")}


def projection(module: torch.nn.Module, name: str) -> torch.Tensor | None:
    """The weight ``name`` of one attention module as a Linear holds it, [out, in] (GPT-2's Conv1D holds it
    transposed), or None where the module has none of ``ATTRIBUTES[name]``."""
    for attribute in ATTRIBUTES[name]:
        layer = getattr(module, attribute, None)
        if isinstance(layer, torch.nn.Linear):
            return layer.weight.detach()
        if layer is not None and type(layer).__name__ == "Conv1D":
            return layer.weight.detach().T
    return None


def attention_weights(module: torch.nn.Module, names: frozenset[str]) -> dict[str, torch.Tensor]:
    """The weights ``names`` of one attention module, by name."""
    out = {}
    for name in sorted(names):
        weight = projection(module, name)
        if weight is None:
            raise ValueError(
                f"the model's attention {type(module).__name__} has none of {', '.join(ATTRIBUTES[name])}: a score "
                f"reading {name} cannot run on this family"
            )
        out[name] = weight
    return out


def per_head(
    weights: dict[str, torch.Tensor], rows: torch.Tensor, heads: int
) -> list[tuple[torch.Tensor | slice, dict[str, torch.Tensor]]]:
    """(which of the entries, the weights of their KV head) for entries of ``rows`` [m] (row % heads is the KV
    head): the output projection's columns of the head's GQA group, [hidden, group × head_dim]. No weights: every
    entry at once (``slice(None)``)."""
    if not weights:
        return [(slice(None), {})]
    out: list[tuple[torch.Tensor | slice, dict[str, torch.Tensor]]] = []
    head_of = rows % heads
    for h in head_of.unique().tolist():
        columns = {name: w.view(w.shape[0], heads, -1)[:, h] for name, w in weights.items()}
        out.append(((head_of == h).nonzero().squeeze(1), columns))
    return out


def layer_weights(model: Any, names: frozenset[str], layers: int) -> list[dict[str, torch.Tensor]]:
    """Per decoder layer, the weights ``names`` of its attention module (none asked: empty dicts)."""
    if not names:
        return [{} for _ in range(layers)]
    if model is None:
        raise ValueError(f"a score reading {', '.join(sorted(names))} needs the model to build the cache")
    found = {
        m.layer_idx: attention_weights(m, names)
        for m in model.modules()
        if isinstance(getattr(m, "layer_idx", None), int) and all(projection(m, n) is not None for n in names)
    }
    if sorted(found) != list(range(layers)):
        wanted = sorted({a for name in names for a in ATTRIBUTES[name]})
        raise ValueError(
            f"a score reads {', '.join(sorted(names))}, but only layers {sorted(found)} of {layers} have an attention "
            f"module with one of {', '.join(wanted)}: this family is not supported by that score"
        )
    return [found[layer] for layer in range(layers)]


class ScoreInputs:
    """Per layer, the weights the policy's score declared and this step's queries ([rows of the step, group, k,
    D], set by the attention where the score declared them), with the rotaries that undo RoPE on them (and that a
    score reading RoPE, ``Score.rope``, rotates with)."""

    def __init__(self, model: Any, policy: Policy, layers: int):
        self.weights = layer_weights(model, policy.weights, layers)
        wants = policy.queries
        self.rotaries: list[Rotary] | None = None
        if policy.rope or (wants is not None and not wants.rope):
            if model is None:
                raise ValueError("a score reading queries before RoPE, or RoPE itself, needs the model")
            problem = rope_refusal(model.config, None, *QUERIES_BEFORE_ROPE) if wants and not wants.rope else None
            if problem:
                raise ValueError(problem)
            self.rotaries = score_rotaries(model)
        self.queries: list[torch.Tensor | None] = [None] * layers
