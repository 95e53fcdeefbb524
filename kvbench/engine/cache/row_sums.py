"""The running per-row sums the policies declare (``policies.running``), kept as entries come and go.

``add`` takes new (or rewritten) entries in, ``remove`` takes leaving ones out: the cache calls ``add`` after a
write, ``Entries`` calls ``remove`` wherever it frees slots (before anything can overwrite them). A row's sum is
reduced over its own entries before it joins the row, so it does not depend on which rows share a step.
"""

from __future__ import annotations

import torch

from kvbench.engine.cache.store import KVStore, layer_runs
from kvbench.policies.running import RowSum


class RowSums:
    """Per declared name, float64 sums [layers × rows, F] (float32 on MPS, which has no float64); each layer keeps
    the sums its own policy declares (``declared[layer]``), from its own store."""

    def __init__(self, declared: list[tuple[RowSum, ...]], stores: list[KVStore], rows: int, device: torch.device):
        self.declared, self.stores, self.rows = declared, stores, rows
        self.dtype = torch.float32 if device.type == "mps" else torch.float64
        self.sums: dict[str, torch.Tensor] = {}
        self.device = device

    def _fold(self, layer: int, local: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor | None, sign: int) -> None:
        """Add (``sign`` 1) or subtract (-1) the vectors of layer ``layer``'s entries at ``slots`` [r, m] of its rows
        ``local`` [r] (only where ``mask`` [r, m] is True, if given)."""
        if not self.declared[layer] or slots.numel() == 0:
            return
        keys, values = self.stores[layer].gather(local, slots)
        at = layer * self.rows + local
        for part in self.declared[layer]:
            vectors = part.of(keys, values).to(self.dtype)
            if mask is not None:
                vectors = vectors.masked_fill(~mask.unsqueeze(-1), 0)
            total = vectors.sum(dim=1)
            self._sum(part.name, total.shape[-1]).index_add_(0, at, total, alpha=sign)

    def add(self, layer: int, local: torch.Tensor, slots: torch.Tensor) -> None:
        """Layer ``layer``'s entries at ``slots`` [r, m] of its rows ``local`` [r] were written."""
        self._fold(layer, local, slots, None, 1)

    def remove(self, rows: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """The entries at ``slots`` [r, m] of flat rows ``rows`` [r] (layer × rows + row) leave (only where ``mask``
        [r, m] is True, if given). Rows come grouped by layer, as every eviction lists them."""
        for layer, start, end in layer_runs(rows, self.rows):
            part = None if mask is None else mask[start:end]
            self._fold(layer, rows[start:end] - layer * self.rows, slots[start:end], part, -1)

    def rebuild(self, occupied: torch.Tensor, slots_used: list[int]) -> None:
        """Every sum again from the entries held (``occupied`` [layers, rows, capacity]), as the stores now keep them
        (after their key channels were pruned: a key's sum has the kept channels' width)."""
        self.sums.clear()
        for layer, n in enumerate(slots_used):
            local = torch.arange(self.rows, device=self.device)
            slots = torch.arange(n, device=self.device).expand(self.rows, n)
            self._fold(layer, local, slots, occupied[layer, :, :n], 1)

    def read(self, rows: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """The sums of flat rows ``rows`` (None: all), as float32 [r, F] by name."""
        return {
            name: (s if rows is None else s.index_select(0, rows)).to(torch.float32) for name, s in self.sums.items()
        }

    def copy_rows(self, source: RowSums, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Flat rows ``src`` of ``source`` become flat rows ``dst`` here."""
        for name, s in source.sums.items():
            self._sum(name, s.shape[-1])[dst] = s[src].to(self.dtype)

    def _sum(self, name: str, width: int) -> torch.Tensor:
        if name not in self.sums:
            self.sums[name] = torch.zeros(len(self.declared) * self.rows, width, dtype=self.dtype, device=self.device)
        return self.sums[name]
