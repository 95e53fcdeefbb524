"""A step under way, as every layer's write reads it: where the step's new entries went and which keys it reads.

The cache builds one ``Feeding`` per step, at the step's first layer write (the first moment the shapes are
known), and hands it to each layer's ``update``; it goes when the step finishes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench.engine.step import Step


@dataclass(frozen=True)
class Feeding:
    """``step``'s new entries: their entry slots ``slots`` [layers, rows, q] in the rows ``rows`` of the step's
    lanes (within a layer), the slots ``0:key_spans[l]`` that hold every key layer l reads, and whether those
    keys have no free slot among them (``gapless``: nothing to mask). ``positions`` [lanes, q] are the tokens'
    absolute positions, ``model_positions`` what the model was fed (the same unless ``positions: reindex``),
    ``query_positions`` [rows, q] the positions per row. ``lengths_before`` [layers, rows]: under reindex,
    how many entries each row held before the step."""

    step: Step
    rows: torch.Tensor
    slots: torch.Tensor
    key_spans: list[int]
    gapless: list[bool]
    positions: torch.Tensor
    model_positions: torch.Tensor
    query_positions: torch.Tensor
    lengths_before: torch.Tensor | None
