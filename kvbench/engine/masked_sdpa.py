"""transformers' SDPA over a prompt chunk's keys, masked to what the layer shows each query (causal inside the
chunk, its visibility and sliding window over the past)."""

from __future__ import annotations

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvbench.engine.blocked import query_blocks
from kvbench.engine.visibility import KeyAccess, visibility


def masked_sdpa(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, access: KeyAccess
) -> torch.Tensor:
    """transformers' SDPA over the step's keys, masked as the layer's visibility says; a windowed chunk is
    attended a block of queries at a time, so its mask never spans the whole chunk at once."""
    q, n = query.shape[2], key.shape[2]
    group = query.shape[1] // key.shape[1]
    past, window, scaling = access.past, access.window, access.scaling
    if access.visible is None and window is None:
        mask = visibility(past, 0, q, n, None, key.device).unsqueeze(0) if q > 1 and past > 0 else None
        return sdpa_attention_forward(
            module, query, key, value, mask, dropout=0.0, scaling=scaling, is_causal=mask is None and q > 1
        )[0]
    outputs = []
    for start, end, lo in query_blocks(0, q, past, n, query.shape[1], window):
        hi = past + end  # keys past the block's last query, and before its window, are hidden from all of it
        mask = visibility(past, start, end, hi, access.visible, key.device, window, lo)
        if mask.shape[0] > 1:
            mask = mask.repeat_interleave(group, dim=0)
        outputs.append(
            sdpa_attention_forward(
                module,
                query[:, :, start:end],
                key[:, :, lo:hi],
                value[:, :, lo:hi],
                mask.unsqueeze(0),
                dropout=0.0,
                scaling=scaling,
                is_causal=False,
            )[0]
        )
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)
