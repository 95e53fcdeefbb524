"""The first layer's keys and values, as the scores saw them at their evictions.

They depend on no other token (the token's embedding, projected and rotated), so a NumPy reference can replay a
chunked prompt's evictions from them whatever the cache held: the tests of block-wise and chunked scores read them
here instead of calling the model a second time."""

from __future__ import annotations

import numpy as np

from kvbench.policies.state import TokenState


class LayerZero:
    """Collects, per KV head and position, the key and value of layer 0 (rows ``row_keys < heads`` of lane 0)."""

    def __init__(self, heads: int):
        self.heads = heads
        self.seen: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}

    def record(self, state: TokenState) -> None:
        valid = state.valid_mask()
        for r, key in enumerate(state.row_keys.flatten().tolist()):
            if key >= self.heads:
                continue
            for j in valid[r].nonzero().flatten().tolist():
                entry = (state.keys[r, j].double().numpy(), state.values[r, j].double().numpy())
                self.seen[(key, int(state.positions[r, j]))] = entry

    def keys(self, head: int, n: int) -> np.ndarray:
        """[n, D]: positions 0..n-1 of ``head``."""
        return np.stack([self.seen[(head, p)][0] for p in range(n)])

    def values(self, head: int, n: int) -> np.ndarray:
        return np.stack([self.seen[(head, p)][1] for p in range(n)])
