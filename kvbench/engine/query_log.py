"""A layer's query log: what each of the most recent queries gave every held entry, and its running sum.

Scores with a history (ScissorHands' hit counts, SnapKV's observation window) read the log's sum over its
rows; the rows themselves only matter when one leaves the ring. So the log is kept in *slot* space: each
entry owns a slot for as long as it is held (a pooled layer's row, a uniform layer's slot id), evicting
entries moves nothing here, and the sum is updated by the row a query adds minus the row it replaces. The
sum is recomputed from the rows whenever the ring wraps, so rounding never accumulates beyond one ring.
"""
from __future__ import annotations

import copy

import torch


class QueryLog:
    """Ring ``rows`` [G, history, slots] and their sum ``total`` [G, slots]; ``nvis`` [kv_heads, history]
    holds how many entries each logged query could see. A slot's values are meaningful only while an entry
    holds it: a slot is cleared when it is handed to a new entry."""

    def __init__(self, groups: int, slots: int, history: int, kv_heads: int, device: torch.device):
        self.history = history
        self.rows = torch.zeros(groups, history, slots, dtype=torch.float32, device=device)
        self.total = torch.zeros(groups, slots, dtype=torch.float32, device=device)
        self.nvis = torch.zeros(kv_heads, history, dtype=torch.float32, device=device)
        self.next = 0

    def reset(self) -> None:
        self.next = 0

    def groups(self, lo: int, hi: int, heads: int = 1) -> "QueryLog":
        """Groups ``lo:hi`` (and their ``nvis`` rows, ``heads`` per group) as a log of their own, sharing these
        buffers."""
        part = copy.copy(self)
        part.rows, part.total = self.rows[lo:hi], self.total[lo:hi]
        part.nvis = self.nvis[lo * heads : hi * heads]
        part.next = 0
        return part

    def clear(self, ids: torch.Tensor) -> None:
        """Slots ``ids`` [G, q] are handed to new entries: no logged query saw them."""
        self.rows.scatter_(2, ids.unsqueeze(1).expand(-1, self.history, -1), 0.0)
        self.total.scatter_(1, ids, 0.0)

    def append(self, logged: torch.Tensor, nvis: torch.Tensor, ids: torch.Tensor | None = None) -> None:
        """Log the step's last ``r`` queries: ``logged`` [G, r, n] over the entries in slots ``ids`` [G, n]
        (None: slots 0..n-1, in order), ``nvis`` [kv_heads, r]. Slots not covered keep stale values, which
        only free slots may have."""
        r = logged.shape[1]
        slots = [(self.next + i) % self.history for i in range(r)]
        wrapped = (self.next + r) // self.history > self.next // self.history
        self.next += r
        self.nvis[:, slots] = nvis
        if r == 1 and not wrapped:  # a decode step: the sum takes the new row and drops the one it replaces
            new, ring = logged[:, 0], self.rows[:, slots[0]]
            if ids is None:
                n = new.shape[-1]
                self.total[:, :n] += new - ring[:, :n]
                ring[:, :n] = new
            else:
                self.total.scatter_add_(1, ids, new - ring.gather(1, ids))
                ring.scatter_(1, ids, new)
            return
        for i, slot in enumerate(slots):
            if ids is None:
                self.rows[:, slot, : logged.shape[-1]] = logged[:, i]
            else:
                self.rows[:, slot].scatter_(1, ids, logged[:, i])
        torch.sum(self.rows, dim=1, out=self.total)

    def sums(self, ids: torch.Tensor) -> torch.Tensor:
        """The log's sum over its rows for the entries in slots ``ids`` [G, n]: [G, n]."""
        return self.total.gather(1, ids)

    def gathered(self, ids: torch.Tensor) -> torch.Tensor:
        """The log's rows for the entries in slots ``ids`` [G, n]: [G, history, n]."""
        return self.rows.gather(2, ids.unsqueeze(1).expand(-1, self.history, -1))

    def move(self, ids: torch.Tensor) -> None:
        """Slots ``ids`` [G, k] move to slots 0..k-1 (a pooled layer packing its rows)."""
        k = ids.shape[1]
        self.rows[:, :, :k] = self.gathered(ids)
        self.total[:, :k] = self.total.gather(1, ids)
