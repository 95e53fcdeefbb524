"""How much each layer holds: the budget's meaning on full-attention and sliding-window layers.

A full-attention layer holds the policy's budget (split across layers by the policy's allocation). On a hybrid
model (sliding and full layers, as Gemma 2/3 or Qwen2 with ``use_sliding_window``), by default a sliding layer
holds at most its window and no more: what serving engines do, and exact, since its next query sees only the
window. ``policy.sliding_layers=evict`` applies the policy inside sliding layers too, at ``min(budget, window -
1)``. A model whose every layer slides (Mistral v0.1) has no other layer to spend a budget on, so there the
policy always evicts in the sliding layers, holding at most min(budget, window - 1) entries.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvbench.policies.full import never_evicting
from kvbench.policies.policy import Policy
from kvbench.stages import Phase


@dataclass
class LayerPlan:
    """What one layer of one sequence may hold: its token budget in the policy's evicting steps (None = the policy
    never evicts here) and the most entries a row holds while the prompt is fed (``prefill``) and while
    decoding (``decode``), of ``total`` tokens in all. A sliding-window layer (``window``) also drops, after every
    step, what its next query cannot see: each head keeps at most its newest ``window - 1`` entries (``window_keep``),
    which is exact. ``policy`` replaces the run's policy in this layer (a sliding layer that only holds its
    window)."""

    budget: int | None
    prefill: int
    decode: int
    total: int
    window: int | None = None
    policy: Policy | None = None
    observe: int | None = None  # the prompt's last tokens that are its question, for a score that observes it

    @property
    def window_keep(self) -> int | None:
        return None if self.window is None else self.window - 1

    def rows_capacity(self, heads: int, phases: tuple[Phase, ...], policy: Policy, layers: int = 1) -> int:
        """Slots a row needs in a cache that serves ``phases``. Under per-head allocation one head may come to
        hold most of its layer's ``heads × budget``; when the split spans the ``layers`` layers
        (``Allocation.pools_layers``), most of all their rows' ``layers × heads × budget``."""
        cap = max((self.prefill if phase is Phase.prefill else self.decode) for phase in phases)
        if policy.allocation.per_head and self.budget is not None:
            sharing = heads * (layers if policy.allocation.pools_layers else 1)
            cap = max(cap, min(self.total, cap + (sharing - 1) * self.budget))  # a replay pass may exceed total
        return cap


def plan_capacity(
    stage: str,
    budget: int | None,
    context: int,
    suffix: int,
    max_new: int,
    chunk: int,
    interval: int = 1,
    replay: int = 0,
) -> tuple[int, int]:
    """The most tokens a layer holds while the prompt (and suffix) is fed, and while decoding (a decode step
    evicts every ``interval`` steps, so a row holds up to ``interval`` entries past its budget in the step that
    evicts). ``replay``: the longest replay pass (KVzip's), fed over the whole prompt before it evicts."""
    total = context + suffix + max_new
    if budget is None:
        return context + max(suffix, replay), total
    prefill_evicts = stage in ("prefill", "both")
    decode_evicts = stage in ("decode", "both")
    held_in_prefill = min(context, budget + chunk) if prefill_evicts else context
    if replay and prefill_evicts:
        held_in_prefill = context + replay
    after_prefill = min(context, budget) if prefill_evicts else context
    after_suffix = after_prefill + suffix
    decode = max(after_suffix, budget) + interval if decode_evicts else after_suffix + max_new
    return max(held_in_prefill if replay else 0, min(total, max(held_in_prefill, after_suffix))), min(total, decode)


def evicts_in_sliding_layers(policy: Policy, windows: list[int | None]) -> bool:
    """Whether the policy evicts inside the sliding layers (else they only hold their window)."""
    sliding = [w is not None for w in windows]
    return policy.evicts and any(sliding) and (policy.sliding_layers == "evict" or all(sliding))


def sliding_problem(policy: Policy, windows: list[int | None]) -> str | None:
    """What this policy cannot do on these layers, or None: merging would fold entries that left the window
    (never visible again) into kept ones, changing the model's function even at a full budget."""
    if policy.merge and evicts_in_sliding_layers(policy, windows):
        return (
            "a merging policy (policy.merge) cannot evict inside sliding-window layers (an entry that left the "
            "window would be folded into kept ones); use policy.sliding_layers=window on a hybrid model, or "
            "policy.merge=false"
        )
    if policy.rereads and any(w is not None for w in windows):
        return (
            f"policy={policy.name} feeds the prompt twice and scores the first pass by the second's attention, which "
            "a sliding-window layer cannot hold; use a model without sliding-window layers"
        )
    return None


def window_only(policy: Policy) -> Policy:
    """What a sliding layer runs when the policy leaves it alone: it holds its window, stored as the policy
    stores entries (quantised, re-indexed, its key channels pruned)."""
    return never_evicting(policy.name, policy.quantize, policy.positions, channels=policy.channels)


def budget_layers(policy: Policy, windows: list[int | None]) -> list[int]:
    """The layers the policy's budget is split over: every full-attention layer, and the sliding ones where the
    policy evicts inside them."""
    in_sliding = evicts_in_sliding_layers(policy, windows)
    return [i for i, w in enumerate(windows) if w is None or in_sliding]


def layers_problem(policy: Policy, windows: list[int | None]) -> str | None:
    """Why the policy's allocation cannot split its budget over these layers (a per-layer list of another
    length), or None."""
    return policy.allocation.layers_problem(len(budget_layers(policy, windows))) if policy.evicts else None


def plan_layers(
    policy: Policy,
    budget: int | None,
    windows: list[int | None],
    stage: str,
    context: int,
    suffix: int,
    max_new: int,
    chunk: int,
    replay: int = 0,
    observe: int | None = None,
) -> list[LayerPlan]:
    """One plan per decoder layer (``windows``: each layer's sliding window, None for full attention); ``replay``:
    the longest replay pass the prompt gets (KVzip's), which every layer holds over what it holds of the prompt;
    ``observe``: the question's tokens at the prompt's end, for a score that observes them."""
    problem = sliding_problem(policy, windows)
    if problem:
        raise ValueError(problem)
    evicting = budget_layers(policy, windows)
    budgets: dict[int, int | None] = dict.fromkeys(range(len(windows)))
    if budget is not None and evicting:
        # No layer needs more than it will ever hold in an evicting step.
        limit = context if stage == "prefill" else context + suffix + max_new
        evicting_windows = [w for i in evicting if (w := windows[i]) is not None]
        if len(evicting_windows) == len(evicting):  # every one slides: none can hold more than its window - 1
            limit = min(limit, min(evicting_windows) - 1)
        budgets.update(zip(evicting, policy.layer_budgets(budget, len(evicting), limit)))
    plans, held_window = [], window_only(policy)
    total = context + suffix + max_new
    for i, window in enumerate(windows):
        b = budgets[i]
        if window is None:
            caps = plan_capacity(stage, b, context, suffix, max_new, chunk, policy.interval, replay)
            plans.append(LayerPlan(b, *caps, total))
            continue
        hold_cap = plan_capacity("both", window - 1, context, suffix, max_new, chunk)
        if replay:  # the prompt's window, then a replay pass
            hold_cap = (max(hold_cap[0], min(context, window - 1) + replay), hold_cap[1])
        if i in evicting and b is not None:
            b = min(b, window - 1)
            caps = plan_capacity(stage, b, context, suffix, max_new, chunk, policy.interval, replay)
            plans.append(LayerPlan(b, min(hold_cap[0], caps[0]), min(hold_cap[1], caps[1]), total, window))
        else:
            plans.append(LayerPlan(None, *hold_cap, total, window, policy=held_window))
    return [replace(plan, observe=observe) for plan in plans] if observe is not None else plans
