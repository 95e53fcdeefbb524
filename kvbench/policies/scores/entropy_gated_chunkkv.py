"""Entropy-gated ChunkKV: ChunkKV whose spiky important chunks keep only their best few tokens."""

from __future__ import annotations

import torch

from kvbench.policies.base import Score, ScoreWrapper
from kvbench.policies.grouped import depth_in_group, lexicographic, places
from kvbench.policies.parts import register_score
from kvbench.policies.registry import build_score
from kvbench.policies.state import TokenState

EPS = 1e-8  # kvpress's guard in the chunk's distribution and its logarithm


@register_score("entropy_gated_chunkkv")
class EntropyGatedChunkKV(ScoreWrapper):
    """ChunkKV gated by the entropy of the ``base`` scores inside each chunk (kvpress's EntropyGatedChunkKVPress).

    Positions fall into chunks of ``chunk`` tokens. A chunk's score is the mean base score over the entries it
    holds; its entropy is that of its base scores made a distribution (shifted up by their minimum where one is
    negative, divided by their sum), over the log of the entries it holds (0 for a chunk holding one). Chunks are
    visited best first, each taking what is left of the row's budget, up to all it holds; a chunk at or above the
    median chunk score whose entropy is below the median entropy (important but spiky) takes only its best
    ``low_entropy_chunk`` entries. Budget left after the last chunk goes to the best entries not yet taken, so the
    row keeps exactly its budget. Medians are the lower middle value over the chunks holding an entry, as
    ``torch.median``.

    kvpress guards the distribution with 1e-8 added to a chunk's total, in its own units: the heads' sum of its
    SnapKV scores, each the mean over the window's queries. kvbench's shared SnapKV score is the heads' mean of the
    sum over the window, ``window / heads`` times kvpress's, so the guard here is 1e-8 × window / heads (``window``
    the base's observation window, 1 for a base without one; ``heads`` 1 for a base that is not ``shared``). The
    entropy barely moves, but chunks within 1e-6 of the median entropy are then ordered as kvpress orders them
    (docs/peers.md).

    The score is each entry's place in that order: the entries taken first (best chunk first, then by the base
    score), then the rest by base score, so the budget keeps what the greedy pass and its top-up keep. The pass
    reads the eviction's budget, so it is meant for the uniform allocation with nothing protected by the scope
    (configs/policy/entropy_gated_chunkkv.yaml); without a budget (a profile) it orders as plain ChunkKV."""

    def __init__(self, base: str | dict = "snapkv", chunk: int = 10, low_entropy_chunk: int = 4):
        if not int(chunk) > int(low_entropy_chunk) >= 1:
            raise ValueError(
                f"entropy_gated_chunkkv needs chunk > low_entropy_chunk >= 1, not chunk={chunk}, "
                f"low_entropy_chunk={low_entropy_chunk}"
            )
        super().__init__(build_score(base))
        self.chunk = int(chunk)
        self.low = int(low_entropy_chunk)
        self.window = base_window(self.inner)

    def __call__(self, state: TokenState) -> torch.Tensor:
        scores = self.inner(state).to(torch.float32)
        valid = state.valid_mask()
        outside = state.outside_window()  # a sliding layer's entries its next query cannot see: in no chunk
        if outside is not None:
            valid = valid & ~outside
        slots = int(state.positions.max()) // self.chunk + 1  # one more: padding
        chunk = torch.where(valid, state.positions // self.chunk, slots)
        held = torch.zeros(scores.shape[0], slots + 1, device=scores.device).scatter_add_(1, chunk, valid.float())
        counts = held[:, :slots]
        s = scores.masked_fill(~valid, 0.0)
        mean = torch.zeros_like(held).scatter_add_(1, chunk, s)[:, :slots] / counts.clamp_min(1)
        heads = state.heads // state.units if self.inner.shares_heads else 1
        entropy = chunk_entropy(s, valid, chunk, counts, slots, EPS * self.window / heads)
        holding = counts > 0
        high = mean >= lower_median(mean, holding)
        spiky = entropy < lower_median(entropy, holding)
        wants = torch.where(high & spiky, counts.clamp(max=self.low), counts)
        by_score = mean.masked_fill(~holding, float("-inf"))
        visit = torch.sort(-by_score, dim=-1, stable=True).indices  # best chunk first (ties: the earlier)
        rank = places(visit)
        budget = state.length if state.budget is None else state.budget
        before = wants.gather(1, visit).cumsum(dim=1).gather(1, rank) - wants
        taken = (budget - before).clamp_min(0).minimum(wants)  # what each chunk takes of the budget left
        padded = torch.nn.functional.pad(taken, (0, 1))
        depth = depth_in_group(scores.masked_fill(~valid, float("-inf")), chunk, slots)
        first = valid & (depth < padded.gather(1, chunk))
        if state.budget is None:  # no eviction under way: ChunkKV's order
            first_key = torch.nn.functional.pad(rank, (0, 1), value=slots).gather(1, chunk)
        else:
            first_key = torch.where(first, 0, torch.where(valid, 1, 2))
        order = lexicographic(first_key, -scores.masked_fill(~valid, float("-inf")))
        return -places(order).to(torch.float32)


def base_window(score: Score) -> int:
    """The observation window of ``score`` or of the score it wraps (SnapKV's ``window``), else 1."""
    while True:
        window = getattr(score, "window", None)
        if isinstance(window, int):
            return window
        if not isinstance(score, ScoreWrapper):
            return 1
        score = score.inner


def chunk_entropy(
    scores: torch.Tensor, valid: torch.Tensor, chunk: torch.Tensor, counts: torch.Tensor, slots: int, guard: float = EPS
) -> torch.Tensor:
    """Each chunk's normalised entropy of its scores, [H, slots], in [0, 1]; 0 for a chunk holding one entry.
    ``guard`` is added to a chunk's total (in the scores' units); the logarithm's guard is EPS (the distribution's
    own, unitless)."""
    lowest = torch.full((scores.shape[0], slots + 1), float("inf"), device=scores.device)
    lowest = lowest.scatter_reduce(1, chunk, scores.masked_fill(~valid, float("inf")), reduce="amin")
    shift = lowest.clamp(max=0.0).nan_to_num(posinf=0.0).gather(1, chunk)
    shifted = (scores - shift).masked_fill(~valid, 0.0)
    total = torch.zeros_like(lowest).scatter_add_(1, chunk, shifted)
    p = shifted / (total.gather(1, chunk) + guard)
    h = torch.zeros_like(lowest).scatter_add_(1, chunk, (-p * (p + EPS).log()).masked_fill(~valid, 0.0))[:, :slots]
    norm = counts.clamp_min(2).log()
    return torch.where(counts > 1, (h / norm).clamp(0.0, 1.0), torch.zeros_like(h))


def lower_median(values: torch.Tensor, holding: torch.Tensor) -> torch.Tensor:
    """Per row, the lower middle of ``values`` over the chunks ``holding`` an entry, [H, 1] (``torch.median``)."""
    k = holding.sum(dim=1, keepdim=True)
    ordered = torch.sort(values.masked_fill(~holding, float("inf")), dim=-1).values
    return ordered.gather(1, ((k - 1) // 2).clamp_min(0))
