"""One layer's keys and values: rows of (lane, KV head), each a pre-allocated run of entry slots.

An entry keeps its slot until it is evicted, so a decode step writes only the new entries and never moves the
held ones; the row's order (which slot holds its j-th entry) is bookkeeping (``entries.Entries``). Quantised
storage (``policy.quantize``) keeps int8/fp8 codes with a float32 scale per entry; reads dequantise. Pruned key
channels (``policy.channels``, ``prune``) leave the keys [rows, capacity, kept] and each row's channel index.
"""

from __future__ import annotations

import torch

from kvbench.policies.quantize import Quantizer


def flat_slots(rows: torch.Tensor, slots: torch.Tensor, capacity: int) -> torch.Tensor:
    """Slots ``slots`` [r, m] of rows ``rows`` [r] as indices into the flattened [rows × capacity] entries."""
    return (rows.unsqueeze(1) * capacity + slots).reshape(-1)


def layer_runs(flat: torch.Tensor, rows: int) -> list[tuple[int, int, int]]:
    """(layer, start, end) per run of ``flat`` (indices into [layers × rows], grouped by layer) in one layer."""
    layer_of = (flat // rows).tolist()
    runs, start = [], 0
    while start < len(layer_of):
        end = start
        while end < len(layer_of) and layer_of[end] == layer_of[start]:
            end += 1
        runs.append((layer_of[start], start, end))
        start = end
    return runs


class KVStore:
    """Keys and values [rows, capacity, D]: the model's dtype, or codes plus scales [rows, capacity, 1]."""

    def __init__(
        self,
        rows: int,
        capacity: int,
        k_dim: int,
        v_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        quantizer: Quantizer | None,
    ):
        self.quantizer, self.dtype, self.capacity = quantizer, dtype, capacity
        store = dtype if quantizer is None else quantizer.storage_dtype
        self.k = torch.zeros(rows, capacity, k_dim, dtype=store, device=device)
        self.v = torch.zeros(rows, capacity, v_dim, dtype=store, device=device)
        self.channels: torch.Tensor | None = None  # after ``prune``: each row's kept key channels, int16 [rows, kept]
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        if quantizer is not None:
            self.k_scale = torch.zeros(rows, capacity, 1, dtype=torch.float32, device=device)
            self.v_scale = torch.zeros(rows, capacity, 1, dtype=torch.float32, device=device)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.k, self.v, self.k_scale, self.v_scale) if t is not None]

    def _pairs(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        return [(self.k, self.k_scale), (self.v, self.v_scale)]

    def write(self, rows: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Entries at ``slots`` [r, q] of rows ``rows`` [r]: k [r, q, D], v [r, q, Dv]."""
        at = flat_slots(rows, slots, self.capacity)
        for (codes, scales), x in zip(self._pairs(), (k, v)):
            x = x.reshape(-1, x.shape[-1])
            if self.quantizer is None:
                codes.view(-1, codes.shape[-1]).index_copy_(0, at, x.to(codes.dtype))
            else:
                assert scales is not None, "a quantised store has scales"
                c, s = self.quantizer.quantize(x)
                codes.view(-1, codes.shape[-1]).index_copy_(0, at, c)
                scales.view(-1, 1).index_copy_(0, at, s)

    def prune(self, channels: torch.Tensor) -> None:
        """Keep only key channels ``channels`` [rows, kept] (ascending) of each row, for every entry held and to come
        (new keys come narrowed: ``narrow``). Codes are narrowed as they are: an entry's scale still bounds them."""
        rows, capacity, _ = self.k.shape
        at = channels.to(torch.long).unsqueeze(1).expand(rows, capacity, -1)
        self.k = self.k.gather(2, at).contiguous()
        self.channels = channels.to(torch.int16)

    def narrow(self, rows: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """Keys [r, q, D] of rows ``rows`` [r] as this store keeps them: their rows' kept channels (all, unpruned)."""
        if self.channels is None:
            return keys
        at = self.channels.index_select(0, rows).to(torch.long).unsqueeze(1).expand(-1, keys.shape[1], -1)
        return keys.gather(2, at)

    def _decode(self, codes: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
        if self.quantizer is None:
            return codes
        assert scales is not None, "a quantised store has scales"
        return self.quantizer.dequantize(codes, scales, self.dtype)

    def read(self, lo: int, hi: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots ``0:n`` of rows ``lo:hi``, [r, n, D] (views of the buffers when plain)."""

        def part(codes: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
            return self._decode(codes[lo:hi, :n], None if scales is None else scales[lo:hi, :n])

        (k, k_scale), (v, v_scale) = self._pairs()
        return part(k, k_scale), part(v, v_scale)

    def gather(self, rows: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Entries at ``slots`` [r, m] of rows ``rows`` [r]: [r, m, D] each."""
        at, shape = flat_slots(rows, slots, self.capacity), slots.shape

        def take(t: torch.Tensor) -> torch.Tensor:
            return t.view(-1, t.shape[-1]).index_select(0, at).view(*shape, t.shape[-1])

        def part(codes: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
            return self._decode(take(codes), None if scales is None else take(scales))

        (k, k_scale), (v, v_scale) = self._pairs()
        return part(k, k_scale), part(v, v_scale)

    def reorder(self, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Row ``rows[i]``'s entries at ``slots[i]`` [r, m] move to its slots ``0:m``, in that order."""
        at = flat_slots(rows, slots, self.capacity)
        m = slots.shape[1]
        for t in self.tensors():
            moved = t.view(-1, t.shape[-1]).index_select(0, at).view(len(rows), m, t.shape[-1])
            t[rows, :m] = moved

    def copy_rows(self, source: KVStore, src: slice, dst: slice, n: int) -> None:
        """Slots ``0:n`` of ``source``'s rows ``src`` into this store's rows ``dst``."""
        if source.channels is not None:
            if self.channels is None:  # a first lane from a pruned cache: the rows take its width
                self.prune(source.channels.new_zeros(self.k.shape[0], source.channels.shape[1]))
            assert self.channels is not None, "pruned just above"
            self.channels[dst] = source.channels[src]
        for mine, theirs in zip(self.tensors(), source.tensors()):
            mine[dst, :n] = theirs[src, :n]

    def row_bytes(self) -> int:
        """Bytes one entry (one token of one KV head) holds: K and V, plus their scales when quantised."""
        return sum(t.shape[-1] * t.element_size() for t in self.tensors())

    def index_bytes(self) -> int:
        """Bytes one row holds besides its entries: its kept key channels' index (none while unpruned)."""
        return 0 if self.channels is None else self.channels.shape[1] * self.channels.element_size()

    def capacity_bytes(self) -> int:
        index = 0 if self.channels is None else self.channels.numel() * self.channels.element_size()
        return sum(t.numel() * t.element_size() for t in self.tensors()) + index
