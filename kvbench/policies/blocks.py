"""Row blocks for scores whose intermediates grow with the square of a row's length or with its GQA group: the
rows of a group (every layer of a prompt, at once) are scored a few at a time, so memory stays bounded."""

from __future__ import annotations

from collections.abc import Callable

import torch

# The most elements one block's largest intermediate may hold (64 MiB of float32).
BLOCK_ELEMENTS = 1 << 24


def by_row_blocks(fn: Callable[..., torch.Tensor], tensors: tuple[torch.Tensor, ...], per_row: int) -> torch.Tensor:
    """``fn(*tensors)`` computed on blocks of rows (the first dim of every tensor) and concatenated; ``per_row``:
    the elements ``fn``'s largest intermediate holds per row."""
    rows = tensors[0].shape[0]
    step = max(1, BLOCK_ELEMENTS // max(1, per_row))
    if step >= rows:
        return fn(*tensors)
    return torch.cat([fn(*(t[i : i + step] for t in tensors)) for i in range(0, rows, step)])
