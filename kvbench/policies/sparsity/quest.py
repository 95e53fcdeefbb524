"""Quest (Tang et al. 2024, arXiv:2406.10774): query-aware page selection at decode time.

A row's keys are cut into pages of ``page_size`` consecutive positions (page ``position // page_size``); each page
is summarised by the per-channel minimum and maximum of its keys. A query bounds the logit any key of a page can
reach by ``sum_c max(q_c · min_c, q_c · max_c)`` and attends only the pages with the highest bounds. Nothing is
evicted: the cache holds every entry, so this is the sparsity reference eviction is set against, not a saving.

How kvbench reads the paper:

- The budget is a count of attended keys: ``ceil(budget / page_size)`` pages per query head (rounded up, as every
  kvbench budget is), the page holding the current token among them. A budget of at least the sequence's length
  attends every page: the full cache exactly.
- Per query head: each head of a GQA group ranks the pages by its own bound (the paper's per-head reading; on a
  model without GQA a query head is a KV head). The KV head is read for the union of its group's pages.
- The first ``dense_layers`` layers attend every key (the paper leaves its first two layers dense), and so do
  sliding-window layers and every prompt chunk.
- The page bounds are taken over the keys a query may see (on every decode step, from the held keys: as nothing
  is evicted they are the bounds the paper keeps); the memory columns count them as kept, two key vectors a page.
"""

from __future__ import annotations

import math

import torch

from kvbench.policies.parts import register_sparsity
from kvbench.policies.sparse import Sparsity


@register_sparsity("quest")
class Quest(Sparsity):
    """Per page of ``page_size`` keys the channel-wise min and max; each decode query attends its top pages."""

    def __init__(self, page_size: int = 16, dense_layers: int = 2):
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"sparsity.page_size={page_size!r} must be a positive integer (keys per page; 16)")
        if isinstance(dense_layers, bool) or not isinstance(dense_layers, int) or dense_layers < 0:
            raise ValueError(
                f"sparsity.dense_layers={dense_layers!r} must be an integer >= 0 (leading layers that attend every "
                "key; 2)"
            )
        self.page_size, self.dense_layers = page_size, dense_layers

    def applies(self, layer: int) -> bool:
        return layer >= self.dense_layers

    def pages(self, budget: torch.Tensor) -> torch.Tensor:
        """Pages a query attends for a budget of ``budget`` keys: rounded up, at least the current one."""
        return ((budget + self.page_size - 1) // self.page_size).clamp_min(1)

    def select(
        self,
        queries: torch.Tensor,
        keys: torch.Tensor,
        positions: torch.Tensor,
        visible: torch.Tensor | None,
        query_positions: torch.Tensor,
        budgets: torch.Tensor,
    ) -> torch.Tensor:
        rows, n, dim = keys.shape
        seen = positions >= 0 if visible is None else visible & (positions >= 0)
        count = int(positions.max()) // self.page_size + 1
        page = torch.where(seen, positions // self.page_size, count)  # keys it may not see go to a spare page
        index = page.unsqueeze(-1).expand(rows, n, dim)
        k = keys.float()
        lows = torch.full((rows, count + 1, dim), math.inf, device=k.device).scatter_reduce_(1, index, k, "amin")
        highs = torch.full((rows, count + 1, dim), -math.inf, device=k.device).scatter_reduce_(1, index, k, "amax")
        present = torch.zeros(rows, count + 1, device=k.device).scatter_add_(1, page, seen.float())[:, :count] > 0
        lows, highs = lows[:, :count].nan_to_num(0.0, 0.0, 0.0), highs[:, :count].nan_to_num(0.0, 0.0, 0.0)
        q = queries.float()
        up = q.clamp_min(0)  # max(q·min, q·max) per channel is q·max where q >= 0, q·min where q < 0
        bound = torch.bmm(up, highs.transpose(1, 2)) + torch.bmm(q - up, lows.transpose(1, 2))  # [rows, group, pages]
        bound = bound.masked_fill(~present.unsqueeze(1), -math.inf)
        current = (query_positions // self.page_size).view(rows, 1, 1).expand(-1, q.shape[1], 1)
        bound = bound.scatter(2, current, math.inf)
        wanted = self.pages(budgets).clamp_max(count)  # [rows]
        top = torch.topk(bound, int(wanted.max()), dim=-1).indices  # best first
        ranked = (torch.arange(top.shape[-1], device=k.device) < wanted.view(rows, 1, 1)).expand_as(top)
        chosen = torch.zeros_like(bound, dtype=torch.bool).scatter_(2, top, ranked) & present.unsqueeze(1)
        entry_pages = page.clamp_max(count - 1).unsqueeze(1).expand(-1, q.shape[1], -1)
        return chosen.gather(2, entry_pages) & seen.unsqueeze(1)

    def metadata_bytes(self, held: torch.Tensor, k_dim: int, element_bytes: int) -> torch.Tensor:
        """A minimum and a maximum key vector per page begun."""
        return (held + self.page_size - 1) // self.page_size * (2 * k_dim * element_bytes)
