"""The scope that protects the prompt: a decode-time method evicts only what was generated (TriAttention)."""

from __future__ import annotations

import torch

from kvbench.policies.base import Scope
from kvbench.policies.parts import register_scope
from kvbench.policies.state import TokenState


@register_scope("prompt")
class Prompt(Scope):
    """Protect every entry of the prompt (and its suffix: every token fed before decoding began); a budget
    smaller than the prompt protects the prompt's first ``budget`` entries, so generated entries compete for
    what the prompt leaves."""

    def protected(self, state: TokenState, budget: int) -> torch.Tensor:
        if state.prompt is None:
            raise ValueError("scope=prompt needs the number of prompt tokens, which this view does not carry")
        in_prompt = state.positions < torch.as_tensor(state.prompt, device=state.positions.device)
        first = torch.cumsum(in_prompt.to(torch.long), dim=1) <= budget
        out = in_prompt & first
        return out if state.valid is None else out & state.valid
