"""A transformers ``Cache`` whose layers hold pre-allocated K/V buffers and evict through a policy.

Each layer keeps, per KV head, the absolute position of every kept token and the per-token
statistics its policy asked for. Eviction gathers the kept rows to the front of the same buffers,
so memory never grows past the capacity fixed before the run.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvbench.policies.base import Policy, TokenState

# Per-token statistics a layer can keep; each is a float32 buffer [kv_heads, capacity].
STAT_NAMES = ("acc", "sumsq", "count", "last", "hits")


@dataclass
class LayerPlan:
    """What one layer may hold: its token budget (None = never evict) and its buffer capacity."""

    budget: int | None
    capacity: int


class BudgetedLayer(CacheLayerMixin):
    is_compileable = False
    is_sliding = False

    def __init__(self, layer_idx: int, plan: LayerPlan, policy: Policy, cache: "BudgetedCache"):
        super().__init__()
        self.layer_idx = layer_idx
        self.plan = plan
        self.policy = policy
        self.cache = cache
        self.length = 0
        self.positions: torch.Tensor | None = None
        self.stats: dict[str, torch.Tensor] = {}
        # Replay support: which kept past entries the next step may see, [kv_heads, length] bool.
        self.visible_past: torch.Tensor | None = None

    # -- transformers' layer contract ------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, _, dim = key_states.shape
        if batch != 1:
            raise ValueError("BudgetedCache runs one sequence at a time (batch size 1)")
        cap = self.plan.capacity
        self.device, self.dtype = key_states.device, key_states.dtype
        self.keys = torch.zeros(1, heads, cap, dim, dtype=key_states.dtype, device=self.device)
        self.values = torch.zeros(1, heads, cap, value_states.shape[-1], dtype=value_states.dtype, device=self.device)
        self.positions = torch.zeros(heads, cap, dtype=torch.long, device=self.device)
        self.stats = {
            name: torch.zeros(heads, cap, dtype=torch.float32, device=self.device)
            for name in self.policy.needs
            if name in STAT_NAMES
        }
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        end = self.length + n
        if end > self.plan.capacity:
            raise RuntimeError(
                f"layer {self.layer_idx}: {end} tokens exceed the pre-allocated capacity {self.plan.capacity}"
            )
        self.keys[:, :, self.length : end] = key_states
        self.values[:, :, self.length : end] = value_states
        self.positions[:, self.length : end] = self.cache.step_positions
        for buf in self.stats.values():
            buf[:, self.length : end] = 0.0
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.plan.capacity

    def reset(self) -> None:
        self.length = 0

    # -- kvbench's own steps -----------------------------------------------------------------
    def observe(self, n_new: int, stats: dict[str, torch.Tensor]) -> None:
        """Fold this step's attention statistics in and count the new tokens as held."""
        total = self.length + n_new
        for name, value in stats.items():
            if name == "last":
                self.stats["last"][:, :total] = value
            elif name in self.stats:
                self.stats[name][:, :total] += value
        if "count" in self.stats:
            # Queries of this step that could see each entry: every one for the past, fewer inside the chunk.
            self.stats["count"][:, : self.length] += n_new
            self.stats["count"][:, self.length : total] += torch.arange(
                n_new, 0, -1, device=self.device, dtype=torch.float32
            )
        self.length = total

    def state(self) -> TokenState:
        n = self.length
        return TokenState(
            keys=self.keys[0, :, :n],
            values=self.values[0, :, :n],
            positions=self.positions[:, :n],
            stats={k: v[:, :n] for k, v in self.stats.items()},
            layer_idx=self.layer_idx,
            generator=self.cache.generator,
        )

    def evict_to_budget(self) -> None:
        budget = self.plan.budget
        if budget is None or self.length <= budget:
            return
        keep = self.policy.select(self.state(), budget)  # [kv_heads, budget] sorted indices
        self.compact(keep)

    def compact(self, keep: torch.Tensor) -> None:
        """Move the kept rows of every buffer to the front, in place."""
        k = keep.shape[-1]
        idx = keep.unsqueeze(0).unsqueeze(-1)
        self.keys[:, :, :k] = self.keys.gather(2, idx.expand(-1, -1, -1, self.keys.shape[-1]))
        self.values[:, :, :k] = self.values.gather(2, idx.expand(-1, -1, -1, self.values.shape[-1]))
        self.positions[:, :k] = self.positions.gather(1, keep)
        for buf in self.stats.values():
            buf[:, :k] = buf.gather(1, keep)
        self.length = k

    def resident_bytes(self) -> int:
        if not self.is_initialized:
            return 0
        per_token = self.keys.shape[1] * (self.keys.shape[-1] + self.values.shape[-1]) * self.keys.element_size()
        return self.length * per_token

    def capacity_bytes(self) -> int:
        if not self.is_initialized:
            return 0
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()


@dataclass
class CacheStats:
    kept_per_layer: list[int] = field(default_factory=list)
    resident_bytes: int = 0
    capacity_bytes: int = 0


class BudgetedCache(Cache):
    """One ``BudgetedLayer`` per decoder layer, sharing the policy and the positions of the step."""

    def __init__(self, plans: list[LayerPlan], policy: Policy, seed: int = 0, device: torch.device | str = "cpu"):
        self.policy = policy
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.step_positions = torch.zeros(0, dtype=torch.long, device=device)
        self.evicting = False
        super().__init__(layers=[BudgetedLayer(i, plan, policy, self) for i, plan in enumerate(plans)])

    def begin_step(self, positions: torch.Tensor, evicting: bool) -> None:
        """Set the absolute positions of the tokens about to be fed and whether this step may evict."""
        self.step_positions = positions
        self.evicting = evicting

    def after_attention(self, layer_idx: int, n_new: int, stats: dict[str, torch.Tensor]) -> None:
        """Called by the attention function once the layer's output is computed (H2O's order)."""
        layer = self.layers[layer_idx]
        layer.observe(n_new, stats)
        layer.visible_past = None
        if self.evicting:
            layer.evict_to_budget()

    def summary(self) -> CacheStats:
        return CacheStats(
            kept_per_layer=[layer.length for layer in self.layers],
            resident_bytes=sum(layer.resident_bytes() for layer in self.layers),
            capacity_bytes=sum(layer.capacity_bytes() for layer in self.layers),
        )

    def kept_positions(self) -> list[torch.Tensor]:
        """Per layer, the absolute positions held by each KV head, [kv_heads, kept]."""
        return [layer.positions[:, : layer.length].clone() for layer in self.layers]
