"""The attention of a replay pass of the prompt (``policies.inputs.Replay``: KVzip, KVgrad), fed after it by the
batch loop: the model's output as for any chunk, and the pass's reconstruction attention for the layer's score."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvbench.engine.blocked import attention_statistics
from kvbench.engine.decode_attention import decode_attention
from kvbench.engine.masked_sdpa import masked_sdpa
from kvbench.engine.replay import replay_attention, replay_statistics
from kvbench.engine.replay_gradient import gradient_pass_output
from kvbench.engine.visibility import KeyAccess
from kvbench.policies.statistics import NOTHING

if TYPE_CHECKING:
    from kvbench.engine.cache.layer import CacheLayer
    from kvbench.engine.step import Reconstruction


def replay_pass(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer: CacheLayer,
    span: Reconstruction,
    access: KeyAccess,
) -> torch.Tensor:
    """A replay pass of the prompt (KVzip): the model's output as for any step, and, in a layer whose policy
    replays, the reconstruction attention it records (``engine.replay``), both from fused attention on CPU where
    nothing hides an entry or changes a logit (``replay_attention``). A gradient pass (KVgrad) gives a
    differentiable output and leaves its reconstruction attention for after the backward
    (``engine.replay_gradient``)."""
    replay = layer.policy.replay
    if torch.is_grad_enabled():  # a gradient pass: every layer's output carries the graph, replaying or not
        return gradient_pass_output(query, key, value, layer if replay is not None else None, span, access)
    if replay is not None and replay.gradient:
        raise RuntimeError("a KVgrad replay pass differentiates its forward: run it inside gradient_pass")
    if replay is not None and _fusable(query, access):
        output, stats = replay_attention(query, key, value, layer, span, access)
        layer.record(stats)
        return output
    if query.shape[2] == 1:
        output = decode_attention(query, key, value, access)[0]
    elif access.softcap is not None:
        output = attention_statistics(query, key, access, NOTHING, value).pop("output")
    else:
        output = masked_sdpa(module, query, key, value, access)
    if replay is not None:
        layer.record(replay_statistics(query, key, value, layer, span, access))
    return output


def _fusable(query: torch.Tensor, access: KeyAccess) -> bool:
    """Whether a replay pass takes its output and reconstruction attention from CPU fused attention: a chunk of
    queries on CPU that sees every entry and whose logits are not softcapped."""
    plain = access.softcap is None and access.visible is None and access.window is None
    return plain and query.shape[2] > 1 and query.device.type == "cpu"
