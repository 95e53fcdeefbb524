"""Masked replay: a run fed a traced run's kept sets, so each step attends to what the traced run held there
(``Request.replay_trace``); used to check an eviction against the family's eager attention over the same keys."""

from __future__ import annotations

import torch

from kvbench.engine.sequence import Sequence


def replay_masks(
    layers: int, seqs: list[Sequence], positions: list[list[int]], device: torch.device
) -> list[torch.Tensor] | None:
    """Per layer [rows of the lanes, positions so far]: each row's past down to what the traced run held at this
    step, by position, and the step's own tokens; None when no sequence replays a trace or none has fed yet."""
    traced = [s.request.replay_trace for s in seqs]
    if all(t is None for t in traced) or all(s.forwards == 0 for s in seqs):
        return None
    if any(t is None for t in traced):
        raise ValueError("masked replay needs a trace for every sequence of the batch")
    width = max(p[-1] for p in positions) + 1
    masks: list[torch.Tensor] = []
    for layer in range(layers):
        rows = []
        for s, p, trace in zip(seqs, positions, traced):
            assert trace is not None, "checked above: every sequence has a trace"
            held = trace[s.forwards - 1][layer].to(device)
            by_position = torch.zeros(held.shape[0], width, dtype=torch.bool, device=device)
            by_position.scatter_(1, held, True)
            by_position[:, p[0] :] = True  # the step's own tokens
            rows.append(by_position)
        masks.append(torch.cat(rows))
    return masks
