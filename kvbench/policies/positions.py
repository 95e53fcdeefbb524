"""``positions: reindex`` — StreamingLLM's positions within the cache, for RoPE models.

With ``absolute`` (the default) every kept key keeps the rotation of its true position and each new token
is fed at its true index. With ``reindex`` the cache's entries of each head are treated as one contiguous
run: the new tokens of a step are fed at positions P, P+1, … where P is the number of tokens held before
the step (the largest count over layers and heads, when layers or heads hold different counts), and each
head's kept keys are rotated to the positions P - len_h … P - 1 just before the new ones.

To keep that exact over any number of steps, a reindexing cache stores keys *un-rotated* (the rotation of
the position they were fed at is undone once, on write) and rotates them to their current positions when
the attention reads them; re-rotating stored keys in place every step would accumulate rounding error.

That needs the model's exact RoPE for every layer: its pair layout (rotate-half or interleaved, see
``LAYOUTS``), the leading dims it rotates, the frequency table it really uses (read from its buffers, so
rope scaling variants match) and the factor it multiplies cos/sin by (YaRN). It is exact only for static
tables: ``dynamic`` and ``longrope`` switch tables with the sequence length, so a key's rotation could not be
undone later, and models without RoPE (learned positions, ALiBi) have nothing to reindex. ``reindex_refusal``
decides that from the config alone, before any weights load.
"""

from __future__ import annotations

from typing import Any

import torch

# model_type -> how RoPE pairs the dims it rotates: "half" pairs i with i + rot/2 (Llama's rotate_half),
# "interleaved" pairs 2i with 2i + 1 (rotate-every-two). Each entry is checked against the family's own code.
LAYOUTS: dict[str, str] = {
    **dict.fromkeys(
        (
            "llama",
            "mistral",
            "mixtral",
            "qwen2",
            "qwen2_moe",
            "qwen3",
            "qwen3_moe",
            "phi",
            "phi3",
            "stablelm",
            "starcoder2",
            "olmo",
            "olmo2",
            "gemma",
            "gemma2",
            "gemma3_text",
            "gpt_neox",
            "falcon",
        ),
        "half",
    ),
    **dict.fromkeys(("cohere", "cohere2", "gptj"), "interleaved"),
}
# Families known to encode positions without RoPE, and how.
NO_ROPE: dict[str, str] = {
    **dict.fromkeys(
        ("opt", "gpt2", "gpt_bigcode", "gpt_neo", "biogpt", "xglm"), "learned absolute position embeddings"
    ),
    **dict.fromkeys(("bloom", "mpt"), "ALiBi attention biases"),
}
# rope_types whose frequency table is fixed at load: un-rotating then re-rotating is exact.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "proportional")
ABSOLUTE = "use positions=absolute (override: policy.positions=absolute)"


class Rotary:
    """One layer's RoPE: ``rotate`` does what the model does to a key at a position, ``unrotate`` undoes it."""

    def __init__(self, inv_freq: torch.Tensor, layout: str = "half", scale: float = 1.0):
        if layout not in ("half", "interleaved"):
            raise ValueError(f"unknown RoPE layout {layout!r}")
        self.inv_freq = inv_freq.detach().flatten().to(torch.float32).clone()
        self.rot_dim = 2 * self.inv_freq.shape[0]  # leading dims rotated; the rest pass through
        self.layout = layout
        self.scale = float(scale)  # the model multiplies cos and sin by it (YaRN's attention factor)

    @classmethod
    def identity(cls) -> Rotary:
        """A layer that applies no RoPE (e.g. Cohere2's global layers): nothing to rotate."""
        return cls(torch.zeros(0))

    def same_as(self, other: Rotary) -> bool:
        return (self.layout, self.scale, self.rot_dim) == (other.layout, other.scale, other.rot_dim) and bool(
            torch.equal(self.inv_freq, other.inv_freq)
        )

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [..., n, D] as the model rotates it at ``positions`` [..., n]. With ``scale == 1`` negative
        positions undo a rotation; otherwise use ``unrotate`` (which divides the scale out)."""
        return self._apply(x, positions, self.scale)

    def unrotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The inverse of ``rotate(., positions)``: keys as they were before the model's RoPE."""
        return self._apply(x, -positions, 1.0 / self.scale)

    def averaged(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [..., D] turned by the mean of the rotations the model applies at ``positions`` [..., F] (each x
        against its own F positions): E[R_t] x over t uniform among them, Expected Attention's averaged RoPE.
        The mean of rotations is no rotation: each pair is scaled by the mean resultant of its angles."""
        if self.rot_dim == 0:
            return x
        angle = positions.to(torch.float32).unsqueeze(-1) * self.inv_freq.to(x.device)  # [..., F, rot/2]
        return self._turn(x, angle.cos().mean(dim=-2) * self.scale, angle.sin().mean(dim=-2) * self.scale)

    def _apply(self, x: torch.Tensor, positions: torch.Tensor, factor: float) -> torch.Tensor:
        if self.rot_dim == 0:
            return x
        angle = positions.to(torch.float32).unsqueeze(-1) * self.inv_freq.to(x.device)  # [..., n, rot/2]
        cos, sin = angle.cos(), angle.sin()
        if factor != 1.0:
            cos, sin = cos * factor, sin * factor
        return self._turn(x, cos, sin)

    def _turn(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x's rotated dims paired as the model pairs them, each pair (a, b) -> (a cos - b sin, b cos + a sin)."""
        xr = x[..., : self.rot_dim].to(torch.float32)
        if self.layout == "half":
            half = self.rot_dim // 2
            x1, x2 = xr[..., :half], xr[..., half:]
            out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        else:
            x1, x2 = xr[..., 0::2], xr[..., 1::2]
            out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        out = out.to(x.dtype)
        if self.rot_dim == x.shape[-1]:
            return out
        return torch.cat((out, x[..., self.rot_dim :]), dim=-1)


class RowRope:
    """Each row's RoPE, for a view whose rows come from several layers (``runs``: one ``Rotary`` per run of rows
    ``start:end`` of one layer). ``stored_rotated``: the view's keys carry their rotation (``positions:
    absolute``); a reindexing cache stores them un-rotated."""

    def __init__(self, runs: list[tuple[Rotary, int, int]], stored_rotated: bool):
        self.runs, self.stored_rotated = runs, stored_rotated

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [rows, ..., n, D] as each row's layer rotates it at ``positions`` [rows, ..., n] (broadcast)."""
        return self._per_run(x, positions, Rotary.rotate)

    def unrotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The inverse of ``rotate``."""
        return self._per_run(x, positions, Rotary.unrotate)

    def averaged(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [rows, ..., D] rotated at each of ``positions`` [rows, ..., P] (broadcast), averaged over them."""
        return self._per_run(x, positions, Rotary.averaged)

    def before_rope(self, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Keys [rows, n, D] of a view, as the model's projection gave them (before its RoPE)."""
        return self.unrotate(keys, positions) if self.stored_rotated else keys

    def after_rope(self, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Keys [rows, n, D] of a view, rotated at their absolute positions."""
        return keys if self.stored_rotated else self.rotate(keys, positions)

    def _per_run(self, x: torch.Tensor, positions: torch.Tensor, apply: Any) -> torch.Tensor:
        if positions.shape[0] > 1 and bool((positions == positions[:1]).all()):
            positions = positions[:1]  # every row at the same positions (a prompt): one table of angles
        parts = [
            apply(rotary, x[start:end], positions[start:end] if len(positions) > 1 else positions)
            for rotary, start, end in self.runs
        ]
        return parts[0] if len(parts) == 1 else torch.cat(parts)


def rope_free(config: Any) -> bool:
    """Whether the model encodes positions without RoPE (learned embeddings, ALiBi): its keys are as projected."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    model_type = getattr(config, "model_type", None)
    return model_type in NO_ROPE or (model_type == "falcon" and bool(getattr(config, "alibi", False)))


def score_rotaries(model: Any) -> list[Rotary]:
    """Per decoder layer, the RoPE a score reads (``Score.rope``, pre-RoPE queries): the model's own, or the
    identity for a model without RoPE."""
    if rope_free(model.config):
        return [Rotary.identity()] * model.config.get_text_config().num_hidden_layers
    return layer_rotaries(model)


def _rope_parameters(config: Any) -> list[dict]:
    """The config's RoPE parameter dicts: one, or one per layer type (Gemma 3)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if params and all(isinstance(v, dict) for v in params.values()):
        return list(params.values())
    return [params]


REINDEX = ("positions=reindex re-rotates kept keys with RoPE", ABSOLUTE)
# A score reading the queries before RoPE (``Queries(rope=False)``): the model's rotation is undone on them.
QUERIES_BEFORE_ROPE = (
    "the policy's score reads the queries before RoPE (the model's rotation undone on them)",
    "choose a score that reads no pre-RoPE queries",
)


def reindex_refusal(config: Any, name: str | None = None) -> str | None:
    """Why ``positions=reindex`` cannot run on a model with this config (one line, with what to do), or None.
    Needs no weights, so a run can refuse before loading them. ``name`` names the model in the message."""
    return rope_refusal(config, name, *REINDEX)


def rope_refusal(config: Any, name: str | None, lead: str, remedy: str) -> str | None:
    """Why kvbench cannot apply and undo this config's RoPE exactly (``lead``: what needs it; ``remedy``: what to
    do instead), or None."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    model_type = getattr(config, "model_type", None)
    name = name or str(model_type)
    if rope_free(config):
        how = NO_ROPE.get(str(model_type), "ALiBi attention biases")
        return (
            f"{lead}; {model_type} encodes positions with {how}, so {name} has no rotary position embedding; {remedy}"
        )
    if model_type not in LAYOUTS:
        return (
            f"{lead}, but {name} (model_type {model_type!r}) is not a family whose RoPE it knows "
            f"(supported: {', '.join(sorted(LAYOUTS))}); {remedy}"
        )
    for params in _rope_parameters(config):
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in STATIC_ROPE_TYPES:
            why = {
                "dynamic": "recomputes its frequencies as the sequence grows",
                "longrope": "switches frequency tables with the sequence length",
            }.get("dynamic" if "dynamic" in rope_type else rope_type, "is not known to keep one static table")
            return (
                f"{lead}, which is exact only for a static table, but {name} uses rope_type={rope_type!r}, "
                f"which {why} (static types: {', '.join(STATIC_ROPE_TYPES)}); {remedy}"
            )
    return None


def _rotary_module(model: Any, text_config: Any) -> Any:
    """The module holding the decoder's RoPE table(s); for multimodal models, the language model's."""
    found = [
        m
        for m in model.modules()
        if "rotary" in type(m).__name__.lower()
        and any(n.endswith("inv_freq") or n == "embed_positions" for n, _ in m.named_buffers(recurse=False))
    ]
    ours = [m for m in found if getattr(m, "config", None) is text_config] or found
    if not ours:
        raise ValueError(f"positions=reindex found no rotary embedding module in {type(model).__name__}; {ABSOLUTE}")
    if len(ours) > 1:
        raise ValueError(
            f"positions=reindex found {len(ours)} rotary embedding modules in {type(model).__name__} "
            f"and cannot tell which the decoder uses; {ABSOLUTE}"
        )
    return ours[0]


def _gptj_inv_freq(table: torch.Tensor) -> torch.Tensor:
    """GPT-J keeps no inv_freq, only a [max_pos, rot] table of sin | cos: rebuild the frequencies by its own
    formula (base 10000, not configurable) and check they reproduce the model's table."""
    dim = table.shape[-1]
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.int64) / dim))
    angle = torch.arange(table.shape[0], dtype=torch.int64).float()[:, None] * inv_freq
    if not torch.allclose(torch.cat((angle.sin(), angle.cos()), dim=1), table.float().cpu(), atol=1e-2):
        raise ValueError(f"positions=reindex: this GPT-J's sin/cos table is not standard RoPE; {ABSOLUTE}")
    return inv_freq.to(table.device)


def _layer_has_rope(config: Any, layer: int) -> bool:
    """Cohere2 applies RoPE only in its sliding-window layers; every other supported family in all layers."""
    if config.model_type == "cohere2":
        return config.layer_types[layer] == "sliding_attention" and config.sliding_window is not None
    return True


def layer_rotaries(model: Any, why: tuple[str, str] = REINDEX) -> list[Rotary]:
    """One ``Rotary`` per decoder layer, with the tables the model itself uses (Gemma 3's sliding and full layers
    differ), or a ValueError with ``rope_refusal``'s message (``why``: what needs them, what to do instead).
    Layers with equal tables share one object."""
    text = model.config.get_text_config()
    refusal = rope_refusal(model.config, type(model).__name__, *why)
    if refusal:
        raise ValueError(refusal)
    layout = LAYOUTS[text.model_type]
    module = _rotary_module(model, text)
    out: list[Rotary] = []
    for layer in range(text.num_hidden_layers):
        if not _layer_has_rope(text, layer):
            rot = Rotary.identity()
        elif hasattr(module, "embed_positions"):
            rot = Rotary(_gptj_inv_freq(module.embed_positions), layout)
        elif isinstance(getattr(module, "inv_freq", None), torch.Tensor):
            rot = Rotary(module.inv_freq, layout, getattr(module, "attention_scaling", 1.0))
        else:  # one table per layer type (Gemma 3): buffers "<layer_type>_inv_freq"
            kind = text.layer_types[layer]
            rot = Rotary(getattr(module, f"{kind}_inv_freq"), layout, getattr(module, f"{kind}_attention_scaling", 1.0))
        out.append(next((r for r in out if r.same_as(rot)), rot))
    return out
