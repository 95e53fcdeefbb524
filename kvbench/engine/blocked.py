"""Attention a block of queries at a time: the statistics a policy needs, and the output from the same
probabilities, with no n×n matrix ever held.

A block reads only the keys it can see: none past its last query (causality hides them from all of it) and, on
a sliding-window layer, none before the window of its first query. Where causality alone hides keys, only the
block's own (the diagonal) are masked. The block's products go into one reused buffer, its exponentials are
taken in place, its sums over queries are matrix products, and the blocks are split across the CPU threads, so
that a prefill with statistics costs little more than the attention itself (``docs/perf/prefill.md``).
Everything is computed in float32, whatever the model's dtype: a probability summed over thousands of queries
needs the precision.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from kvbench.engine.visibility import KeyAccess, Window, visibility
from kvbench.engine.workers import split_across_threads
from kvbench.policies.statistics import NOTHING, Collecting, Latest, Logged, Summed, declared

# Upper bound on attention-probability elements materialised at once (statistics, blocked output, masks).
STATS_BLOCK_ELEMENTS = 1 << 22


def softcapped(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Gemma 2's logit softcapping, in place: cap · tanh(logit / cap)."""
    if softcap is None:
        return logits
    return logits.div_(softcap).tanh_().mul_(softcap)


def query_blocks(
    first: int, q: int, past: int, n: int, heads: int, window: Window | None
) -> Iterator[tuple[int, int, int]]:
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


def attention_statistics(
    query: torch.Tensor,
    key: torch.Tensor,
    access: KeyAccess,
    collecting: Collecting = NOTHING,
    value: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The per-token statistics ``collecting.needs`` names from this step's attention (its queries seeing its keys
    as ``access`` says), per KV head and key, as each is declared (``kvbench.policies.statistics``):

    - each ``Summed`` one (``acc``, ``sumsq``, ...): its function of the probability, summed over the step's queries;
    - each ``Latest`` one (``last``): the last query's row;
    - the ``Logged`` one (``qlog`` [hkv, r, n] and ``qlog_nvis`` [hkv, r]): the rows of the step's last
      r = min(q, collecting.history) queries and how many keys each of them could see (the layer keeps a ring of them);
    - ``output`` (only with ``value``): the attention output [1, q, hq, Dv] from the same probabilities.

    GQA: probabilities are computed per query head, then the query heads of a group are reduced to their
    KV head by the MEAN (a group's heads share the cached entry, so the entry's importance is their average).

    The probabilities are first taken as exp(logit) / Σ exp(logit), without subtracting the row's maximum:
    float32 holds that to its rounding as long as no exponential overflows and no row's sum underflows, and it saves
    two passes over every block. Where either happens the step is computed again the usual way.
    """
    out = _blocked_pass(query, key, access, collecting, value, False)
    if out is None:
        out = _blocked_pass(query, key, access, collecting, value, True)
        assert out is not None, "the shifted pass always stays in range"
    return out


# Row sums of exponentials outside (TINY_SUM, inf) mean the unshifted exponentials lost precision.
TINY_SUM = 1e-30


@dataclass
class _Step:
    """What every block of one step reads (shared by the threads that attend its blocks)."""

    queries: torch.Tensor  # [hkv, q, group, dim], scaled, rows in (query, head) order
    keys: torch.Tensor  # [hkv, dim, n]
    values: torch.Tensor | None  # [hkv, n, Dv]
    output: torch.Tensor | None  # [hkv, q, group, Dv], each block writes its own rows
    access: KeyAccess
    summed: tuple[Summed, ...]
    latest: tuple[Latest, ...]
    log: str | None  # the query log's name, if it is kept
    log_from: int  # the first query the query log keeps
    shifted: bool  # subtract each row's maximum before the exponential (else normalise unshifted sums)


def _blocked_pass(
    query: torch.Tensor,
    key: torch.Tensor,
    access: KeyAccess,
    collecting: Collecting,
    value: torch.Tensor | None,
    shifted: bool,
) -> dict[str, torch.Tensor] | None:
    """``attention_statistics``; with ``shifted`` False, None where an unshifted exponential fell out of range."""
    _, hq, q, dim = query.shape
    hkv, n = key.shape[1], key.shape[2]
    group = hq // hkv
    device = key.device
    # Rows in (query, head) order, so that a block's queries and its output are contiguous slices.
    queries = (query[0].to(torch.float32) * access.scaling).view(hkv, group, q, dim).transpose(1, 2).contiguous()
    keys = key[0].to(torch.float32).transpose(-1, -2).contiguous()  # [hkv, dim, n]: faster products than a view
    values = output = None
    if value is not None:
        values = value[0].to(torch.float32)
        output = torch.empty(hkv, q, group, values.shape[-1], device=device)
    needs = collecting.needs
    logs = declared(needs, Logged)
    log = logs[0].name if logs else None
    log_from = q - min(q, collecting.history) if log is not None else q
    summed, latest = declared(needs, Summed), declared(needs, Latest)
    step = _Step(queries, keys, values, output, access, summed, latest, log, log_from, shifted)
    # Sums (and the output) need every query; the last row and the query log only the step's last queries.
    first = 0 if output is not None or summed else min(log_from, q - 1 if latest else q)
    blocks = list(query_blocks(first, q, access.past, n, hq, access.window))
    parts = split_across_threads(lambda share: _attend_blocks(step, share), blocks, device)
    out = _empty_statistics(step, hkv, q, n)
    for part, in_range in parts:
        if not in_range:
            return None
        for name, value_ in part.items():
            out[name] += value_
    if output is not None:
        out["output"] = output.transpose(0, 1).reshape(1, q, hq, -1).to(query.dtype)
    return out


def _empty_statistics(step: _Step, hkv: int, q: int, n: int) -> dict[str, torch.Tensor]:
    device = step.keys.device
    out: dict[str, torch.Tensor] = {s.name: torch.zeros(hkv, n, device=device) for s in step.summed + step.latest}
    if step.log is not None and step.log_from < q:
        out[step.log] = torch.zeros(hkv, q - step.log_from, n, device=device)
        out[f"{step.log}_nvis"] = torch.zeros(hkv, q - step.log_from, device=device)
    return out


def _attend_blocks(step: _Step, blocks: Sequence[tuple[int, int, int]]) -> tuple[dict[str, torch.Tensor], bool]:
    """One thread's share of the step's blocks: their statistics (zero outside them), their rows of the
    output, and whether every unshifted row sum stayed inside float32's range."""
    hkv, q, group, dim = step.queries.shape
    n = step.keys.shape[-1]
    device, access = step.keys.device, step.access
    past = access.past
    out = _empty_statistics(step, hkv, q, n)
    if not blocks:
        return out, True
    causal_only = access.visible is None and access.window is None
    largest = max((end - start) * (past + end - lo) for start, end, lo in blocks)
    most = max(end - start for start, end, _ in blocks)
    buffer = torch.empty(hkv * group * largest, device=device)  # each block's logits, then probabilities
    later = torch.ones(most, most, dtype=torch.bool, device=device).triu_(1).unsqueeze(1)  # [query, head, own key]
    smallest, biggest = [], []
    for start, end, lo in blocks:
        rows, hi = end - start, past + end
        cols = hi - lo
        logits = buffer[: hkv * group * rows * cols].view(hkv, rows * group, cols)
        torch.bmm(step.queries[:, start:end].view(hkv, rows * group, dim), step.keys[:, :, lo:hi], out=logits)
        grid = softcapped(logits, access.softcap).view(hkv, rows, group, cols)
        if causal_only:  # only the block's own keys are hidden, from the queries before them
            if rows > 1:
                grid[..., past + start - lo :].masked_fill_(later[:rows, :, :rows], float("-inf"))
            nvis = torch.arange(past + start + 1, hi + 1, device=device, dtype=torch.float32).unsqueeze(0)
        else:
            allowed = visibility(past, start, end, hi, access.visible, device, access.window, lo)  # [hkv or 1, r, c]
            grid.masked_fill_(~allowed.unsqueeze(2), float("-inf"))
            nvis = allowed.sum(dim=-1).to(torch.float32)
        inverse = None
        if step.shifted:
            torch.softmax(logits, dim=-1, out=logits)
        else:  # unnormalised: each row's 1 / Σ exp scales what is read from it
            total = logits.exp_().sum(dim=-1, keepdim=True)  # [hkv, rows·group, 1]
            smallest.append(total.amin())
            biggest.append(total.amax())
            inverse = total.reciprocal_()
        if step.output is not None:
            assert step.values is not None, "a step with an output has its values"
            block_output = step.output[:, start:end].view(hkv, rows * group, -1)
            torch.bmm(logits, step.values[:, lo:hi], out=block_output)
            if inverse is not None:
                block_output.mul_(inverse)
        _fold_block(step, out, grid, inverse, lo, hi, start, end, nvis)
    in_range = not smallest or bool(torch.stack(smallest).min() > TINY_SUM and torch.stack(biggest).max().isfinite())
    return out, in_range


def _group_mean(grid: torch.Tensor, inverse: torch.Tensor | None, rows: slice = slice(None)) -> torch.Tensor:
    """The mean over a GQA group's heads of their probability rows [hkv, rows, cols]; ``inverse``
    [hkv, rows·group, 1] normalises unnormalised rows on the way. One batched product of each row's group
    with its weights: cheaper than a reduction over the head dimension, or than additions."""
    hkv, _, group, cols = grid.shape
    part = grid[:, rows]
    if inverse is None:
        if group == 1:
            return part[:, :, 0]
        weights = torch.full((hkv * part.shape[1], 1, group), 1.0 / group, device=grid.device)
    else:
        weights = inverse.view(hkv, -1, group)[:, rows].reshape(-1, 1, group) / group
    return torch.bmm(weights, part.reshape(-1, group, cols)).view(hkv, -1, cols)


def _fold_block(
    step: _Step,
    out: dict[str, torch.Tensor],
    grid: torch.Tensor,
    inverse: torch.Tensor | None,
    lo: int,
    hi: int,
    start: int,
    end: int,
    nvis: torch.Tensor,
) -> None:
    """Add one block's probabilities [hkv, rows, group, cols] (keys ``lo`` to ``hi``; unnormalised where
    ``inverse`` is given) to the statistics, each as declared; the block's buffer is not read again."""
    hkv, rows, group, cols = grid.shape
    q, log_from, log = step.queries.shape[1], step.log_from, step.log
    wants_last, wants_log = bool(step.latest) and end == q, log is not None and end > log_from
    if wants_last or wants_log:  # the group's mean of the rows they read (the step's last queries)
        low = max(start, log_from) if wants_log else end - 1
        mean = _group_mean(grid, inverse, slice(low - start, None))
        for latest in step.latest if wants_last else ():
            out[latest.name][:, lo:hi] = mean[:, -1]
        if wants_log:
            assert log is not None, "a block that logs has a log"
            out[log][:, low - log_from : end - log_from, lo:hi] = mean
            out[f"{log}_nvis"][:, low - log_from : end - log_from] = nvis[:, low - start :].expand(hkv, -1)
    if any(s.of is not None for s in step.summed):  # a function of each query's group mean: every query's mean
        mean = _group_mean(grid, inverse)
        ones = torch.ones(hkv, 1, rows, device=grid.device)
        for summed in step.summed:
            value = mean if summed.of is None else summed.of(mean)
            out[summed.name][:, lo:hi] += torch.bmm(ones, value).view(hkv, cols)
    elif step.summed:  # the probabilities alone: one product sums the block's queries and the group's heads
        weights = (
            torch.full((hkv, 1, rows * group), 1.0 / group, device=grid.device)
            if inverse is None
            else inverse.transpose(1, 2) / group
        )
        total = torch.bmm(weights, grid.view(hkv, rows * group, cols)).view(hkv, cols)
        for summed in step.summed:
            out[summed.name][:, lo:hi] += total
