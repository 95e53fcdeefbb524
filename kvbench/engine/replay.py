"""KVzip's replay passes (``policies.inputs.Replay``): after the prompt, "repeat the previous context" is fed over
the whole prompt's cache, a chunk of the prompt at a time; what each pass's queries give the chunk's entries is
the score's ``replay_max``. The batch loop runs the passes inside the prefill (so their time and memory are the
prefill's) as steps with a ``Reconstruction``: the attention computes the model's output as for any chunk, and
here the reconstruction attention; the cache drops each pass's own entries when it finishes; the last pass evicts.

The passes follow kvpress's KVzipPress (as the paper's code): the instruction "Repeat the previous context
exactly." (later passes: "Repeat the part of the previous context exactly, starting with" and the previous
chunk's last tokens), the chat template's assistant header, then the chunk. A prompt that begins with the chat
template's header is repeated from after it (the header is never scored).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from kvbench.engine.blocked import softcapped
from kvbench.engine.score_inputs import projection
from kvbench.engine.step import Reconstruction
from kvbench.engine.visibility import KeyAccess
from kvbench.policies.inputs import Replay

if TYPE_CHECKING:
    from kvbench.engine.cache.cache import KVCache
    from kvbench.engine.cache.layer import CacheLayer

FIRST = "\n\nRepeat the previous context exactly."
LATER = "\n\nRepeat the part of the previous context exactly, starting with"
QUERY_BLOCK = 256  # reconstruction queries attended at once
VALUE_BLOCK = 512  # values projected through W_o at once (KVzip+)

Pass = tuple[Reconstruction, list[int]]


def template_ends(tokenizer: Any) -> tuple[list[int], list[int]]:
    """The chat template's ids before a user message's text, and after it up to the assistant's turn (no
    template: none, and a newline)."""
    encode = lambda text: list(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    if getattr(tokenizer, "chat_template", None) is None:
        return [], encode("\n")
    dummy = "dummy context"
    separator = "\n" + "#" * len(dummy)
    kwargs = {"add_generation_prompt": True, "tokenize": False, "enable_thinking": False}
    text = tokenizer.apply_chat_template([{"role": "user", "content": dummy + separator}], **kwargs)
    before, after = text.split(separator)
    return encode(before.split(dummy)[0]), encode(after)


def passes(tokenizer: Any, input_ids: list[int], replay: Replay | None) -> list[Pass]:
    """The prompt's replay passes: what each repeats, and the ids it feeds (none for a policy that does not
    replay). Without a tokenizer (a library call given none) a pass feeds no instruction, only the previous
    chunk's last tokens and its chunk."""
    if replay is None:
        return []
    prefix: list[int] = []
    first: list[int] = []
    later: list[int] = []
    header: list[int] = []
    if tokenizer is not None:
        prefix, header = template_ends(tokenizer)
        first = list(tokenizer.encode(FIRST, add_special_tokens=False))
        later = list(tokenizer.encode(LATER, add_special_tokens=False))
    start = len(prefix) if prefix and input_ids[: len(prefix)] == prefix and len(prefix) < len(input_ids) else 0
    out: list[Pass] = []
    for lo in range(start, len(input_ids), replay.chunk):
        hi = min(lo + replay.chunk, len(input_ids))
        chunk = input_ids[lo:hi]
        previous = input_ids[max(start, lo - replay.postfix) : lo] if replay.postfix and lo > start else []
        instruction = first if lo == start else later + previous
        out.append((Reconstruction(lo, hi, min(replay.n_sink, lo)), instruction + header + chunk))
    return out


def replay_statistics(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer: CacheLayer,
    span: Reconstruction,
    access: KeyAccess,
) -> dict[str, torch.Tensor]:
    """``replay_max`` [kv heads, n] of a replay pass's layer (query [1, hq, q, D], key and value [1, hkv, n, D]):
    per chunk entry, the largest over the pass's queries and the KV head's query heads of the probability it gets
    from a softmax over the sink entries, the chunk and the pass's own tokens (causal); 0 elsewhere."""
    hq, q = query.shape[1], query.shape[2]
    hkv, n = key.shape[1], key.shape[2]
    group, past = hq // hkv, n - q
    positions = layer.key_positions
    assert positions is not None, "the layer knows its keys' positions while it attends"
    held = positions[0, :past]
    if bool((positions[:, :past] != held).any()):
        raise RuntimeError("a replay pass needs every row of a layer to hold the same prompt positions")
    sinks = (held >= 0) & (held < span.sinks)
    chunk = (held >= span.start) & (held < span.end)
    seen = (sinks | chunk).nonzero().squeeze(1)
    scored = chunk[seen].nonzero().squeeze(1)  # the chunk's columns among those seen
    keys = torch.cat([key[0, :, seen], key[0, :, past:]], dim=1).float()  # [hkv, m, D]
    own = seen.shape[0]
    queries = query[0].float().view(hkv, group, q, -1) * access.scaling
    replay = layer.policy.replay
    plus = replay is not None and replay.plus
    if plus and layer.hidden_norm is None:
        raise RuntimeError("a KVzip+ pass reads its queries' hidden states: run it inside engine.replay.hidden_norms")
    weight = _output_norms(layer, value[0, :, seen[scored]]) if plus else None
    best = torch.zeros(hkv, scored.shape[0], device=key.device)
    for lo in range(0, q, QUERY_BLOCK):
        hi = min(q, lo + QUERY_BLOCK)
        logits = softcapped(torch.matmul(queries[:, :, lo:hi], keys.transpose(1, 2).unsqueeze(1)), access.softcap)
        later = torch.arange(lo, hi, device=key.device).unsqueeze(1) < torch.arange(q, device=key.device)
        logits[..., own:].masked_fill_(later, float("-inf"))
        probs = logits.softmax(dim=-1)[..., scored]  # [hkv, group, rows, chunk]
        if weight is not None:
            assert layer.hidden_norm is not None, "KVzip+ reads the queries' hidden-state norms"
            probs = probs / layer.hidden_norm[lo:hi].float().view(1, 1, -1, 1) * weight.unsqueeze(2)
        best = torch.maximum(best, probs.amax(dim=(1, 2)))
    out = torch.zeros(hkv, n, device=key.device)
    out[:, seen[scored]] = best
    return {"replay_max": out}


def _output_norms(layer: CacheLayer, values: torch.Tensor) -> torch.Tensor:
    """‖W_o v‖ per query head of each KV head's group, [hkv, group, c], for values [hkv, c, D]."""
    w_o = layer.inputs.weights[layer.layer_idx]["output_projection"].float()
    hkv, c, dim = values.shape
    w = w_o.view(w_o.shape[0], hkv, -1, dim)  # [hidden, hkv, group, D]
    parts = [
        torch.einsum("jhgi,hti->hgtj", w, values[:, lo : lo + VALUE_BLOCK].float()).norm(dim=-1)
        for lo in range(0, c, VALUE_BLOCK)
    ]
    return torch.cat(parts, dim=2) if parts else values.new_zeros(hkv, w.shape[2], 0)


@contextlib.contextmanager
def hidden_norms(model: Any, cache: KVCache, wanted: bool) -> Iterator[None]:
    """While ``wanted`` (a KVzip+ pass), each attention module leaves the norms of its input hidden states [q] on
    its cache layer, for ``replay_statistics``."""
    if not wanted:
        yield
        return

    def keep(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        cache.kv_layers[int(module.layer_idx)].hidden_norm = hidden[0].float().norm(dim=-1)  # type: ignore[arg-type]

    modules = [
        m
        for m in model.modules()
        if isinstance(getattr(m, "layer_idx", None), int) and projection(m, "output_projection") is not None
    ]
    hooks = [m.register_forward_pre_hook(keep, with_kwargs=True) for m in modules]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
        for layer in cache.kv_layers:
            layer.hidden_norm = None
