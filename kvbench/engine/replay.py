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
from typing import TYPE_CHECKING, Any, cast

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
CHUNK_QUERY_BLOCK = 128  # queries whose logits over the chunk are materialised at once (fused attention)
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
    from a softmax over the sink entries, the chunk and the pass's own tokens (causal); 0 elsewhere. Each block of
    queries' logits over those keys is materialised (``replay_attention`` is the fused path)."""
    hq, q = query.shape[1], query.shape[2]
    hkv, n = key.shape[1], key.shape[2]
    seen, scored = _seen(layer, span, n - q)
    keys = torch.cat([key[0, :, seen], key[0, :, n - q :]], dim=1).float()  # [hkv, m, D]
    own = seen.shape[0]
    queries = query[0].float().view(hkv, hq // hkv, q, -1) * access.scaling
    weight = _weight(layer, value, seen, scored)
    log_weights = layer.query_log_weight if weight is not None else None
    count = scored.shape[0]
    columns = _columns(scored)
    best = torch.zeros(hkv, count, device=key.device)
    for lo in range(0, q if count else 0, QUERY_BLOCK):
        hi = min(q, lo + QUERY_BLOCK)
        logits = softcapped(torch.matmul(queries[:, :, lo:hi], keys.transpose(1, 2).unsqueeze(1)), access.softcap)
        later = torch.arange(lo, hi, device=key.device).unsqueeze(1) < torch.arange(q, device=key.device)
        logits[..., own:].masked_fill_(later, float("-inf"))
        # A probability is exp(logit - logsumexp): the largest over queries is taken on the logits, and only the
        # chunk's [hkv, group, chunk] maxima are exponentiated (a softmax would exponentiate every logit).
        normaliser = _shifted(torch.logsumexp(logits, dim=-1, keepdim=True), log_weights, lo, hi)
        best = _fold(best, logits[..., columns], normaliser, weight, 2)
    return {"replay_max": _scattered(best, seen[scored], n)}


def replay_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer: CacheLayer,
    span: Reconstruction,
    access: KeyAccess,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A replay pass's output [1, q, hq, Dv] (every key visible, causal among the pass's own) and
    ``replay_statistics`` from fused attention, for a CPU layer with no softcap, window or hidden entries. Three
    fused attentions, over the sinks and the chunk, over the pass's own tokens (causal) and over the other entries,
    each give their output and each query's logsumexp: the first two's logsumexps make the reconstruction softmax's
    normaliser, and all three, merged by their logsumexps, the output. Only the chunk's logits are then
    materialised, a block of queries at a time."""
    hq, q = query.shape[1], query.shape[2]
    hkv, n = key.shape[1], key.shape[2]
    group, past = hq // hkv, n - q
    seen, scored = _seen(layer, span, past)
    others = torch.ones(past, dtype=torch.bool, device=key.device)
    others[seen] = False
    rest = others.nonzero().squeeze(1)
    queries = query.float()
    grouped = queries.reshape(1, hkv, group * q, -1)  # a KV head's query heads share its keys: one row each
    own = lambda t: t[0, :, past:].float().unsqueeze(1).expand(hkv, group, q, -1).reshape(1, hq, q, -1)  # noqa: E731
    parts = [
        _fused(grouped, key[:, :, seen].float(), value[:, :, seen].float(), access, False, q),
        _fused(queries, own(key), own(value), access, True, q),
    ]
    lse = torch.logaddexp(parts[0][1], parts[1][1])  # [1, hq, q]: the reconstruction softmax's normaliser
    if rest.shape[0]:
        parts.append(_fused(grouped, key[:, :, rest].float(), value[:, :, rest].float(), access, False, q))
    total = lse if len(parts) == 2 else torch.logaddexp(lse, parts[2][1])
    output = sum(out * (part - total).exp_().unsqueeze(-1) for out, part in parts)
    assert isinstance(output, torch.Tensor)
    weight = _weight(layer, value, seen, scored)
    log_weights = layer.query_log_weight if weight is not None else None
    count = scored.shape[0]
    chunk_keys = key[0, :, seen[scored]].float().transpose(1, 2)  # [hkv, D, c]
    # Query-major [hkv, q, group, .]: a block of a KV head's queries is one contiguous operand of one product (a
    # product per KV head uses every thread, where a batched one over few heads would leave some idle).
    scaled = queries[0].view(hkv, group, q, -1).transpose(1, 2).mul(access.scaling).contiguous()
    normalisers = _shifted(lse.view(hkv, group, q, 1), log_weights, 0, q).transpose(1, 2).contiguous()
    best = torch.zeros(hkv, count, device=key.device)
    for head in range(hkv):
        for lo in range(0, q if count else 0, CHUNK_QUERY_BLOCK):
            hi = min(q, lo + CHUNK_QUERY_BLOCK)
            logits = torch.mm(scaled[head, lo:hi].view(-1, scaled.shape[-1]), chunk_keys[head])
            head_weight = None if weight is None else weight[head]
            view = logits.view(hi - lo, group, count)
            best[head] = _fold(best[head], view, normalisers[head, lo:hi], head_weight, 0)
    stats = {"replay_max": _scattered(best, seen[scored], n)}
    return output.transpose(1, 2).contiguous().to(query.dtype), stats


def _fused(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, access: KeyAccess, causal: bool, q: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU fused attention of queries [1, h, r, D] over keys and values [1, h, m, D] (``causal``: r = m, query i
    sees keys up to i): the output [1, hq, q, Dv] and each query's logsumexp [1, hq, q], for h = hq, or h = hkv
    with a KV head's rows its query heads' q queries each."""
    output, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        queries, keys, values, dropout_p=0.0, is_causal=causal, scale=access.scaling
    )
    return output.reshape(1, -1, q, output.shape[-1]), lse.reshape(1, -1, q)


def _seen(layer: CacheLayer, span: Reconstruction, past: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The indices of the past entries a pass's softmax spans (its sinks and its chunk), and the chunk's among
    them."""
    positions = layer.key_positions
    assert positions is not None, "the layer knows its keys' positions while it attends"
    held = positions[0, :past]
    if bool((positions[:, :past] != held).any()):
        raise RuntimeError("a replay pass needs every row of a layer to hold the same prompt positions")
    sinks = (held >= 0) & (held < span.sinks)
    chunk = (held >= span.start) & (held < span.end)
    seen = (sinks | chunk).nonzero().squeeze(1)
    return seen, chunk[seen].nonzero().squeeze(1)


def _weight(layer: CacheLayer, value: torch.Tensor, seen: torch.Tensor, scored: torch.Tensor) -> torch.Tensor | None:
    """KVzip+'s and KVgrad's ‖W_o v‖ of the chunk's entries [hkv, group, c] (None for KVzip)."""
    replay = layer.policy.replay
    if replay is None or not (replay.plus or replay.gradient):
        return None
    if layer.query_log_weight is None:
        raise RuntimeError("a weighted replay pass reads its queries' weights: hidden_norms or gradient_pass set them")
    return _output_norms(layer, value[0, :, seen[scored]])


def _columns(scored: torch.Tensor) -> slice | torch.Tensor:
    """The chunk's columns among those seen: a slice where they are one run (as once the prompt is packed), so that
    they are read as a view, not gathered."""
    count = scored.shape[0]
    if count and int(scored[-1]) - int(scored[0]) + 1 == count:
        return slice(int(scored[0]), int(scored[0]) + count)
    return scored


def _shifted(normaliser: torch.Tensor, log_weights: torch.Tensor | None, lo: int, hi: int) -> torch.Tensor:
    """A block of queries' log-normalisers [hkv, group, b, 1], less the log of their weights [q] (KVzip+: one over
    the hidden state's norm; KVgrad: the norm of the objective's gradient at the attention's output)."""
    if log_weights is None:
        return normaliser
    return normaliser - log_weights[lo:hi].view(1, 1, -1, 1)


def _fold(
    best: torch.Tensor, logits: torch.Tensor, normaliser: torch.Tensor, weight: torch.Tensor | None, queries: int
) -> torch.Tensor:
    """``best`` [hkv, c] (or one KV head's [c]) raised to a block's largest probability (times KVzip+'s weight) of
    each chunk entry, from its logits (overwritten) and log-normalisers, [hkv, group, b, .] or (one KV head's)
    [b, group, .], the queries' dimension ``queries``."""
    top = logits.sub_(normaliser).amax(dim=queries).exp_()  # [hkv, group, c] or [group, c]
    if weight is not None:
        top *= weight
    return torch.maximum(best, top.amax(dim=-2))


def _scattered(best: torch.Tensor, entries: torch.Tensor, n: int) -> torch.Tensor:
    """The chunk's maxima [hkv, c] at their entries of the layer's n, 0 elsewhere."""
    out = torch.zeros(best.shape[0], n, device=best.device)
    out[:, entries] = best
    return out


def _output_norms(layer: CacheLayer, values: torch.Tensor) -> torch.Tensor:
    """‖W_o v‖ per query head of each KV head's group, [hkv, group, c], for values [hkv, c, D]: per KV head, a block
    of values times its group's W_o columns is one product ([D, group · hidden]), its norms taken while it is small."""
    w_o = layer.inputs.weights[layer.layer_idx]["output_projection"].float()
    hkv, c, dim = values.shape
    hidden = w_o.shape[0]
    group = w_o.shape[1] // (hkv * dim)
    w = w_o.view(hidden, hkv, group, dim).permute(1, 3, 2, 0).reshape(hkv, dim, group * hidden)
    out = values.new_empty(hkv, c, group, dtype=torch.float32)
    for head in range(hkv):
        for lo in range(0, c, VALUE_BLOCK):
            block = values[head, lo : lo + VALUE_BLOCK].float()
            out[head, lo : lo + VALUE_BLOCK] = torch.mm(block, w[head]).view(-1, group, hidden).norm(dim=-1)
    return out.transpose(1, 2)


@contextlib.contextmanager
def hidden_norms(model: Any, cache: KVCache, wanted: bool) -> Iterator[None]:
    """While ``wanted`` (a KVzip+ pass), each attention module leaves one over the norms of its input hidden states
    [q] (as logs) on its cache layer, as its queries' weights for ``replay_statistics``."""
    if not wanted:
        yield
        return

    def keep(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        weight = hidden[0].float().norm(dim=-1).log().neg()  # one over the norm, as a log
        cache.kv_layers[int(module.layer_idx)].query_log_weight = weight  # type: ignore[arg-type]

    hooks = [m.register_forward_pre_hook(keep, with_kwargs=True) for m in attention_modules(model)]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
        for layer in cache.kv_layers:
            layer.query_log_weight = None


def attention_modules(model: Any) -> list[torch.nn.Module]:
    """The model's attention modules, by layer: those that number their layer and project their output."""
    modules = [
        m
        for m in model.modules()
        if isinstance(getattr(m, "layer_idx", None), int) and projection(m, "output_projection") is not None
    ]
    return sorted(modules, key=lambda m: cast(int, m.layer_idx))
