"""KVgrad's replay passes (``Replay.gradient``): a KVzip pass whose queries are weighed by the gradient of the
pass's objective at their attention output.

The batch loop runs such a pass inside ``gradient_pass``: the model's weights are frozen, the embeddings of the
pass's tokens are the graph's leaf, and the prompt's cached entries are constants (the layer hands the attention
the pass's own keys and values as computed, ``CacheLayer.update``). Each layer's attention gives a
differentiable output and keeps what its reconstruction attention needs (``gradient_pass_output``). Once the
forward is done, Φ = Σ_p ‖h_p‖² over the last decoder layer's outputs is differentiated with respect to every
attention module's output; each query's weight is the norm of its gradient there, and each layer records its
reconstruction attention weighted by it and by ‖W_o v‖ (``engine.replay.replay_statistics``), as kvpress's
KVgradPress computes it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from kvbench.engine.replay import attention_modules, replay_statistics
from kvbench.engine.visibility import KeyAccess, visibility
from kvbench.policies.inputs import Replay

if TYPE_CHECKING:
    from kvbench.engine.cache.cache import KVCache
    from kvbench.engine.cache.layer import CacheLayer
    from kvbench.engine.step import Reconstruction


def gradient_pass_output(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer: CacheLayer | None,
    span: Reconstruction,
    access: KeyAccess,
) -> torch.Tensor:
    """A gradient pass's output [1, q, hq, Dv], differentiable with respect to the query and the pass's own keys
    and values, from SDPA with GQA (no copy of the keys per query head): with the lower-right causal bias where
    every past entry is visible (the mask autograd keeps is then [q, n], not one per query head), else with a KV
    head's query heads as one operand and the layer's mask; a softcapped family's logits are materialised. What
    ``replay_statistics`` reads is kept on ``layer`` (a layer whose policy replays; None for one that does not,
    e.g. a sliding layer kept to its window) for after the backward."""
    if layer is not None:
        layer.pending_replay = (query.detach(), key.detach(), value.detach(), span, access)
    _, hq, q, dim = query.shape
    hkv, n = key.shape[1], key.shape[2]
    group = hq // hkv
    if access.softcap is None and access.visible is None and access.window is None:
        # Every past entry visible, the pass's own causal: the lower-right causal bias, no mask per query head.
        bias = causal_lower_right(q, n)
        output = F.scaled_dot_product_attention(query, key, value, bias, scale=access.scaling, enable_gqa=True)
        return output.transpose(1, 2).contiguous()
    allowed = visibility(access.past, 0, q, n, access.visible, key.device, access.window)  # [1 or hkv, q, n]
    mask = allowed.unsqueeze(1).expand(-1, group, q, n).reshape(1, allowed.shape[0], group * q, n)
    grouped = query.reshape(1, hkv, group * q, dim)
    if access.softcap is None:
        output = F.scaled_dot_product_attention(grouped, key, value, attn_mask=mask, scale=access.scaling)
    else:
        logits = torch.matmul(grouped, key.transpose(-1, -2)) * access.scaling
        logits = torch.tanh(logits / access.softcap) * access.softcap
        probs = logits.masked_fill(~mask, float("-inf")).softmax(dim=-1, dtype=torch.float32).to(value.dtype)
        output = torch.matmul(probs, value)
    return output.reshape(1, hq, q, -1).transpose(1, 2).contiguous()


def autograd_mode(replay: Replay | None) -> contextlib.AbstractContextManager:
    """Inference mode for a unit of the batch loop, except under a policy whose replay passes run a backward:
    autograd cannot record over tensors made in inference mode, so its caches are made without gradients."""
    return torch.no_grad() if replay is not None and replay.gradient else torch.inference_mode()


@contextlib.contextmanager
def gradient_pass(model: Any, cache: KVCache, wanted: bool) -> Iterator[None]:
    """Run the enclosed forward (a KVgrad replay pass, where ``wanted``) with a graph from its token embeddings,
    then weigh each query by ‖∂Φ/∂a_p‖ and record every layer's reconstruction attention."""
    if not wanted:
        yield
        return
    outputs: dict[int, torch.Tensor] = {}
    last: list[torch.Tensor] = []
    modules = attention_modules(model)
    final = _decoder_layer_of(model, modules[-1])

    def leaf(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return output.detach().requires_grad_(True)

    def keep_output(module: torch.nn.Module, args: tuple, output: Any) -> None:
        outputs[int(module.layer_idx)] = output[0] if isinstance(output, tuple) else output  # type: ignore[arg-type]

    def keep_last(module: torch.nn.Module, args: tuple, output: Any) -> None:
        last[:] = [output[0] if isinstance(output, tuple) else output]

    hooks = [model.get_input_embeddings().register_forward_hook(leaf), final.register_forward_hook(keep_last)]
    hooks += [m.register_forward_hook(keep_output) for m in modules]
    trainable = [p for p in model.parameters() if p.requires_grad]
    try:
        for p in trainable:
            p.requires_grad_(False)
        with torch.enable_grad():
            yield
            objective = last[0].float().square().sum()
            order = sorted(outputs)
            grads = torch.autograd.grad(objective, [outputs[i] for i in order], allow_unused=True)
    finally:
        for hook in hooks:
            hook.remove()
        for p in trainable:
            p.requires_grad_(True)
    outputs.clear()
    for i, grad in zip(order, grads):
        _record(cache.kv_layers[i], grad)


def _record(layer: CacheLayer, grad: torch.Tensor | None) -> None:
    """One layer's reconstruction attention, each query weighed by its gradient's norm (grad [1, q, hidden]; None:
    the objective does not depend on the layer's output, every weight 0)."""
    pending, layer.pending_replay = layer.pending_replay, None
    if pending is None:  # a layer whose policy does not replay
        return
    query, key, value, span, access = pending
    norms = torch.zeros(query.shape[2], device=query.device) if grad is None else grad[0].float().norm(dim=-1)
    layer.query_log_weight = norms.log()
    try:
        layer.record(replay_statistics(query, key, value, layer, span, access))
    finally:
        layer.query_log_weight = None


def _decoder_layer_of(model: Any, attention: torch.nn.Module) -> torch.nn.Module:
    """The decoder layer holding an attention module: its parent in the model's module tree."""
    name = next(n for n, m in model.named_modules() if m is attention)
    return model.get_submodule(name.rsplit(".", 1)[0])
