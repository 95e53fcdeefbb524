"""The attention function kvbench registers with transformers: the family's own attention, over the cache.

Every argument the attention interface hands over is either implemented or refused (``family_arguments``):
the layer's sliding window, by absolute position (key k is visible to query q when ``0 <= q - k < window``);
logit softcapping (``cap · tanh(logit / cap)`` before the mask, Gemma 2); the family's scaling.

A decode step (one query per sequence, several sequences at once) attends over its rows' slots, each row
masked to what it holds (``CacheLayer.visible``: free slots, masked replay) where needed. One unmasked
sequence without statistics takes transformers' SDPA; otherwise one batched product per row gives the output
and the statistics from the same probabilities (for several sequences about as fast as SDPA on CPU: docs/perf/batch.md).
A prompt chunk is one sequence's. Where no statistic needs every query, its output comes from SDPA with a mask
built per layer (causal inside the chunk, every kept past entry visible except what the window or ``visible``
hides) and the few rows a policy reads (the last query, an observation window) from
``blocked.attention_statistics``; a chunk whose statistics sum over every query, or a softcapped one (SDPA
cannot softcap), takes its output and statistics from one blocked pass (``engine/blocked.py``). Once the
output exists the layer records the statistics (``CacheLayer.record``); the cache evicts when the step
finishes. Under ``policy.channels`` the layer notes a context's last queries, and once its keys are pruned each
query is narrowed to its KV head's kept channels before any product. A policy that needs no statistics pays
nothing, and once no later step will evict (``Step.collects``) none are computed. The attention finds the cache of
the forward under way through ``attending``, which the batch loop holds around each forward.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import TYPE_CHECKING, cast

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvbench.engine.blocked import attention_statistics
from kvbench.engine.decode_attention import Selector, decode_attention
from kvbench.engine.masked_sdpa import masked_sdpa
from kvbench.engine.replay_pass import replay_pass
from kvbench.engine.visibility import KeyAccess
from kvbench.policies.statistics import NOTHING, Collecting, Logged, Summed, attention_names, declared
from kvbench.stages import Phase

if TYPE_CHECKING:
    from kvbench.engine.cache.cache import KVCache
    from kvbench.engine.cache.layer import CacheLayer
    from kvbench.engine.step import Step

ATTN_NAME = "kvbench"
# Arguments of transformers' attention interface that carry nothing kvbench must compute (bookkeeping the
# model also hands to every other attention function). Any other argument with a value is refused.
PASSIVE_ARGUMENTS = frozenset({"position_ids", "use_cache", "cache_position", "output_attentions"})


def family_arguments(layer_idx: int, kwargs: dict, planned_window: int | None) -> tuple[int | None, float | None]:
    """The sliding window and softcap the model asks for; anything else it asks for is refused, never ignored.
    The window must be the one the cache was planned with (decided from the config before the run). Consumes
    ``kwargs``."""
    window = kwargs.pop("sliding_window", None)
    softcap = kwargs.pop("softcap", None)
    dropout = kwargs.pop("dropout", 0.0)
    if dropout:
        raise ValueError(f"attention dropout {dropout} is on: kvbench measures inference; call model.eval()")
    if kwargs.pop("output_attentions", False):
        raise ValueError("output_attentions=True is not supported: kvbench's attention returns no weights")
    unknown = sorted(k for k, v in kwargs.items() if v is not None and k not in PASSIVE_ARGUMENTS)
    if unknown:
        raise ValueError(
            f"the model's attention asks for {', '.join(unknown)}, which kvbench does not implement; "
            "this model family is not supported (see docs/models.md's family table)"
        )
    if window != planned_window:
        raise RuntimeError(
            f"layer {layer_idx}: the model attends with sliding_window={window}, but the cache was "
            f"planned for {planned_window} (kvbench.families.layer_windows disagrees with the model)"
        )
    return window, softcap


def kvbench_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    cache = attended_cache()
    if cache is None:  # a plain call (no kvbench cache): behave exactly like SDPA
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    layer_idx = cast(int, module.layer_idx)  # every transformers attention module numbers its layer
    layer = cache.kv_layers[layer_idx]
    step = layer.current.step
    kwargs["dropout"] = dropout  # the rest of kwargs is not read past this point
    size, softcap = family_arguments(layer_idx, kwargs, layer.plan.window)
    q = query.shape[2]
    window = layer.step_window(size)
    access = KeyAccess(
        scaling if scaling is not None else query.shape[-1] ** -0.5, key.shape[2] - q, layer.visible, window, softcap
    )
    if layer.store.channels is not None:  # pruned key channels (policy.channels): the query meets the kept ones
        query = layer.narrow_queries(query)
    elif layer.policy.channels is not None and step.phase is Phase.prefill:
        layer.note_queries(query)
    needs = attention_names(layer.policy.needs) if step.collects else frozenset()
    if not step.prepares:
        needs = needs - {s.name for s in declared(needs, Logged)}
    log = layer.entries.log  # the policy's history, or the question's length where the score observes it
    collecting = Collecting(needs, log.history if log is not None else layer.policy.history) if needs else NOTHING
    if step.replay is not None:
        return replay_pass(module, query, key, value, layer, step.replay, access), None
    if q == 1:
        select = _selector(layer, step)
        # SDPA only for one unmasked sequence: for several, one batched product per row (docs/perf/batch.md).
        plain = query.shape[0] == 1 and layer.visible is None and window is None and select is None
        if needs or softcap is not None or not plain:
            output, stats = decode_attention(query, key, value, access, collecting, select)
        else:
            output, stats = (
                sdpa_attention_forward(
                    module, query, key, value, None, dropout=0.0, scaling=access.scaling, is_causal=False
                )[0],
                {},
            )
        layer.record(_with_queries(stats, layer, step, query, access.scaling))
        return output, None
    if query.shape[0] != 1:
        raise RuntimeError("a prompt chunk is one sequence's: kvbench prefills sequences one at a time")
    # Statistics summed over every query: the output comes from the same blocked pass (one product of queries and
    # keys instead of SDPA's and a second one).
    if softcap is not None or declared(needs, Summed):
        stats = attention_statistics(query, key, access, collecting, value)
        output = stats.pop("output")
        layer.record(_with_queries(stats, layer, step, query, access.scaling))
        return output, None
    output = masked_sdpa(module, query, key, value, access)
    stats = attention_statistics(query, key, access, collecting) if needs else {}
    layer.record(_with_queries(stats, layer, step, query, access.scaling))
    return output, None


def _selector(layer: CacheLayer, step: Step) -> Selector | None:
    """What the policy's decode-time sparsity lets this decode step's query heads attend in this layer (None:
    every visible key): each lane's budget of attended keys (``Step.attended``) holds for its KV heads' rows."""
    sparsity = layer.policy.sparsity
    if sparsity is None or step.attended is None or not sparsity.applies(layer.layer_idx):
        return None
    positions = layer.key_positions
    assert positions is not None, "update sets the step's key positions before the layer attends"
    heads = layer.entries.heads
    budgets = torch.tensor(step.attended, device=positions.device).repeat_interleave(heads)
    query_positions = layer.current.query_positions[:, 0]
    return lambda queries, keys, visible: sparsity.select(queries, keys, positions, visible, query_positions, budgets)


def _with_queries(
    stats: dict[str, torch.Tensor], layer: CacheLayer, step: Step, query: torch.Tensor, scaling: float
) -> dict[str, torch.Tensor]:
    """``stats`` plus, where the policy declared them (``Score.queries``) and the step evicts, the step's last
    queries as ``queries`` [B × kv_heads, group, k, D]: as attention saw them, or with the model's RoPE undone
    (and, with ``ahead``, turned by the mean rotation of the coming positions); with ``scaled``, times the
    family's ``scaling``."""
    wants = layer.policy.queries
    if wants is None or not step.evicts:
        return stats
    b, hq, q, dim = query.shape
    k = min(q, wants.last)
    last = query[:, :, q - k :].clone()  # a copy: a view would hold the whole chunk's queries until the eviction
    if not wants.rope:
        rotaries = layer.inputs.rotaries
        assert rotaries is not None, "the cache keeps the rotaries of a policy reading pre-RoPE queries"
        positions = layer.current.model_positions[:, q - k :].unsqueeze(1)  # [B, 1, k]: where the model rotated
        last = rotaries[layer.layer_idx].unrotate(last, positions)
        if wants.ahead:  # the positions after the step's last: [B, 1, 1, ahead]
            coming = layer.current.model_positions[:, -1:] + torch.arange(1, wants.ahead + 1, device=last.device)
            last = rotaries[layer.layer_idx].averaged(last, coming.view(b, 1, 1, -1))
    if wants.scaled:
        last = last * scaling
    hkv = layer.entries.heads
    return {**stats, "queries": last.reshape(b * hkv, hq // hkv, k, dim)}


AttentionInterface.register(ATTN_NAME, kvbench_attention)


# The cache the model's forward attends over: set for the forward's duration (``attending``), read by the attention
# function, which transformers calls with the layer's tensors but no handle on the cache.
_ATTENDING: contextvars.ContextVar[KVCache | None] = contextvars.ContextVar("kvbench_attending", default=None)


def attended_cache() -> KVCache | None:
    """The cache of the forward under way (None outside ``attending``)."""
    return _ATTENDING.get()


@contextlib.contextmanager
def attending(cache: KVCache) -> Iterator[None]:
    """Route every kvbench attention call of the enclosed forward to ``cache``'s layers."""
    token = _ATTENDING.set(cache)
    try:
        yield
    finally:
        _ATTENDING.reset(token)


@contextlib.contextmanager
def kvbench_attention_enabled(model: PreTrainedModel) -> Iterator[None]:
    """Route the model's attention through kvbench for the duration of a generation."""
    previous = model.config._attn_implementation
    if previous == ATTN_NAME:  # already routed (a run held across steps): nothing to set or restore
        yield
        return
    model.set_attn_implementation(ATTN_NAME)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)
