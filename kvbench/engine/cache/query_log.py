"""A row's query log: what each of its most recent queries gave every held entry, and the running sum.

Scores with a history (ScissorHands' hit counts, SnapKV's observation window) read the log's sum over its
queries; a query's own row matters only when it leaves the ring. The log is kept by entry slot (an entry keeps
its slot while held, see ``store``), so evicting moves nothing here. Query p of a sequence goes to ring place
``p % history``: the place depends on the sequence alone, never on which rows share a step, so a sequence's
log is the same in any batch. A new entry's slot is cleared. The sum takes each new query's row minus the one
it replaces and is recomputed from the ring whenever a row's ring wraps, so rounding never outlives one ring.
"""

from __future__ import annotations

import torch


class QueryLog:
    """``rows`` [R, history, slots], their sum ``total`` [R, slots] and ``nvis`` [R, history] (how many entries
    each logged query could see), for R rows."""

    def __init__(self, rows: int, slots: int, history: int, device: torch.device):
        self.history = history
        self.rows = torch.zeros(rows, history, slots, dtype=torch.float32, device=device)
        self.total = torch.zeros(rows, slots, dtype=torch.float32, device=device)
        self.nvis = torch.zeros(rows, history, dtype=torch.float32, device=device)

    def clear(self, at: torch.Tensor) -> None:
        """Entries ``at`` (flat indices into [R × slots]) go to new entries: no logged query saw them."""
        slots = self.total.shape[1]
        r, s = at // slots, at % slots
        self.rows[r, :, s] = 0.0
        self.total.view(-1)[at] = 0.0

    def append(
        self,
        rows: slice,
        logged: torch.Tensor,
        nvis: torch.Tensor,
        places: list[int] | torch.Tensor,
        wrapped: list[int],
    ) -> None:
        """Log the step's last queries for rows ``rows``: ``logged`` [r, k, n] over slots ``0:n``, ``nvis`` [r, k].
        ``places``: each logged query's ring place, the same for every row (k > 1: one sequence's prompt chunk)
        or one per row ([r], long, k == 1: a decode step of several sequences). ``wrapped``: rows (counted from
        ``rows.start``) whose ring wraps with this step."""
        n, k = logged.shape[-1], logged.shape[1]
        ring, total = self.rows[rows], self.total[rows]
        if k == 1 and isinstance(places, torch.Tensor):
            pick = torch.arange(ring.shape[0], device=ring.device)
            new = logged[:, 0]
            old = ring[pick, places, :n]
            total[:, :n] += new - old
            ring[pick, places, :n] = new
            self.nvis[rows][pick, places] = nvis[:, 0]
            for i in wrapped:
                total[i] = ring[i].sum(dim=0)
            return
        ring[:, places, :n] = logged
        self.nvis[rows][:, places] = nvis
        total.copy_(ring.sum(dim=1))
