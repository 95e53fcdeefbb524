"""One decoder layer's face of the cache: its K/V store and what the current step's keys are."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import CacheLayerMixin

from kvbench.engine.cache.store import KVStore
from kvbench.engine.plan import LayerPlan
from kvbench.engine.visibility import Window
from kvbench.policies.base import Policy
from kvbench.policies.positions import Rotary
from kvbench.policies.state import TokenState

if TYPE_CHECKING:
    from kvbench.engine.cache.cache import KVCache


class CacheLayer(CacheLayerMixin):
    """One decoder layer: its K/V store and what the current step's keys are."""

    is_compileable = False
    is_sliding = False

    def __init__(self, cache: KVCache, layer_idx: int, plan: LayerPlan, rotary: Rotary | None = None):
        super().__init__()
        # A proxy: the cache owns its layers, and no cycle keeps a finished prompt's cache alive until a collection.
        self.cache = weakref.proxy(cache)
        self.layer_idx, self.plan, self.capacity = layer_idx, plan, 0
        self.policy: Policy = plan.policy or cache.policy
        self._store: KVStore | None = None
        # Under positions=reindex: this layer's RoPE (layers may differ: Gemma 3's local and global tables).
        self.rotary = rotary if rotary is not None and rotary.rot_dim > 0 else None
        # The step's keys: how many (slots 0:n), how many precede the step's own (q > 1), which are visible
        # ([rows, n] for a decode step, [rows, past] for a chunk; None: all) and their positions [rows, n].
        self.n = self.past = 0
        self.visible: torch.Tensor | None = None
        self.key_positions: torch.Tensor | None = None

    def attach(self, store: KVStore) -> None:
        """The layer's K/V buffers, allocated by the cache once it knows their shapes."""
        self._store, self.capacity, self.is_initialized = store, store.capacity, True

    @property
    def store(self) -> KVStore:
        """The layer's K/V buffers; they exist from the cache's first write on (``attach``)."""
        assert self._store is not None, "the cache attaches every layer's store on its first write"
        return self._store

    def begin_step(self, n: int, past: int, visible: torch.Tensor | None, key_positions: torch.Tensor) -> None:
        """This step's keys: slots ``0:n``, of which ``past`` precede the step's own (all of them in a decode
        step), which are visible and at which positions."""
        self.n, self.past, self.visible, self.key_positions = n, past, visible, key_positions

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache.write(self.layer_idx, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.n or query_length, 0

    def get_seq_length(self) -> int:
        return self.n

    def get_max_length(self) -> int:
        return self.capacity

    def reset(self) -> None:
        raise RuntimeError("a kvbench cache is built per run; it is never reset")

    def state(self, slot: int = 0) -> TokenState:
        """What this layer holds for the sequence in ``slot``, as its policy ranks it."""
        return self.cache.layer_state(self.layer_idx, slot)

    def step_window(self, size: int | None) -> Window | None:
        """The step's sliding window over its keys, or None where every visible key is inside it."""
        if size is None:
            return None
        cache = self.cache
        queries = cache.query_positions  # [rows, q]
        keys = self.key_positions
        assert keys is not None, "begin_step sets the step's key positions before the layer attends"
        held = (
            keys
            if self.visible is None or self.visible.shape[1] != keys.shape[1]
            else keys.masked_fill(~self.visible, -1)
        )
        oldest = held.masked_fill(held < 0, torch.iinfo(held.dtype).max).amin(dim=1)
        if bool((queries[:, -1] - oldest < size).all()):
            return None
        return Window(size, held, queries)
