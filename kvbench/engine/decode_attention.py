"""Attention of one query per sequence over its rows' keys (a decode step), with the statistics a policy reads
from the same probabilities."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvbench.engine.blocked import softcapped
from kvbench.engine.visibility import KeyAccess
from kvbench.policies.statistics import NOTHING, Collecting, Latest, Logged, Summed, attention_names, declared

# A decode-time sparsity's choice for a decode step: (queries [rows, group, D], keys [rows, n, D], visible
# [rows, n] or None) to the keys each query head attends, bool [rows, group, n].
Selector = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    access: KeyAccess,
    collecting: Collecting = NOTHING,
    select: Selector | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One query per sequence (query [B, heads, 1, D]) over its rows' keys [B, kv_heads, n, D], each row seeing
    what ``access.visible`` [B × kv_heads, n] and its window show (None: every key), and each query head of it
    only what ``select`` chooses of that (None: all of it). Returns the attention output
    in the layout transformers' attention functions return ([B, 1, heads, Dv]) and the statistics of
    ``attention_statistics`` for that query ([B × kv_heads, n] each), both from one set of probabilities
    (float32). Each row is its own batched product: a sequence's result does not depend on the others'."""
    b, hq, _, dim = query.shape
    hkv, n = key.shape[1], key.shape[2]
    rows, group = b * hkv, hq // hkv
    qh = query.reshape(rows, group, dim).float() * access.scaling
    keys = key.reshape(rows, n, dim).float()
    logits = softcapped(torch.bmm(qh, keys.transpose(1, 2)), access.softcap)  # [rows, group, n]
    visible = access.visible
    if access.window is not None:
        in_window = access.window.allowed(0, 1)[:, 0]  # [rows, n]
        visible = in_window if visible is None else visible & in_window
    if select is not None:
        logits = logits.masked_fill(~select(qh, keys, visible), float("-inf"))
    elif visible is not None:
        logits = logits.masked_fill(~visible.unsqueeze(1), float("-inf"))
    probs = logits.softmax(dim=-1)
    output = torch.bmm(probs, value.reshape(rows, n, -1).float()).to(query.dtype).view(b, 1, hq, -1)
    return output, _decode_statistics(probs, None if visible is None else visible.sum(dim=-1), collecting)


def _decode_statistics(
    probs: torch.Tensor, counts: torch.Tensor | None, collecting: Collecting
) -> dict[str, torch.Tensor]:
    """The statistics of one query's probabilities [rows, group, n]; ``counts`` [rows]: how many keys each row
    saw (None: all n)."""
    stats: dict[str, torch.Tensor] = {}
    needs = collecting.needs
    if not attention_names(needs):
        return stats
    row = probs.mean(dim=1)  # GQA: the group's mean, [rows, n]
    for summed in declared(needs, Summed):
        stats[summed.name] = row if summed.of is None else summed.of(row)
    for latest in declared(needs, Latest):
        stats[latest.name] = row
    for log in declared(needs, Logged) if collecting.history > 0 else ():
        stats[log.name] = row.unsqueeze(1)
        hkv, n = row.shape
        stats[f"{log.name}_nvis"] = (
            torch.full((hkv, 1), float(n), device=row.device)
            if counts is None
            else counts.to(torch.float32).unsqueeze(1)
        )
    return stats
