"""Attention a block of queries at a time: the statistics a policy needs, and the output from the same
probabilities, with no n×n matrix ever held.

A block reads only the keys it can see: none past its last query (causality hides them from all of it) and, on
a sliding-window layer, none before the window of its first query. Where causality alone hides keys, only the
block's own (the diagonal) are masked. The block's products go into one reused buffer, its softmax is taken in
place, and its sums over queries are matrix products, so that a prefill with statistics costs little more than
the attention itself (``docs/perf/prefill.md``). Everything is computed in float32, whatever the model's dtype:
a probability summed over thousands of queries needs the precision.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch

from kvbench.engine.visibility import Window, visibility

# Upper bound on attention-probability elements materialised at once (statistics, blocked output, masks).
STATS_BLOCK_ELEMENTS = 1 << 22


def softcapped(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Gemma 2's logit softcapping, in place: cap · tanh(logit / cap)."""
    if softcap is None:
        return logits
    return logits.div_(softcap).tanh_().mul_(softcap)


def query_blocks(first: int, q: int, past: int, n: int, heads: int,
                 window: Window | None) -> Iterator[tuple[int, int, int]]:
    """(start, end, lo) per block of the step's queries from ``first``: the block attends keys ``lo`` to
    ``past + end``, and holds at most about ``STATS_BLOCK_ELEMENTS`` logits."""
    span = n if window is None else min(n, 2 * window.size)  # keys a block of at most `size` queries sees
    rows = max(1, STATS_BLOCK_ELEMENTS // (heads * span))
    if window is not None:
        rows = min(rows, window.size)
    starts = list(range(first, q, rows))
    lows = window.first_keys(starts) if window is not None and starts else [0] * len(starts)
    for start, lo in zip(starts, lows):
        yield start, min(q, start + rows), lo


def attention_statistics(query: torch.Tensor, key: torch.Tensor, scaling: float, past: int,
                         visible_past: torch.Tensor | None, needs: frozenset[str], history: int = 0,
                         window: Window | None = None, softcap: float | None = None,
                         value: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The per-token statistics the policy needs from this step's attention, per KV head and key:

    - ``acc`` / ``sumsq``: sums over the step's queries of the attention probability (and of its square);
    - ``last``: the last query's row;
    - ``qlog`` [hkv, r, n] and ``qlog_nvis`` [hkv, r]: the rows of the step's last r = min(q, history) queries
      and how many keys each of them could see (the layer keeps them in a ring of ``history`` rows);
    - ``output`` (only with ``value``): the attention output [1, q, hq, Dv] from the same probabilities.

    GQA: probabilities are computed per query head, then the query heads of a group are reduced to their
    KV head by the MEAN (a group's heads share the cached entry, so the entry's importance is their average).
    """
    _, hq, q, dim = query.shape
    hkv, n = key.shape[1], key.shape[2]
    group = hq // hkv
    device = key.device
    qh = (query[0].to(torch.float32) * scaling).view(hkv, group, q, dim)
    kt = key[0].to(torch.float32).transpose(-1, -2)  # [hkv, dim, n], a view
    sums = [name for name in ("acc", "sumsq") if name in needs]
    out = {name: torch.zeros(hkv, n, device=device) for name in sums}
    log_from = q - min(q, history) if "qlog" in needs else q
    if log_from < q:
        out["qlog"] = torch.zeros(hkv, q - log_from, n, device=device)
        out["qlog_nvis"] = torch.zeros(hkv, q - log_from, device=device)
    output = vh = None
    if value is not None:
        vh = value[0].to(torch.float32)
        output = torch.empty(hkv, group, q, vh.shape[-1], device=device)
    # Sums (and the output) need every query; the last row and the query log only the step's last queries.
    first = 0 if output is not None or sums else min(log_from, q - 1 if "last" in needs else q)
    blocks = list(query_blocks(first, q, past, n, hq, window))
    if not blocks:
        return out
    causal_only = visible_past is None and window is None
    largest = max((end - start) * (past + end - lo) for start, end, lo in blocks)
    buffer = torch.empty(hq * largest, device=device)  # every block's logits, then probabilities, in turn
    ones = torch.ones(hkv, 1, group * max(end - start for start, end, _ in blocks), device=device)
    for start, end, lo in blocks:
        rows, hi = end - start, past + end
        cols = hi - lo
        logits = buffer[: hq * rows * cols].view(hkv, group * rows, cols)
        torch.bmm(qh[:, :, start:end].reshape(hkv, group * rows, dim), kt[:, :, lo:hi], out=logits)
        grid = softcapped(logits, softcap).view(hkv, group, rows, cols)
        if causal_only:  # only the block's own keys are hidden, from the queries before them
            if rows > 1:
                later = torch.ones(rows, rows, dtype=torch.bool, device=device).triu_(1)
                grid[..., past + start - lo :].masked_fill_(later, float("-inf"))
            nvis = torch.arange(past + start + 1, hi + 1, device=device, dtype=torch.float32).unsqueeze(0)
        else:
            allowed = visibility(past, start, end, hi, visible_past, device, window, lo)  # [hkv or 1, rows, cols]
            grid.masked_fill_(~allowed.unsqueeze(1), float("-inf"))
            nvis = allowed.sum(dim=-1).to(torch.float32)
        torch.softmax(logits, dim=-1, out=logits)
        if output is not None:
            output[:, :, start:end] = torch.bmm(logits, vh[:, lo:hi]).view(hkv, group, rows, -1)
        # The group's mean row per query, where a statistic needs it; the sums alone take every head's rows.
        mean = grid[:, 0] if group == 1 else grid.mean(dim=1) if needs & {"sumsq", "last", "qlog"} else None
        if "acc" in out:  # a product with ones: the sum over the block's queries (and the group's heads)
            if mean is not None:
                out["acc"][:, lo:hi] += torch.bmm(ones[:, :, :rows], mean).view(hkv, cols)
            else:
                out["acc"][:, lo:hi] += torch.bmm(ones[:, :, : group * rows], logits).view(hkv, cols).div_(group)
        if "last" in needs and end == q:
            out["last"] = torch.zeros(hkv, n, device=device)
            out["last"][:, lo:hi] = mean[:, -1]
        if end > log_from:
            low = max(start, log_from)
            out["qlog"][:, low - log_from : end - log_from, lo:hi] = mean[:, low - start :]
            out["qlog_nvis"][:, low - log_from : end - log_from] = nvis[:, low - start :].expand(hkv, -1)
        if "sumsq" in out:
            out["sumsq"][:, lo:hi] += torch.bmm(ones[:, :, :rows], mean.square()).view(hkv, cols)
    if output is not None:
        out["output"] = output.view(hq, q, -1).transpose(0, 1).unsqueeze(0).to(query.dtype)
    return out
