"""One forward of the batch loop as a value: which lanes it feeds, at which positions, in which phase, whether it
evicts, whether the attention collects statistics, and what masked replay lets each row see.

The batch loop builds a ``Step`` and hands it down: to the cache (``KVCache.begin`` / ``finish``), through it to
each layer's write, and to the eviction at its end (``evict.Evictor``). Nothing below the loop decides any of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench.stages import Phase, Stage

__all__ = ["Phase", "Reconstruction", "Stage", "Step"]


@dataclass(frozen=True)
class Reconstruction:
    """A replay pass after the prompt (``policies.inputs.Replay``, KVzip): it repeats the prompt's positions
    ``start:end``, and its queries' scoring softmax spans the first ``sinks`` positions, those and its own tokens.
    Its own entries leave the cache when it finishes; it evicts when it is the last pass."""

    start: int
    end: int
    sinks: int


@dataclass(frozen=True)
class Step:
    """Lanes ``lanes`` (consecutive) each fed tokens at the absolute ``positions`` (one list per lane, all of one
    length). ``evicts``: rows over their budget evict once every layer has attended (in a decode step, those of
    the lanes whose decode schedule is due: ``Evictor.due``). ``collects``: the attention reduces the statistics
    the policy reads (this step or a later one evicts). ``prepares``: the step is near enough to an eviction for
    it to read what the step computes: it logs its queries' rows (``Logged`` statistics: the log holds only the
    last queries before an eviction) and writes the features of the entries fed since the last one; false in a
    decode step whose lanes all evict more than ``max(history, 1)`` steps later (``Evictor.prepares``).
    ``replay_masks``: masked replay, per layer [rows of the lanes, positions so far] — which positions each row
    may see (None: what it holds). ``attended``: under a decode-time sparsity (``Policy.sparsity``), each lane's
    budget of keys a decode query attends (None: every visible key). ``replay``: the step is a replay pass of the
    prompt (None: it feeds the sequence)."""

    lanes: range
    positions: list[list[int]]
    phase: Phase
    evicts: bool
    collects: bool
    prepares: bool = True
    replay_masks: list[torch.Tensor] | None = None
    attended: list[int] | None = None
    replay: Reconstruction | None = None

    def __post_init__(self) -> None:
        if len(self.positions) != len(self.lanes) or len({len(p) for p in self.positions}) != 1:
            raise ValueError("a step feeds each of its lanes the same number of tokens")

    @property
    def tokens(self) -> int:
        """Tokens fed to each lane: 1 in a decode step."""
        return len(self.positions[0])
