"""Decode-time sparsity: a policy part that chooses, per query, which held keys the attention reads, and never
evicts (Quest). The cache holds every entry; the attention of a decode step consults the part (``select``) and
attends only what it chose. The budget is then a count of attended keys per query, not of held ones.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class Sparsity(ABC):
    """Which held keys each decode query attends. Prompt chunks attend every key: a sparsity part runs only in
    ``stage=decode`` (the stages it refuses, and why, are declared here)."""

    unsupported_stages: tuple[str, ...] = ("prefill", "both")
    why_unsupported = (
        "it chooses the keys each decode query attends and never evicts, so it has no meaning for the prompt"
    )

    @abstractmethod
    def applies(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` attends sparsely (else it attends every held key)."""

    @abstractmethod
    def select(
        self,
        queries: torch.Tensor,
        keys: torch.Tensor,
        positions: torch.Tensor,
        visible: torch.Tensor | None,
        query_positions: torch.Tensor,
        budgets: torch.Tensor,
    ) -> torch.Tensor:
        """Bool [rows, group, n]: which keys each query head of a row attends. ``queries`` [rows, group, D] (one
        per query head of the row's GQA group), ``keys`` [rows, n, D], their absolute ``positions`` [rows, n] (-1
        where a slot is free), ``visible`` [rows, n] (None: every held key), the query's position [rows] and
        each row's budget of attended keys [rows]. Never True where a key is not visible."""

    @abstractmethod
    def metadata_bytes(self, held: torch.Tensor, k_dim: int, element_bytes: int) -> torch.Tensor:
        """Bytes the part keeps beside each row holding ``held`` entries (any shape; keys of ``k_dim`` dims, in
        elements of ``element_bytes``): what the memory columns count beside the entries."""
